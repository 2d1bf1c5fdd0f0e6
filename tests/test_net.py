import numpy as np
import pytest

import minicaffe as caffe
from minicaffe.core.errors import ConfigError, MinicaffeError
from minicaffe.network.net import Net, read_net_param, insert_splits, filter_net
from minicaffe.proto import caffe_pb2
from minicaffe.core.protoio import parse_text
from test_solver_nets import LENET_MEMORY

TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def tiny_net(text=TINY, phase=caffe.TRAIN, **kw):
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase, **kw)


# -- bad input -------------------------------------------------------------------------
def test_prototxt_syntax_error_names_file_line_column(tmp_path):
    f = tmp_path / "bad.prototxt"
    f.write_text('name: "x"\nlayer {\n  name: "a"\n  type: "ReLU"\n  bottom: \n}\n oops\n')
    with pytest.raises(ConfigError) as e:
        Net(str(f), caffe.TEST)
    msg = str(e.value)
    assert msg.startswith(f"{f}:") and "\n" not in msg
    line = int(msg[len(str(f)) + 1:].split(":")[0])
    assert 5 <= line <= 7


def test_missing_file_is_one_line():
    with pytest.raises(MinicaffeError, match="no such file"):
        Net("/nonexistent/net.prototxt", caffe.TEST)


def test_unknown_layer_type_lists_known_and_closest():
    with pytest.raises(ConfigError) as e:
        tiny_net(TINY.replace('type: "ReLU"', 'type: "Relu"'))
    msg = str(e.value)
    assert "'relu1'" in msg and "did you mean 'ReLU'" in msg and "InnerProduct" in msg


def test_unknown_bottom_names_layer_and_blob():
    with pytest.raises(ConfigError, match="'ip2'.*unknown bottom blob 'nope'"):
        tiny_net(TINY.replace('bottom: "ip1" top: "ip2"', 'bottom: "nope" top: "ip2"'))


def test_wrong_blob_count_names_layer():
    with pytest.raises(MinicaffeError, match="'loss'.*exactly 2 bottom"):
        tiny_net(TINY.replace('bottom: "ip2" bottom: "label"', 'bottom: "ip2"'))


def test_top_produced_twice_is_error():
    text = TINY.replace('layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }',
                        'layer { name: "relu1" type: "ReLU" bottom: "data" top: "ip1" }')
    with pytest.raises(ConfigError, match="multiple sources"):
        tiny_net(text)


# -- structure --------------------------------------------------------------------------
def test_blobs_params_inputs_outputs():
    net = tiny_net()
    assert list(net.blobs) == ["data", "label", "ip1", "ip2", "loss"]
    assert list(net.params) == ["ip1", "ip2"]
    assert net.params["ip1"][0].data.shape == (5, 3)
    assert net.inputs == ["data", "label"] and net.outputs == ["loss"]
    assert net.blob_loss_weights[net.blob_names.index("loss")] == 1.0


def test_forward_backward_gradients_flow():
    net = tiny_net()
    net.blobs["data"].data[...] = np.random.RandomState(0).randn(4, 3)
    net.blobs["label"].data[...] = [0, 1, 1, 0]
    loss = net.forward_backward()
    assert loss > 0
    assert net.params["ip1"][0].diff.any() and net.params["ip2"][0].diff.any()
    assert net.layer_need_backward == [False, True, True, True, True]


FILTER = """
state { phase: TEST level: 2 stage: "deploy" }
layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 1 } } }
layer { name: "train_only" type: "ReLU" bottom: "x" top: "t" include { phase: TRAIN } }
layer { name: "test_only" type: "ReLU" bottom: "x" top: "u" include { phase: TEST } }
layer { name: "lvl3" type: "ReLU" bottom: "x" top: "v" include { min_level: 3 } }
layer { name: "lvl2" type: "ReLU" bottom: "x" top: "w" include { min_level: 1 max_level: 2 } }
layer { name: "staged" type: "ReLU" bottom: "x" top: "y" include { stage: "deploy" } }
layer { name: "notstaged" type: "ReLU" bottom: "x" top: "z" include { not_stage: "deploy" } }
layer { name: "excluded" type: "ReLU" bottom: "x" top: "e" exclude { phase: TEST } }
"""


