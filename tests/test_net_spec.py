"""NetSpec (pycaffe's net_spec.py): keyword rules, naming of layers and tops, and the
prototxt text pycaffe produces for the same specs (derived by following pycaffe's
algorithm by hand; float values are printed by protobuf's own text format)."""

import numpy as np
import pytest
from google.protobuf import text_format

import minicaffe as caffe
from minicaffe import layers as L, params as P
from minicaffe.compat.net_spec import param_name_dict, to_proto, Top, Function
from minicaffe.proto import caffe_pb2


def tutorial_lenet(lmdb, batch_size):
    """examples/01-learning-lenet.ipynb, verbatim."""
    n = caffe.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


def _float_text(value):
    """How ``str(message)`` (what pycaffe users write to files) prints ``value`` in a
    float field: it depends on the protobuf runtime, not on NetSpec."""
    return str(caffe_pb2.TransformationParameter(scale=value)).split(":", 1)[1].strip()


TUTORIAL_TRAIN = """\
layer {
  name: "data"
  type: "Data"
  top: "data"
  top: "label"
  transform_param {
    scale: SCALE
  }
  data_param {
    source: "mnist/mnist_train_lmdb"
    batch_size: 64
    backend: LMDB
  }
}
layer {
  name: "conv1"
  type: "Convolution"
  bottom: "data"
  top: "conv1"
  convolution_param {
    num_output: 20
    kernel_size: 5
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "pool1"
  type: "Pooling"
  bottom: "conv1"
  top: "pool1"
  pooling_param {
    pool: MAX
    kernel_size: 2
    stride: 2
  }
}
layer {
  name: "conv2"
  type: "Convolution"
  bottom: "pool1"
  top: "conv2"
  convolution_param {
    num_output: 50
    kernel_size: 5
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "pool2"
  type: "Pooling"
  bottom: "conv2"
  top: "pool2"
  pooling_param {
    pool: MAX
    kernel_size: 2
    stride: 2
  }
}
layer {
  name: "fc1"
  type: "InnerProduct"
  bottom: "pool2"
  top: "fc1"
  inner_product_param {
    num_output: 500
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "relu1"
  type: "ReLU"
  bottom: "fc1"
  top: "fc1"
}
layer {
  name: "score"
  type: "InnerProduct"
  bottom: "fc1"
  top: "score"
  inner_product_param {
    num_output: 10
    weight_filler {
      type: "xavier"
    }
  }
}
layer {
  name: "loss"
  type: "SoftmaxWithLoss"
  bottom: "score"
  bottom: "label"
  top: "loss"
}
"""


def test_tutorial_lenet_prototxt_text_is_pycaffes():
    text = str(tutorial_lenet('mnist/mnist_train_lmdb', 64))
    assert text == TUTORIAL_TRAIN.replace("SCALE", _float_text(1. / 255))
    # the test net differs only in source and batch size
    test_text = str(tutorial_lenet('mnist/mnist_test_lmdb', 100))
    assert 'source: "mnist/mnist_test_lmdb"' in test_text and "batch_size: 100" in test_text
    # and the text parses back to the same message
    p = caffe_pb2.NetParameter()
    text_format.Merge(text, p)
    assert p == tutorial_lenet('mnist/mnist_train_lmdb', 64)
    assert p.layer[0].transform_param.scale == np.float32(1. / 255)


def dummy_lenet(batch_size):
    """pycaffe's python/caffe/test/test_net_spec.py lenet()."""
    n = caffe.NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[batch_size, 1, 28, 28]),
                                         dict(dim=[batch_size, 1, 1, 1])],
                                  transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    return n.to_proto()


