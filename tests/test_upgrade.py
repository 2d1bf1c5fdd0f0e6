"""V0 -> V1 -> V2 upgrades, as Caffe's upgrade_proto does."""
import numpy as np

import minicaffe as caffe
from minicaffe.network.net import Net, read_net_param

V0_NET = """
name: "CaffeNet-ish"
input: "data"
input_dim: 2 input_dim: 3 input_dim: 13 input_dim: 13
layers { layer { name: "pad1" type: "padding" pad: 1 } bottom: "data" top: "pad1" }
layers { layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 3 stride: 2 group: 1
                 biasterm: true blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
                 weight_filler { type: "gaussian" std: 0.01 } bias_filler { type: "constant" } }
         bottom: "pad1" top: "conv1" }
layers { layer { name: "relu1" type: "relu" } bottom: "conv1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: MAX kernelsize: 3 stride: 2 }
         bottom: "conv1" top: "pool1" }
layers { layer { name: "norm1" type: "lrn" local_size: 3 alpha: 0.0001 beta: 0.75 }
         bottom: "pool1" top: "norm1" }
layers { layer { name: "drop" type: "dropout" dropout_ratio: 0.3 } bottom: "norm1" top: "norm1" }
layers { layer { name: "fc" type: "innerproduct" num_output: 5 biasterm: false
                 weight_filler { type: "gaussian" std: 0.01 } }
         bottom: "norm1" top: "fc" }
layers { layer { name: "prob" type: "softmax" } bottom: "fc" top: "prob" }
"""


def test_v0_upgrades_to_v2():
    p = read_net_param(V0_NET)
    assert len(p.layers) == 0
    types = [(l.name, l.type) for l in p.layer]
    assert types == [("input", "Input"), ("conv1", "Convolution"), ("relu1", "ReLU"),
                     ("pool1", "Pooling"), ("norm1", "LRN"), ("drop", "Dropout"),
                     ("fc", "InnerProduct"), ("prob", "Softmax")]
    conv = p.layer[1]
    assert list(conv.bottom) == ["data"]  # the padding layer folded in
    c = conv.convolution_param
    assert (c.num_output, list(c.kernel_size), list(c.stride), list(c.pad)) == (4, [3], [2], [1])
    assert c.weight_filler.std == np.float32(0.01)
    assert [s.lr_mult for s in conv.param] == [1, 2] and [s.decay_mult for s in conv.param] == [1, 0]
    pool = p.layer[3].pooling_param
    assert pool.pool == pool.MAX and pool.kernel_size == 3 and pool.stride == 2
    assert p.layer[4].lrn_param.local_size == 3
    assert abs(p.layer[5].dropout_param.dropout_ratio - 0.3) < 1e-7
    assert p.layer[6].inner_product_param.bias_term is False


def test_v0_net_builds_and_runs():
    p = read_net_param(V0_NET)
    # keep to the layers every build has (LRN/Dropout belong to the full layer set)
    keep = [l for l in p.layer if l.type not in ("LRN", "Dropout")]
    del p.layer[:]
    for l in keep:
        if l.name == "fc":
            l.bottom[0] = "pool1"
        p.layer.add().CopyFrom(l)
    net = Net(p, caffe.TEST)
    assert net.blobs["conv1"].shape == (2, 4, 7, 7)
    assert net.blobs["pool1"].shape == (2, 4, 3, 3)
    out = net.forward(data=np.random.RandomState(0).randn(2, 3, 13, 13))
    np.testing.assert_allclose(out["prob"].sum(1), 1, rtol=1e-5)


def test_v1_data_transform_fields_move_to_transform_param():
    text = """
    layers { name: "d" type: DATA top: "data" top: "label"
             data_param { source: "x" batch_size: 4 scale: 0.5 mean_file: "m.binaryproto"
                          crop_size: 7 mirror: true } }
    """
    p = read_net_param(text)
    l = p.layer[0]
    assert l.type == "Data"
    t = l.transform_param
    assert (t.scale, t.mean_file, t.crop_size, t.mirror) == (0.5, "m.binaryproto", 7, True)
    assert not l.data_param.HasField("scale") and l.data_param.batch_size == 4


def test_batchnorm_param_specs_are_dropped():
    text = """
    layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
            param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } }
    """
    p = read_net_param(text)
    assert len(p.layer[0].param) == 0