def test_netstate_filtering():
    p = filter_net(parse_text(FILTER, caffe_pb2.NetParameter()))
    assert [l.name for l in p.layer] == ["a", "test_only", "lvl2", "staged"]


def test_include_and_exclude_together_is_error():
    text = 'layer { name: "a" type: "ReLU" include { phase: TRAIN } exclude { phase: TEST } }'
    with pytest.raises(ConfigError, match="either include rules or exclude rules"):
        filter_net(parse_text(text, caffe_pb2.NetParameter()))


def test_net_phase_level_stages_from_constructor():
    p = parse_text(FILTER, caffe_pb2.NetParameter())
    net = Net(p, caffe.TRAIN, level=3, stages=[])
    assert [n for n in net.layer_names if not n.endswith("_split")] == \
        ["a", "train_only", "lvl3", "notstaged", "excluded"]


def test_split_insertion_uses_caffe_names():
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "a" type: "ReLU" bottom: "data" top: "a" }
    layer { name: "b" type: "ReLU" bottom: "data" top: "b" }
    layer { name: "c" type: "ReLU" bottom: "data" top: "c" }
    """
    p = insert_splits(parse_text(text, caffe_pb2.NetParameter()))
    names = [l.name for l in p.layer]
    assert names == ["data", "data_data_0_split", "a", "b", "c"]
    split = p.layer[1]
    assert list(split.top) == [f"data_data_0_split_{i}" for i in range(3)]
    assert [l.bottom[0] for l in p.layer[2:]] == [f"data_data_0_split_{i}" for i in range(3)]


def test_split_with_loss_weight_on_used_top():
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "r" type: "ReLU" bottom: "data" top: "r" loss_weight: 2 }
    layer { name: "s" type: "ReLU" bottom: "r" top: "s" }
    """
    p = insert_splits(parse_text(text, caffe_pb2.NetParameter()))
    assert [l.name for l in p.layer] == ["data", "r", "r_r_0_split", "s"]
    assert list(p.layer[1].loss_weight) == []
    assert list(p.layer[2].loss_weight) == [2.0, 0.0]
    assert p.layer[3].bottom[0] == "r_r_0_split_1"


def test_in_place_and_split_net_trains_backward():
    text = TINY.replace('layer { name: "loss"', '''
      layer { name: "ip3" type: "InnerProduct" bottom: "ip1" top: "ip3"
              inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
      layer { name: "loss2" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss2" }
      layer { name: "loss"''')
    net = tiny_net(text)
    assert "ip1_relu1_0_split" in net.layer_names
    net.blobs["data"].data[...] = np.random.RandomState(0).randn(4, 3)
    net.forward_backward()
    assert net.params["ip1"][0].diff.any()


SHARED = """
layer { name: "data" type: "Input" top: "a" top: "b" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip_a" type: "InnerProduct" bottom: "a" top: "ya"
        param { name: "w" lr_mult: 2 } param { name: "bias" }
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" } } }
layer { name: "ip_b" type: "InnerProduct" bottom: "b" top: "yb"
        param { name: "w" } param { name: "bias" }
        inner_product_param { num_output: 4 } }
"""


def test_weight_sharing_by_name():
    net = Net(parse_text(SHARED, caffe_pb2.NetParameter()), caffe.TRAIN)
    wa, wb = net.params["ip_a"][0], net.params["ip_b"][0]
    assert wa.data_mem is wb.data_mem and wa.diff_mem is wb.diff_mem
    assert len(net.learnable_params) == 2
    assert net.params_lr == [2.0, 1.0]
    assert net.param_owners == [-1, -1, 0, 1]


def test_weight_sharing_shape_mismatch_strict_vs_permissive():
    bad = SHARED.replace('bottom: "b" top: "yb"', 'bottom: "b" top: "yb"').replace(
        'inner_product_param { num_output: 4 } }', 'inner_product_param { num_output: 4 axis: 0 } }')
    # axis 0: weights (4, 6) vs owner's (4, 3): strict shape check fails
    with pytest.raises(ConfigError, match="shape mismatch"):
        Net(parse_text(bad, caffe_pb2.NetParameter()), caffe.TRAIN)