def anon_lenet(batch_size):
    data, label = L.DummyData(shape=[dict(dim=[batch_size, 1, 28, 28]),
                                     dict(dim=[batch_size, 1, 1, 1])],
                              transform_param=dict(scale=1. / 255), ntop=2)
    conv1 = L.Convolution(data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    pool1 = L.Pooling(conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    conv2 = L.Convolution(pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    pool2 = L.Pooling(conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    ip1 = L.InnerProduct(pool2, num_output=500, weight_filler=dict(type='xavier'))
    relu1 = L.ReLU(ip1, in_place=True)
    ip2 = L.InnerProduct(relu1, num_output=10, weight_filler=dict(type='xavier'))
    loss = L.SoftmaxWithLoss(ip2, label)
    return loss.to_proto()


def _load(tmp_path, proto, phase=caffe.TEST):
    f = tmp_path / "net.prototxt"
    f.write_text(str(proto))
    return caffe.Net(str(f), phase)


def test_named_lenet_builds_with_in_place_relu(tmp_path):
    proto = dummy_lenet(4)
    assert proto.layer[6].bottom == proto.layer[6].top == ["ip1"]
    assert [l.name for l in proto.layer] == ["data", "conv1", "pool1", "conv2", "pool2", "ip1",
                                             "relu1", "ip2", "loss"][:len(proto.layer)]
    net = _load(tmp_path, proto)
    assert len(net.layers) == 9  # pycaffe's test: all 9 layers, no Split needed
    assert net.blobs["data"].data.shape == (4, 1, 28, 28)
    assert float(net.forward()["loss"]) > 0


def test_anonymous_lenet_gets_pycaffes_auto_names(tmp_path):
    proto = anon_lenet(4)
    names = [(l.name, list(l.bottom), list(l.top)) for l in proto.layer]
    assert names == [
        ("DummyData1", [], ["DummyData1", "DummyData2"]),
        ("Convolution1", ["DummyData1"], ["Convolution1"]),
        ("Pooling1", ["Convolution1"], ["Pooling1"]),
        ("Convolution2", ["Pooling1"], ["Convolution2"]),
        ("Pooling2", ["Convolution2"], ["Pooling2"]),
        ("InnerProduct1", ["Pooling2"], ["InnerProduct1"]),
        ("ReLU1", ["InnerProduct1"], ["InnerProduct1"]),
        ("InnerProduct2", ["InnerProduct1"], ["InnerProduct2"]),
        ("SoftmaxWithLoss1", ["InnerProduct2", "DummyData2"], ["SoftmaxWithLoss1"]),
    ]
    net = _load(tmp_path, proto)
    assert len(net.layers) == 9


def test_mixed_naming_counts_per_type_in_order_of_need():
    n = caffe.NetSpec()
    x = L.Input(shape=dict(dim=[2, 3]))           # unnamed -> Input1
    n.a = L.InnerProduct(x, num_output=4)         # named a
    h = L.InnerProduct(n.a, num_output=4)         # unnamed -> InnerProduct1
    n.out = L.InnerProduct(h, num_output=2)       # named out
    y, z = L.Slice(n.out, ntop=2)                 # unnamed tops Slice1, Slice2
    n.y = y                                       # only the first named
    n.s = L.Eltwise(y, z)
    text = str(n.to_proto())
    expected = """\
layer {
  name: "Input1"
  type: "Input"
  top: "Input1"
  input_param {
    shape {
      dim: 2
      dim: 3
    }
  }
}
layer {
  name: "a"
  type: "InnerProduct"
  bottom: "Input1"
  top: "a"
  inner_product_param {
    num_output: 4
  }
}
layer {
  name: "InnerProduct1"
  type: "InnerProduct"
  bottom: "a"
  top: "InnerProduct1"
  inner_product_param {
    num_output: 4
  }
}
layer {
  name: "out"
  type: "InnerProduct"
  bottom: "InnerProduct1"
  top: "out"
  inner_product_param {
    num_output: 2
  }
}
layer {
  name: "y"
  type: "Slice"
  bottom: "out"
  top: "y"
  top: "Slice1"
}
layer {
  name: "s"
  type: "Eltwise"
  bottom: "y"
  bottom: "Slice1"
  top: "s"
}
"""
    assert text == expected


def test_zero_top_layers_take_their_spec_name(tmp_path):
    n = caffe.NetSpec()
    n.data, n.data2 = L.DummyData(shape=dict(dim=3), ntop=2)
    n.silence_data = L.Silence(n.data, ntop=0)
    n.silence_data2 = L.Silence(n.data2, ntop=0)
    proto = n.to_proto()
    assert [(l.name, list(l.top)) for l in proto.layer] == [
        ("data", ["data", "data2"]), ("silence_data", []), ("silence_data2", [])]
    assert proto.layer[0].dummy_data_param.shape[0].dim == [3]
    if "Silence" in caffe.layer_type_list():
        net = _load(tmp_path, proto)
        assert len(net.forward()) == 0
    # anonymous zero-top functions count per type
    anon = L.Silence(L.DummyData(shape=dict(dim=3)), ntop=0)
    assert isinstance(anon, Function)
    assert [l.name for l in to_proto(anon).layer] == ["DummyData1", "Silence1"]


def test_input_that_is_not_a_top_raises_type_error():
    data = L.DummyData(ntop=2)
    with pytest.raises(TypeError, match=r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$"):
        L.Silence(data, ntop=0)
    L.Silence(*data, ntop=0)


def test_keyword_rules():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 3, 8, 8]))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=3, pad=[1, 2],
                           param=[dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)],
                           bias_filler=dict(type="constant", value=0.5),
                           include=dict(phase=caffe.TRAIN), loss_weight=0.5,
                           propagate_down=[False])
    n.loss = L.SoftmaxWithLoss(n.conv, n.data, loss_weight=2, loss_param=dict(ignore_label=3,
                                                                              normalize=False))
    n.acc = L.Accuracy(n.conv, n.data, top_k=5)
    lp = n.to_proto().layer
    conv, loss, acc = lp[1], lp[2], lp[3]
    # scalars into repeated fields become one-element lists; lists extend
    assert list(conv.convolution_param.kernel_size) == [3]
    assert list(conv.convolution_param.pad) == [1, 2]
    assert conv.convolution_param.num_output == 4
    assert conv.convolution_param.bias_filler.value == 0.5
    # "...param" keywords go on the LayerParameter; a list of dicts adds messages
    assert [(p.lr_mult, p.decay_mult) for p in conv.param] == [(1, 1), (2, 0)]
    # fields the type's parameter lacks go on the layer
    assert conv.include[0].phase == caffe.TRAIN
    assert list(conv.loss_weight) == [0.5]
    assert list(conv.propagate_down) == [False]
    # a type without a parameter message: everything on the layer
    assert list(loss.loss_weight) == [2.0]
    assert loss.loss_param.ignore_label == 3 and loss.loss_param.normalize is False
    assert acc.accuracy_param.top_k == 5