def test_mismatched_shared_lr_mult_is_error():
    bad = SHARED.replace('param { name: "w" } param { name: "bias" }',
                         'param { name: "w" lr_mult: 3 } param { name: "bias" }')
    with pytest.raises(ConfigError, match="mismatched lr_mult"):
        Net(parse_text(bad, caffe_pb2.NetParameter()), caffe.TRAIN)


def test_backward_needs_follow_lr_mult_and_force_backward():
    text = TINY.replace('inner_product_param { num_output: 5',
                        'param { lr_mult: 0 } inner_product_param { bias_term: false num_output: 5')
    net = tiny_net(text)
    assert net.layer_need_backward[1] is False  # ip1 frozen: nothing to learn, input needs none
    forced = tiny_net("force_backward: true\n" + text)
    assert forced.layer_need_backward[1] is True
    assert forced.bottom_need_backward[1] == [True]


def test_layers_without_loss_skip_backward():
    text = TINY + 'layer { name: "probe" type: "InnerProduct" bottom: "data" top: "probe" ' \
                  'inner_product_param { num_output: 2 } }'
    net = tiny_net(text)
    assert net.layer_need_backward[net.layer_names.index("probe")] is False
    assert "probe" in net.outputs


# -- weights ------------------------------------------------------------------------------
def test_caffemodel_round_trip(tmp_path):
    a = tiny_net()
    path = tmp_path / "w.caffemodel"
    a.save(str(path))
    caffe.set_random_seed(99)
    b = tiny_net()
    assert not np.array_equal(a.params["ip1"][0].data, b.params["ip1"][0].data)
    b.copy_from(str(path))
    for name in a.params:
        for pa, pb in zip(a.params[name], b.params[name]):
            np.testing.assert_array_equal(pa.data, pb.data)
    assert not list(tmp_path.glob(".tmp*"))


def test_hdf5_round_trip(tmp_path):
    pytest.importorskip("h5py")
    a = tiny_net()
    path = tmp_path / "w.caffemodel.h5"
    a.save_hdf5(str(path))
    caffe.set_random_seed(98)
    b = tiny_net()
    b.copy_from(str(path))
    np.testing.assert_array_equal(a.params["ip2"][0].data, b.params["ip2"][0].data)


def test_copy_skips_unknown_layers_and_rejects_shape_mismatch(tmp_path):
    a = tiny_net()
    p = a.to_proto()
    extra = p.layer.add()
    extra.name = "not_in_target"
    b = tiny_net()
    b.copy_from(p)  # unknown source layer is skipped
    c = tiny_net(TINY.replace("num_output: 5", "num_output: 6"))
    with pytest.raises(MinicaffeError, match="'ip1'.*shape mismatch"):
        c.copy_from(p)


def test_generated_weights_give_identical_outputs(tmp_path):
    deploy = TINY.split('layer { name: "loss"')[0]
    a = tiny_net(deploy, caffe.TEST)
    path = str(tmp_path / "m.caffemodel")
    a.save(path)
    b = Net(parse_text(deploy, caffe_pb2.NetParameter()), caffe.TEST, weights=path)
    x = np.random.RandomState(1).randn(4, 3)
    np.testing.assert_array_equal(a.forward(data=x)["ip2"], b.forward(data=x)["ip2"])


# -- upgrades -------------------------------------------------------------------------------
def test_v1_layers_upgrade():
    text = """
    name: "v1"
    input: "data" input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 3
    layers { name: "conv" type: CONVOLUTION bottom: "data" top: "conv"
             blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
             convolution_param { num_output: 4 kernel_size: 3 } }
    layers { name: "relu" type: RELU bottom: "conv" top: "conv" }
    """
    p = read_net_param(text)
    assert len(p.layers) == 0 and len(p.input) == 0
    assert [l.type for l in p.layer] == ["Input", "Convolution", "ReLU"]
    assert list(p.layer[0].input_param.shape[0].dim) == [1, 2, 3, 3]
    conv = p.layer[1]
    assert [s.lr_mult for s in conv.param] == [1, 2] and [s.decay_mult for s in conv.param] == [1, 0]
    net = Net(p, caffe.TEST)
    assert net.blobs["conv"].shape == (1, 4, 1, 1)


def test_memory_report_counts_bytes():
    net = tiny_net()
    r = net.memory_report()
    rows = {row["layer"]: row for row in r["layers"]}
    assert rows["ip1"]["params"] == (5 * 3 + 5) * 4
    assert rows["ip1"]["data"] == 4 * 5 * 4
    assert r["total"]["params"] == ((5 * 3 + 5) + (2 * 5 + 2)) * 4


# -- the BVLC-trained LeNet weights ------------------------------------------------------------
def _mnist_test(mnist_dir):
    from minicaffe.data.datasets import load_mnist
    m = load_mnist(str(mnist_dir))
    return m["test_images"].astype(np.float32) * np.float32(0.00390625), m["test_labels"]


def test_bvlc_lenet_v2_scores_as_in_caffe(fixtures_dir, mnist_dir):
    X, y = _mnist_test(mnist_dir)
    net = Net(str(fixtures_dir / "lenet_v2_deploy.prototxt"), caffe.TEST,
              weights=str(fixtures_dir / "lenet_v2_iter_10000.caffemodel"))
    net.blobs["data"].reshape((1000, 1, 28, 28))
    net.reshape()
    correct = 0
    for i in range(0, 10000, 1000):
        out = net.forward(data=X[i:i + 1000, None])
        correct += int((out["loss"].argmax(1) == y[i:i + 1000]).sum())
    assert correct / 10000 == pytest.approx(0.9904, abs=1e-9)


def test_bvlc_lenet_v1_scores_as_in_caffe(fixtures_dir, mnist_dir):
    X, y = _mnist_test(mnist_dir)
    p = read_net_param(str(fixtures_dir / "lenet_v1_train_test.prototxt"))
    for l in p.layer:
        if l.type == "Data":  # no LMDB here: feed the same arrays through MemoryData
            l.type = "MemoryData"
            l.memory_data_param.batch_size = 1000
            l.memory_data_param.channels, l.memory_data_param.height, l.memory_data_param.width = 1, 28, 28
            l.ClearField("data_param")
            l.ClearField("transform_param")
    net = Net(p, caffe.TEST, weights=str(fixtures_dir / "lenet_v1_iter_10000.caffemodel"))
    net.layer_dict["mnist"].set_input_arrays(X[:, None], y.astype(np.float32))
    acc = np.mean([float(net.forward()["accuracy"]) for _ in range(10)])
    assert acc == pytest.approx(0.9905, abs=1e-6)  # one image is 1e-4


# Caffe's LeNet with MemoryData (shared with the solver tests); in TRAIN phase its data
# layer has batch 64 and there is no accuracy layer.
LENET_MEM = LENET_MEMORY % {"train_batch": 64, "test_batch": 100}


def test_lenet_trains_with_plain_sgd_loop():
    """A LeNet from prototxt trains on CPU with a hand-written SGD loop and its loss falls.
    Synthetic data: 10 classes, each a fixed random 28x28 pattern plus noise."""
    rs = np.random.RandomState(0)
    protos = rs.rand(10, 1, 28, 28).astype(np.float32)
    labels = rs.randint(0, 10, 640)
    X = protos[labels] + 0.3 * rs.randn(640, 1, 28, 28).astype(np.float32)
    net = Net(parse_text(LENET_MEM, caffe_pb2.NetParameter()), caffe.TRAIN)
    net.layer_dict["mnist"].set_input_arrays(X, labels.astype(np.float32))
    losses = []
    for it in range(30):
        net.clear_param_diffs()
        losses.append(net.forward_backward())
        for blob, lr in zip(net.learnable_params, net.params_lr):
            blob.data[...] -= 0.05 * lr * blob.diff
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