def test_types_without_own_param_message_follow_pycaffe():
    # Deconvolution has no DeconvolutionParameter: pycaffe puts kernel_size on the layer,
    # which protobuf refuses; convolution_param=dict(...) is the way
    with pytest.raises(AttributeError):
        L.Deconvolution(L.Input(), kernel_size=3).to_proto()
    p = L.Deconvolution(L.Input(), convolution_param=dict(kernel_size=3, num_output=2)).to_proto()
    assert list(p.layer[1].convolution_param.kernel_size) == [3]


def test_param_names_and_enum_constants():
    d = param_name_dict()
    assert d["Convolution"] == "convolution"
    assert d["InnerProduct"] == "inner_product"
    assert d["ReLU"] == "relu"
    assert d["Transformation"] == "transform"
    assert d["HDF5Data"] == "hdf5_data"
    assert d["Python"] == "python"
    assert d["Loss"] == "loss"
    assert P.Pooling.MAX == caffe_pb2.PoolingParameter.MAX
    assert P.Pooling.AVE == caffe_pb2.PoolingParameter.AVE
    assert P.Data.LMDB == caffe_pb2.DataParameter.LMDB
    assert P.Eltwise.PROD == caffe_pb2.EltwiseParameter.PROD
    assert caffe.params is P and caffe.layers is L


def test_python_layer_spec():
    top = L.Python(L.Input(shape=dict(dim=[2])), module="mymod", layer="MyLayer",
                   param_str="{'k': 1}")
    lp = top.to_proto().layer[1]
    assert lp.type == "Python"
    assert (lp.python_param.module, lp.python_param.layer, lp.python_param.param_str) == \
        ("mymod", "MyLayer", "{'k': 1}")


def test_top_to_proto_and_netspec_container():
    a = L.Input(shape=dict(dim=[1]))
    b = L.ReLU(a)
    assert isinstance(b, Top)
    assert b.to_proto() == to_proto(b)
    assert [l.name for l in to_proto(b).layer] == ["Input1", "ReLU1"]
    n = caffe.NetSpec()
    n["x"] = a
    n.y = b
    assert n.keys() == ["x", "y"] and n.vals() == [a, b]
    assert n["y"] is b and n.x is a
    del n["y"]
    assert n.keys() == ["x"]
    with pytest.raises(AttributeError):
        n.missing
    # multiple tops returned as a tuple; ntop=0 returns the Function
    tops = L.Slice(a, ntop=3)
    assert isinstance(tops, tuple) and len(tops) == 3 and tops[2].n == 2


def test_netspec_net_runs_with_the_same_numbers_as_the_prototxt(tmp_path):
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    n.ip = L.InnerProduct(n.data, num_output=2, weight_filler=dict(type="constant", value=0.5),
                          bias_filler=dict(type="constant", value=1))
    net = _load(tmp_path, n.to_proto())
    out = net.forward(data=np.arange(6, dtype=np.float32).reshape(2, 3))["ip"]
    np.testing.assert_allclose(out, [[2.5, 2.5], [7.0, 7.0]])