# -- weights that fill nothing, names that collide, empty batches ------------------------------
def test_weights_that_fill_nothing_are_an_error(tmp_path):
    net = tiny_net()
    empty = tmp_path / "empty.caffemodel"
    empty.write_bytes(b"")  # what a failed download leaves
    with pytest.raises(MinicaffeError, match=r"empty\.caffemodel: no weights were copied .*"
                                             r"holds no layers.*ip1, ip2"):
        net.copy_from(str(empty))
    other = tiny_net(TINY.replace('"ip1"', '"fc1"').replace('"ip2"', '"fc2"'))
    other.save(str(tmp_path / "other.caffemodel"))
    with pytest.raises(MinicaffeError, match="none of its layers with weights matches"):
        net.copy_from(str(tmp_path / "other.caffemodel"))
    with pytest.raises(MinicaffeError, match="no weights were copied"):
        Net(parse_text(TINY, caffe_pb2.NetParameter()), caffe.TEST,
            weights=str(tmp_path / "other.caffemodel"))


def test_weights_that_fill_some_layers_say_which_keep_their_values(tmp_path):
    from test_solver_nets import captured_log
    renamed = tiny_net(TINY.replace('"ip2"', '"fc2"'))  # fine-tuning: a renamed last layer
    renamed.save(str(tmp_path / "part.caffemodel"))
    net = tiny_net()
    with captured_log() as lines:
        net.copy_from(str(tmp_path / "part.caffemodel"))
    np.testing.assert_array_equal(net.params["ip1"][0].data, renamed.params["ip1"][0].data)
    warned = [l for l in lines if l.startswith("W")]
    assert len(warned) == 1 and "2 of 4 parameter blobs" in warned[0] and "ip2" in warned[0]


def test_duplicate_names_of_layers_with_parameters_are_an_error():
    text = TINY.replace('name: "ip2"', 'name: "ip1"')
    with pytest.raises(ConfigError, match=r"layer 'ip1' is defined twice .*#1 and #3"):
        tiny_net(text)
    # Caffe's mnist_autoencoder.prototxt names two parameterless loss layers alike
    tiny_net(TINY.replace('name: "relu1"', 'name: "loss"'))


def test_zero_batch_names_the_data_layer():
    with pytest.raises(MinicaffeError, match=r"layer 'data' \(Input\): top 'data' has shape "
                                             r"\(0, 3\): a zero dimension"):
        tiny_net(TINY.replace("dim: 4 dim: 3", "dim: 0 dim: 3"))


@pytest.mark.parametrize("layer", [
    'type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 pad: 1 }',
    'type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }',
    'type: "InnerProduct" inner_product_param { num_output: 3 }',
])
def test_layers_that_cannot_run_in_place_say_so(layer):
    text = ('layer { name: "data" type: "Input" top: "data" '
            'input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }\n'
            f'layer {{ name: "x" bottom: "data" top: "data" {layer} }}')
    with pytest.raises(MinicaffeError, match="layer 'x' .*cannot be computed in place"):
        tiny_net(text)


# -- HDF5 weights --------------------------------------------------------------------------------
SLASHED = TINY.replace('"ip1"', '"block/ip1"').replace('"ip2"', '"block/ip2"')


def test_hdf5_weights_keep_layers_named_with_a_slash(tmp_path):
    pytest.importorskip("h5py")
    net = tiny_net(SLASHED)
    net.save_hdf5(str(tmp_path / "w.caffemodel.h5"))
    other = tiny_net(SLASHED)
    other.copy_from(str(tmp_path / "w.caffemodel.h5"))
    for name in ("block/ip1", "block/ip2"):
        for a, b in zip(net.params[name], other.params[name]):
            np.testing.assert_array_equal(a.data, b.data)


def test_damaged_hdf5_weights_name_the_file(tmp_path):
    pytest.importorskip("h5py")
    net = tiny_net()
    path = tmp_path / "w.caffemodel.h5"
    net.save_hdf5(str(path))
    raw = bytearray(path.read_bytes())
    path.write_bytes(bytes(raw[: len(raw) // 2]))  # a truncated copy
    with pytest.raises(MinicaffeError, match=r"w\.caffemodel\.h5: ") as e:
        net.copy_from(str(path))
    assert "\n" not in str(e.value)


# -- a layer's failure is one line naming the layer, of its own type ---------------------------
@pytest.mark.parametrize("edit,kind,match", [
    (('num_output: 5', 'num_output: 5 axis: 7'), IndexError, r"layer 'ip1' \(InnerProduct\): "
     r"IndexError: axis 7"),
    (('num_output: 5', 'num_output: 2000000000'), MemoryError, r"layer 'ip1' \(InnerProduct\): "
     r"MemoryError"),
    (('top: "loss" }', 'top: "loss" softmax_param { axis: -3 } }'), IndexError,
     r"layer 'loss' \(SoftmaxWithLoss\): IndexError"),
])
def test_layer_failures_name_the_layer_and_keep_their_type(edit, kind, match):
    with pytest.raises(kind, match=match) as e:
        tiny_net(TINY.replace(*edit))
    assert isinstance(e.value, MinicaffeError) and "\n" not in str(e.value)
    assert isinstance(e.value.__cause__, kind)


def test_nan_label_is_reported_as_nan():
    net = tiny_net(TINY + 'layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" '
                          'top: "acc" }')
    net.blobs["label"].data[...] = [0, 1, np.nan, 0]
    with pytest.raises(MinicaffeError, match=r"layer '(loss|acc)' .*label nan is out of range"):
        net.forward()


@pytest.mark.gpu
def test_nan_label_is_reported_as_nan_on_the_gpu():
    from minicaffe.core import context
    context.set_mode_gpu()
    net = tiny_net()
    net.blobs["label"].data[...] = [0, 1, np.nan, 0]
    with pytest.raises(MinicaffeError, match=r"layer 'loss' .*label nan is out of range"):
        net.forward()


def test_top_rewritten_marks_layers_whose_top_a_later_layer_rewrites_in_place():
    from minicaffe import Net
    net = Net("""
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param { num_output: 2 kernel_size: 1 } }
    layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
    layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
            pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
    layer { name: "drop" type: "Dropout" bottom: "pool" top: "pool" }
    layer { name: "out" type: "Sigmoid" bottom: "pool" top: "out" }
    """, phase=caffe_pb2.TRAIN)
    flags = dict(zip(net.layer_names, net.top_rewritten))
    assert flags == {"data": False, "conv": True, "relu": False, "pool": True, "drop": False,
                     "out": False}


BN_NET = """
name: "bn"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 6 dim: 3 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "%s" }
layer { name: "ip" type: "InnerProduct" bottom: "%s" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
"""


def test_training_batchnorm_in_place_reads_a_blob_of_its_own_on_every_device():
    """A training BatchNorm in place on the layer before it reads ``<bn>_input``: the same
    blob names as on the GPU, and the same numbers as the net written out of place."""
    x = np.random.RandomState(0).randn(6, 3, 4, 4).astype(np.float32)
    results = []
    for top in ("conv", "bnout"):
        caffe.set_random_seed(5)
        net = Net(BN_NET % (top, top), phase=caffe_pb2.TRAIN)
        net.blobs["data"].data[...] = x
        net.forward()
        net.blobs["ip"].diff[...] = 1.0
        net.backward()
        results.append((net, [net.blobs[top].data.copy(), net.blobs["ip"].data.copy()] +
                        [p.diff.copy() for p in net.learnable_params]))
    in_place, plain = results
    assert list(in_place[0].blobs) == ["data", "bn_input", "conv", "ip"]
    assert list(plain[0].blobs) == ["data", "conv", "bnout", "ip"]
    for a, b in zip(in_place[1], plain[1]):
        np.testing.assert_array_equal(a, b)
    # a testing net keeps the BatchNorm in place (no copy of its input is needed)
    test_net = Net(BN_NET % ("conv", "conv"), phase=caffe_pb2.TEST)
    assert list(test_net.blobs) == ["data", "conv", "ip"]
