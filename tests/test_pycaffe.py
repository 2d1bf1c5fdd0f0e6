"""pycaffe's surface on minicaffe: ``import minicaffe as caffe``.

Module names, Net constructors and properties, write-through of ``.data``/``.diff``,
forward/backward with start/end/blobs/diffs, forward_all padding, hooks, weights I/O,
set_input_arrays, Timer, log, NCCL without a GPU, solvers' pycaffe surface, Python
layers, Classifier / classify CLI, and GPU write-through (marked gpu)."""
import collections
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import minicaffe as caffe
from minicaffe.core.errors import MinicaffeError

TRAIN_NET = """
name: "small"
force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: -0.2 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

DEPLOY_NET = """
name: "deploy"
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
"""


@pytest.fixture
def train_file(tmp_path):
    p = tmp_path / "train.prototxt"
    p.write_text(TRAIN_NET)
    return str(p)


@pytest.fixture
def deploy_file(tmp_path):
    p = tmp_path / "deploy.prototxt"
    p.write_text(DEPLOY_NET)
    return str(p)


def _mlp(net, x):
    w1, b1 = net.params["ip1"][0].data, net.params["ip1"][1].data
    w2, b2 = net.params["ip2"][0].data, net.params["ip2"][1].data
    h = x.astype(np.float64) @ w1.T + b1
    r = np.maximum(h, 0)
    return h, r, r @ w2.T + b2


def _softmax_loss(z, y):
    z = z - z.max(1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    n = len(y)
    loss = -np.log(p[np.arange(n), y.astype(int)]).mean()
    g = p.copy()
    g[np.arange(n), y.astype(int)] -= 1
    return loss, g / n


# -- module surface ------------------------------------------------------------------------
def test_module_surface():
    for name in ["Net", "set_mode_cpu", "set_mode_gpu", "set_device", "set_random_seed",
                 "solver_count", "set_solver_count", "solver_rank", "set_solver_rank",
                 "set_multiprocess", "layer_type_list", "TRAIN", "TEST", "Timer", "init_log",
                 "log", "has_nccl", "NCCL", "__version__", "io", "layers", "params",
                 "NetSpec", "to_proto", "draw", "proto", "Classifier"]:
        assert hasattr(caffe, name), name
    assert caffe.TRAIN == caffe.proto.caffe_pb2.TRAIN == 0
    assert caffe.TEST == caffe.proto.caffe_pb2.TEST == 1
    assert isinstance(caffe.__version__, str)
    from minicaffe import layers as L, params as P, io, draw  # noqa: F401
    from minicaffe.proto import caffe_pb2  # noqa: F401
    assert callable(L.Convolution) and P.Pooling.MAX == 0
    types = caffe.layer_type_list()
    assert {"Convolution", "InnerProduct", "Input", "MemoryData"} <= set(types)
    assert "Layer" in dir(caffe) and "SGDSolver" in dir(caffe)
    with pytest.raises(AttributeError):
        caffe.NoSuchThing


def test_solver_count_and_rank_round_trip():
    assert caffe.solver_count() == 1 and caffe.solver_rank() == 0
    caffe.set_solver_count(3)
    caffe.set_solver_rank(2)
    try:
        assert caffe.solver_count() == 3 and caffe.solver_rank() == 2
    finally:
        caffe.set_solver_count(1)
        caffe.set_solver_rank(0)


def test_set_mode_gpu_without_gpu_is_a_clear_error():
    from minicaffe.core import backend
    if backend.gpu_count():
        pytest.skip("a GPU is present")
    with pytest.raises(MinicaffeError, match="no GPU is usable"):
        caffe.set_mode_gpu()


def test_random_seed_makes_fillers_repeatable(train_file):
    caffe.set_random_seed(5)
    a = caffe.Net(train_file, caffe.TRAIN).params["ip1"][0].data.copy()
    caffe.set_random_seed(5)
    b = caffe.Net(train_file, caffe.TRAIN).params["ip1"][0].data.copy()
    np.testing.assert_array_equal(a, b)


# -- Net: constructors -----------------------------------------------------------------------
def test_constructors_new_and_legacy(fixtures_dir, mnist_dir):
    proto = str(fixtures_dir / "lenet_v2_deploy.prototxt")
    weights = str(fixtures_dir / "lenet_v2_iter_10000.caffemodel")
    a = caffe.Net(proto, caffe.TEST, weights=weights)
    b = caffe.Net(proto, weights, caffe.TEST)  # legacy Net(file, weights, phase)
    c = caffe.Net(proto, phase=caffe.TEST, level=0, stages=None, weights=None)
    c.copy_from(weights)
    for net in (b, c):
        for name in a.params:
            for pa, pb in zip(a.params[name], net.params[name]):
                np.testing.assert_array_equal(pa.data, pb.data)
    # the BVLC weights classify real digits
    from minicaffe.data.datasets import load_mnist
    mn = load_mnist(mnist_dir)
    x = mn["test_images"][:1].astype(np.float32)[:, None] * np.float32(0.00390625)
    out = a.forward(data=x)
    (name, prob), = out.items()
    assert prob.shape == (1, 10) and int(prob.argmax()) == int(mn["test_labels"][0])


def test_level_and_stages_filter_layers(tmp_path):
    p = tmp_path / "staged.prototxt"
    p.write_text("""
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }
layer { name: "deep" type: "ReLU" bottom: "data" top: "deep" include { min_level: 2 } }
layer { name: "staged" type: "ReLU" bottom: "data" top: "staged" include { stage: "extra" } }
""")
    assert caffe.Net(str(p), caffe.TEST)._layer_names == ["data"]
    assert caffe.Net(str(p), caffe.TEST, level=2)._layer_names == ["data", "deep"]
    assert caffe.Net(str(p), caffe.TEST, stages=["extra"])._layer_names == ["data", "staged"]
    assert caffe.Net(str(p), caffe.TRAIN, level=3, stages=["extra"]).outputs == ["deep", "staged"]


# -- Net: properties -------------------------------------------------------------------------
def test_dicts_names_and_loss_weights(train_file):
    net = caffe.Net(train_file, caffe.TRAIN)
    assert isinstance(net.blobs, collections.OrderedDict)
    assert list(net.blobs) == ["data", "label", "ip1", "ip2", "loss"]
    assert list(net.params) == ["ip1", "ip2"]
    assert [b.data.shape for b in net.params["ip1"]] == [(5, 3), (5,)]
    assert list(net.layer_dict) == net._layer_names == ["data", "ip1", "relu1", "ip2", "loss"]
    assert net.layer_dict["ip1"] is net.layers[1] and net.layers[1].type == "InnerProduct"
    assert net.inputs == ["data", "label"] and net.outputs == ["loss"]
    assert net._inputs == [0, 1] and net._blob_names == list(net.blobs)
    assert net.top_names["relu1"] == ["ip1"] and net.bottom_names["loss"] == ["ip2", "label"]
    assert net.top_names["data"] == ["data", "label"] and net.bottom_names["data"] == []
    assert [net._blob_names[i] for i in net._top_ids(3)] == ["ip2"]
    assert [net._blob_names[i] for i in net._bottom_ids(4)] == ["ip2", "label"]
    blw = net.blob_loss_weights
    assert isinstance(blw, collections.OrderedDict) and list(blw) == list(net.blobs)
    assert blw["loss"] == 1.0 and blw["ip2"] == 0.0
    assert blw[len(blw) - 1] == 1.0  # Caffe's index access still works


def test_forward_backward_against_numpy(train_file):
    net = caffe.Net(train_file, caffe.TRAIN)
    rng = np.random.RandomState(0)
    x = rng.randn(4, 3).astype(np.float32)
    y = np.array([0, 2, 1, 2], np.float32)
    out = net.forward(data=x, label=y)
    assert set(out) == {"loss"}
    h, r, z = _mlp(net, x)
    loss, g = _softmax_loss(z, y)
    np.testing.assert_allclose(float(out["loss"]), loss, rtol=1e-5)
    diffs = net.backward()
    assert set(diffs) == {"data", "label"}
    gx = ((g @ net.params["ip2"][0].data) * (h > 0)) @ net.params["ip1"][0].data
    np.testing.assert_allclose(diffs["data"], gx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(net.params["ip2"][0].diff, g.T @ r, rtol=1e-4, atol=1e-6)
    # clear_param_diffs zeroes every learnable diff
    net.clear_param_diffs()
    assert all(not b.diff.any() for bl in net.params.values() for b in bl)


def test_data_and_params_write_through(train_file):
    net = caffe.Net(train_file, caffe.TRAIN)
    x = np.ones((4, 3), np.float32)
    net.blobs["data"].data[...] = x
    net.blobs["label"].data[...] = 0
    net.params["ip1"][0].data[...] = 0
    net.params["ip1"][1].data[...] = 1
    w2 = np.arange(15, dtype=np.float32).reshape(3, 5) / 10
    net.params["ip2"][0].data[...] = w2
    net.params["ip2"][1].data[...] = 0
    net.forward()
    np.testing.assert_allclose(net.blobs["ip2"].data, np.tile(w2.sum(1), (4, 1)), rtol=1e-6)
    # a view kept from before keeps writing through
    view = net.blobs["data"].data
    view[...] = 2
    assert (net.blobs["data"].data == 2).all()
    # .diff writes through too (backward from a given top diff)
    d = caffe.Net(DEPLOY_NET, caffe.TEST)
    d.forward(data=x)
    d.blobs["ip2"].diff[...] = 1
    d.backward(start="ip2")
    expect = ((np.ones((4, 3)) @ d.params["ip2"][0].data) * (d.blobs["ip1"].data > 0)) @ \
        d.params["ip1"][0].data
    np.testing.assert_allclose(d.blobs["data"].diff, expect, rtol=1e-5, atol=1e-6)


def test_forward_start_end_blobs_and_backward_kwargs(deploy_file):
    net = caffe.Net(deploy_file, caffe.TEST)
    x = np.random.RandomState(1).randn(4, 3).astype(np.float32)
    out = net.forward(data=x, end="ip1")
    assert set(out) == {"ip1"}
    h, r, z = _mlp(net, x)
    np.testing.assert_allclose(out["ip1"], h, rtol=1e-5, atol=1e-6)  # relu not yet run
    out = net.forward(start="relu1", blobs=["ip1"])
    assert set(out) == {"ip2", "ip1"}
    np.testing.assert_allclose(out["ip2"], z, rtol=1e-5, atol=1e-6)
    g = np.random.RandomState(2).randn(4, 3).astype(np.float32)
    diffs = net.backward(ip2=g, diffs=["ip1"])
    assert set(diffs) == {"data", "ip1"}
    np.testing.assert_allclose(diffs["data"],
                               ((g @ net.params["ip2"][0].data) * (h > 0)) @ net.params["ip1"][0].data,
                               rtol=1e-4, atol=1e-6)
    # backward to a layer returns that layer's bottom diffs
    diffs = net.backward(ip2=g, end="ip2")
    assert set(diffs) == {"ip1"}
    with pytest.raises(KeyError):
        net.forward(nodata=x)
    with pytest.raises(ValueError, match="batch"):
        net.forward(data=np.zeros((3, 3), np.float32))


def test_forward_all_pads_the_last_batch(deploy_file):
    net = caffe.Net(deploy_file, caffe.TEST)
    x = np.random.RandomState(3).randn(10, 3).astype(np.float32)
    out = net.forward_all(data=x, blobs=["ip1"])
    assert set(out) == {"ip2", "ip1"}
    assert out["ip2"].shape == (10, 3) and out["ip1"].shape == (10, 5)
    h, r, z = _mlp(net, x)
    np.testing.assert_allclose(out["ip2"], z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["ip1"], r, rtol=1e-5, atol=1e-5)
    # batching: 10 samples at batch 4 -> 3 forwards, the last padded with zeros
    calls = []
    net.before_forward(lambda i: calls.append(i) if i == 0 else None)
    net.forward_all(data=x)
    assert len(calls) == 3
    # without inputs it is one forward from the data layers
    net.blobs["data"].data[...] = x[:4]
    np.testing.assert_allclose(net.forward_all()["ip2"], z[:4], rtol=1e-5, atol=1e-5)
    batches = list(net._batch({"data": x}))
    assert [b["data"].shape[0] for b in batches] == [4, 4, 4]
    assert not batches[-1]["data"][2:].any()


def test_forward_backward_all(deploy_file):
    net = caffe.Net(deploy_file, caffe.TEST)
    rng = np.random.RandomState(4)
    x = rng.randn(6, 3).astype(np.float32)
    g = rng.randn(6, 3).astype(np.float32)
    outs, diffs = net.forward_backward_all(data=x, ip2=g)
    assert outs["ip2"].shape == (6, 3) and diffs["data"].shape == (6, 3)
    h, r, z = _mlp(net, x)
    np.testing.assert_allclose(outs["ip2"], z, rtol=1e-5, atol=1e-5)
    gx = ((g @ net.params["ip2"][0].data) * (h > 0)) @ net.params["ip1"][0].data
    np.testing.assert_allclose(diffs["data"], gx, rtol=1e-4, atol=1e-5)


def test_reshape(deploy_file):
    net = caffe.Net(deploy_file, caffe.TEST)
    net.blobs["data"].reshape(7, 3)
    net.reshape()
    assert net.blobs["ip2"].data.shape == (7, 3)
    x = np.random.RandomState(5).randn(7, 3).astype(np.float32)
    out = net.forward(data=x)
    np.testing.assert_allclose(out["ip2"], _mlp(net, x)[2], rtol=1e-5, atol=1e-5)


def test_hooks_see_every_layer_in_order(train_file):
    net = caffe.Net(train_file, caffe.TRAIN)
    seen = []
    net.before_forward(lambda i: seen.append(("bf", i)))
    net.after_forward(lambda i: seen.append(("af", i)))
    net.before_backward(lambda i: seen.append(("bb", i)))
    net.after_backward(lambda i: seen.append(("ab", i)))
    net.forward(data=np.zeros((4, 3), np.float32), label=np.zeros(4, np.float32))
    net.backward()
    n = len(net.layers)
    fwd = [x for i in range(n) for x in (("bf", i), ("af", i))]
    bwd = [x for i in reversed(range(n)) for x in (("bb", i), ("ab", i))]
    assert seen == fwd + bwd
    # hooks can read the blobs of the layer they are called for
    maxes = {}
    net.after_forward(lambda i: maxes.setdefault(net._layer_names[i], float(
        np.max(net.blobs[net.top_names[net._layer_names[i]][0]].data))))
    net.forward()
    assert maxes["relu1"] >= 0


# -- weights -------------------------------------------------------------------------------
def test_save_copy_from_share_with_and_hdf5(train_file, tmp_path):
    pytest.importorskip("h5py")
    a = caffe.Net(train_file, caffe.TRAIN)
    path = str(tmp_path / "w.caffemodel")
    a.save(path)
    b = caffe.Net(train_file, caffe.TEST, weights=path)
    c = caffe.Net(train_file, caffe.TEST)
    c.copy_from(path)
    for net in (b, c):
        for k in a.params:
            for pa, pb in zip(a.params[k], net.params[k]):
                np.testing.assert_array_equal(pa.data, pb.data)
    h5 = str(tmp_path / "w.caffemodel.h5")
    a.save_hdf5(h5)
    d = caffe.Net(train_file, caffe.TEST)
    d.load_hdf5(h5)
    np.testing.assert_array_equal(d.params["ip2"][0].data, a.params["ip2"][0].data)
    e = caffe.Net(train_file, caffe.TEST)
    e.share_with(a)
    a.params["ip1"][0].data[...] = 3
    assert (e.params["ip1"][0].data == 3).all()


# -- MemoryData -----------------------------------------------------------------------------
MEMORY_NET = """
layer { name: "data" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 2 } }
"""


def test_set_input_arrays_feeds_batches_and_checks_like_pycaffe():
    net = caffe.Net(MEMORY_NET, caffe.TEST)
    data = np.arange(24, dtype=np.float32).reshape(4, 1, 2, 3)
    labels = np.array([1, 2, 3, 4], np.float32)
    net.set_input_arrays(data, labels)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, data[:2])
    np.testing.assert_array_equal(net.blobs["label"].data.ravel(), [1, 2])
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, data[2:])
    net.forward()  # wraps around
    np.testing.assert_array_equal(net.blobs["label"].data.ravel(), [1, 2])
    with pytest.raises(MinicaffeError, match="C contiguous"):
        net.set_input_arrays(np.asfortranarray(np.zeros((2, 1, 2, 3), np.float32).transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)[:, :, ::-1], labels[:2])
    with pytest.raises(MinicaffeError, match="float32"):
        net.set_input_arrays(data.astype(np.float64), labels)
    with pytest.raises(MinicaffeError, match="4-d"):
        net.set_input_arrays(data.reshape(4, 6), labels)
    with pytest.raises(MinicaffeError, match="channels"):
        net.set_input_arrays(np.zeros((4, 2, 2, 3), np.float32), labels)
    with pytest.raises(MinicaffeError, match="same first dimension"):
        net.set_input_arrays(data, labels[:2])
    with pytest.raises(MinicaffeError, match="multiple of batch size"):
        net.set_input_arrays(data[:3], labels[:3])
    other = caffe.Net(DEPLOY_NET, caffe.TEST)
    with pytest.raises(MinicaffeError, match="first layer is a MemoryDataLayer"):
        other.set_input_arrays(data, labels)


# -- Timer, log, NCCL ----------------------------------------------------------------------
def test_timer():
    t = caffe.Timer()
    assert t.ms == 0.0
    t.start()
    s = sum(range(20000))
    t.stop()
    assert s > 0 and t.ms > 0 and abs(t.seconds - t.ms / 1e3) < 1e-12
    assert abs(t.us - t.ms * 1e3) < 1e-6
    first = t.ms
    assert t.ms == first  # a stopped timer keeps its time
    t.start()
    running = t.ms  # reading a running timer stops it
    assert not t.running and running >= 0


def test_log_is_callable_and_glog_shaped(tmp_path):
    f = tmp_path / "log.txt"
    try:
        caffe.init_log(0, stderr=False, log_file=str(f))
        caffe.log("hello from pycaffe")
        caffe.log.info("and %s", "printf style")
    finally:
        caffe.init_log(1)
    lines = f.read_text().splitlines()
    assert lines[0].startswith("I") and lines[0].endswith("] hello from pycaffe")
    assert lines[1].endswith("] and printf style")
    with pytest.raises(ValueError):
        caffe.init_log(7)


def test_nccl_is_honest_without_nccl():
    if caffe.has_nccl():
        pytest.skip("NCCL is available here")
    assert caffe.has_nccl() is False
    with pytest.raises(MinicaffeError, match="multi-GPU NCCL is not available"):
        caffe.NCCL(None, b"")
    with pytest.raises(MinicaffeError, match="NCCL is not available"):
        caffe.NCCL.new_uid()


# -- solvers --------------------------------------------------------------------------------
SOLVER = """
net: "{net}"
base_lr: 0.1
lr_policy: "fixed"
max_iter: 4
display: 0
snapshot_after_train: false
snapshot_prefix: "{prefix}"
random_seed: 1701
"""


def _solver_file(tmp_path, train_file, extra=""):
    p = tmp_path / "solver.prototxt"
    p.write_text(SOLVER.format(net=train_file, prefix=str(tmp_path / "snap")) + extra)
    return str(p)


def test_solvers_pycaffe_surface(tmp_path, train_file):
    pytest.importorskip("minicaffe.solvers")
    names = ["SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver",
             "AdamSolver", "get_solver"]
    for n in names:
        assert hasattr(caffe, n), n
    solver = caffe.SGDSolver(_solver_file(tmp_path, train_file, "momentum: 0.9\n"))
    for attr in ["net", "test_nets", "iter", "step", "solve", "restore", "snapshot",
                 "add_callback", "param", "apply_update", "share_weights", "lr"]:
        assert hasattr(solver, attr), attr
    assert solver.lr == pytest.approx(0.1)
    assert solver.iter == 0 and solver.param.max_iter == 4
    assert isinstance(solver.net, caffe.Net) and solver.test_nets == []
    x = np.random.RandomState(6).randn(4, 3).astype(np.float32)
    solver.net.blobs["data"].data[...] = x
    solver.net.blobs["label"].data[...] = [0, 1, 2, 0]
    first = float(solver.net.forward()["loss"])
    events = []

    class CB:
        def on_start(self):
            events.append("start")

        def on_gradients_ready(self):
            events.append("grad")
    solver.add_callback(CB())
    solver.add_callback(lambda: events.append("start2"), lambda: events.append("grad2"))
    solver.step(3)
    assert solver.iter == 3 and events == ["start", "start2", "grad", "grad2"] * 3
    # share_weights: a net of the same definition sees the solver net's weights
    other = caffe.Net(train_file, caffe.TEST)
    solver.share_weights(other)
    np.testing.assert_array_equal(other.params["ip1"][0].data, solver.net.params["ip1"][0].data)
    assert float(solver.net.forward()["loss"]) < first
    # get_solver picks the class from the file's type
    ad = caffe.get_solver(_solver_file(tmp_path, train_file, 'type: "Adam"\n'))
    assert type(ad).__name__ == "AdamSolver"
    for cls, extra in ((caffe.NesterovSolver, "momentum: 0.9\n"), (caffe.AdaGradSolver, ""),
                       (caffe.RMSPropSolver, "rms_decay: 0.9\n"),
                       (caffe.AdaDeltaSolver, "momentum: 0.95\ndelta: 1e-6\n"),
                       (caffe.AdamSolver, "momentum: 0.9\n")):
        s = cls(_solver_file(tmp_path, train_file, extra))
        s.net.blobs["label"].data[...] = 0
        s.step(1)
        assert s.iter == 1


def test_solver_snapshot_restore_and_solve(tmp_path, train_file):
    pytest.importorskip("minicaffe.solvers")
    solver = caffe.SGDSolver(_solver_file(tmp_path, train_file))
    solver.net.blobs["label"].data[...] = 1
    solver.step(2)
    solver.snapshot()
    state = [f for f in os.listdir(tmp_path) if f.endswith(".solverstate")]
    assert state == ["snap_iter_2.solverstate"]
    w = solver.net.params["ip1"][0].data.copy()
    other = caffe.SGDSolver(_solver_file(tmp_path, train_file))
    other.restore(str(tmp_path / state[0]))
    assert other.iter == 2
    np.testing.assert_array_equal(other.net.params["ip1"][0].data, w)
    other.solve()
    assert other.iter == 4


# -- Python layers -------------------------------------------------------------------------
PY_LAYER = '''
import numpy as np
import minicaffe as caffe


class TimesLayer(caffe.Layer):
    """top = k * bottom (k from param_str); backward scales the diff."""

    def setup(self, bottom, top):
        self.k = float(eval(self.param_str)["k"]) if self.param_str else 1.0

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.k * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = self.k * top[0].diff
'''


def test_python_layer_in_a_netspec_net(tmp_path, monkeypatch):
    pytest.importorskip("minicaffe.layers.python_layer")
    (tmp_path / "pylayer_mod.py").write_text(PY_LAYER)
    monkeypatch.syspath_prepend(str(tmp_path))
    from minicaffe import layers as L
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    n.times = L.Python(n.data, module="pylayer_mod", layer="TimesLayer", param_str="{'k': 3}")
    n.loss = L.Power(n.times, power=1.0, loss_weight=1) \
        if "Power" in caffe.layer_type_list() else L.Python(n.times, module="pylayer_mod",
                                                            layer="TimesLayer")
    proto = n.to_proto()
    proto.force_backward = True
    f = tmp_path / "py.prototxt"
    f.write_text(str(proto))
    net = caffe.Net(str(f), caffe.TRAIN)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = net.forward(data=x)
    np.testing.assert_allclose(net.blobs["times"].data, 3 * x)
    assert net.layers[1].type == "Python"
    assert isinstance(net.layers[1].py_layer, caffe.Layer) and net.layers[1].py_layer.k == 3
    net.blobs["times"].diff[...] = 1
    net.backward(start="times")
    np.testing.assert_allclose(net.blobs["data"].diff, np.full((2, 3), 3.0))
    assert out


# -- Classifier and classify.py --------------------------------------------------------------
def _mnist_pngs(mnist_dir, tmp_path, n):
    Image = pytest.importorskip("PIL.Image")
    from minicaffe.data.datasets import load_mnist
    mn = load_mnist(mnist_dir)
    d = tmp_path / "digits"
    d.mkdir()
    for i in range(n):
        Image.fromarray(mn["test_images"][i]).save(d / f"{i:03d}.png")
    return d, mn["test_labels"][:n]


def test_classifier_on_bvlc_lenet(fixtures_dir, mnist_dir, tmp_path):
    d, labels = _mnist_pngs(mnist_dir, tmp_path, 12)
    clf = caffe.Classifier(str(fixtures_dir / "lenet_v2_deploy.prototxt"),
                           str(fixtures_dir / "lenet_v2_iter_10000.caffemodel"),
                           image_dims=(28, 28), raw_scale=1.0)
    imgs = [caffe.io.load_image(str(p), color=False) for p in sorted(d.iterdir())]
    center = clf.predict(imgs, oversample=False)
    assert center.shape == (12, 10)
    np.testing.assert_allclose(center.sum(1), 1, rtol=1e-5)
    assert (center.argmax(1) == labels).mean() >= 11 / 12
    # centre crop of a same-size image is the image: equals a plain forward
    x = np.stack([im.transpose(2, 0, 1) for im in imgs]).astype(np.float32)
    ref = np.concatenate([clf.forward(data=x[i:i + 1])[clf.outputs[0]].copy() for i in range(12)])
    np.testing.assert_allclose(center, ref, rtol=1e-5, atol=1e-6)
    # oversampling 32x32 images into 28x28 crops averages ten crops per image
    big = [caffe.io.resize_image(im, (32, 32)) for im in imgs[:3]]
    clf.image_dims = (32, 32)
    over = clf.predict(big, oversample=True)
    crops = caffe.io.oversample(big, (28, 28)).transpose(0, 3, 1, 2)
    ref = np.concatenate([clf.forward(data=crops[i:i + 1])[clf.outputs[0]].copy()
                          for i in range(30)])
    np.testing.assert_allclose(over, ref.reshape(3, 10, 10).mean(1), rtol=1e-5, atol=1e-6)


def test_classify_command_line(fixtures_dir, mnist_dir, tmp_path):
    d, labels = _mnist_pngs(mnist_dir, tmp_path, 6)
    out = tmp_path / "pred.npy"
    cmd = [sys.executable, "-m", "minicaffe.compat.classify", str(d), str(out),
           "--model_def", str(fixtures_dir / "lenet_v2_deploy.prototxt"),
           "--pretrained_model", str(fixtures_dir / "lenet_v2_iter_10000.caffemodel"),
           "--images_dim", "28,28", "--raw_scale", "1", "--center_only", "--ext", "png"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(os.path.dirname(os.path.dirname(caffe.__file__)))] +
        ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "Classifying 6 inputs." in r.stdout and "CPU mode" in r.stdout
    assert "Warning" not in r.stderr
    pred = np.load(out)
    assert pred.shape == (6, 10) and (pred.argmax(1) == labels).all()
    r = subprocess.run(cmd[:5] + ["--model_def", "nope.prototxt", "--pretrained_model", "x"] +
                       cmd[9:], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr


# -- GPU mode --------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_data_write_through(train_file):
    caffe.set_mode_gpu()
    net = caffe.Net(train_file, caffe.TRAIN)
    x = np.random.RandomState(7).randn(4, 3).astype(np.float32)
    net.forward(data=x, label=np.zeros(4, np.float32))  # data now lives on the GPU too
    x2 = x * 2
    net.blobs["data"].data[...] = x2  # write the host view, then forward on the GPU
    net.params["ip2"][1].data[...] = 0.5
    net.forward()
    h, r, z = _mlp(net, x2)
    np.testing.assert_allclose(net.blobs["ip2"].data, z, rtol=1e-5, atol=1e-5)
    net.backward()
    caffe.set_mode_cpu()
    cpu = caffe.Net(train_file, caffe.TRAIN)
    cpu.share_with(net)
    cpu.forward(data=x2, label=np.zeros(4, np.float32))
    cpu.backward()
    np.testing.assert_allclose(net.params["ip1"][0].diff, cpu.params["ip1"][0].diff,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_timer_uses_events():
    caffe.set_mode_gpu()
    from minicaffe.core import backend
    t = caffe.Timer()
    t.start()
    a = backend.cp.ones((512, 512), np.float32)
    (a @ a).sum()
    t.stop()
    assert t.uses_events and t.ms > 0


@pytest.mark.multi_gpu
def test_nccl_two_ranks_in_threads(tmp_path, train_file):
    """pycaffe's train.py flow with one thread per GPU: bcast makes the weights equal,
    then every step averages the gradients, so the ranks stay equal."""
    pytest.importorskip("minicaffe.solvers")
    if not caffe.has_nccl():
        pytest.skip("CuPy NCCL not available")
    import threading
    solver_file = _solver_file(tmp_path, train_file, "momentum: 0.9\n")
    uid = caffe.NCCL.new_uid()
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def run(rank):
        try:
            caffe.set_device(rank)
            caffe.set_mode_gpu()
            caffe.set_solver_rank(rank)
            solver = caffe.SGDSolver(solver_file)  # random_seed + rank: different weights
            rng = np.random.RandomState(rank)
            solver.net.blobs["data"].data[...] = rng.randn(4, 3)
            solver.net.blobs["label"].data[...] = rng.randint(0, 3, 4)
            barrier.wait()
            nccl = caffe.NCCL(solver, uid)
            barrier.wait()
            nccl.bcast()
            results[("init", rank)] = solver.net.params["ip1"][0].data.copy()
            solver.add_callback(nccl)
            if solver.param.layer_wise_reduce:
                solver.net.after_backward(nccl)
            solver.step(3)
            results[("end", rank)] = solver.net.params["ip1"][0].data.copy()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
            barrier.abort()

    caffe.set_solver_count(2)
    try:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        caffe.set_solver_count(1)
    assert not errors, errors
    np.testing.assert_array_equal(results[("init", 0)], results[("init", 1)])
    np.testing.assert_allclose(results[("end", 0)], results[("end", 1)], rtol=1e-6, atol=1e-7)
    assert not np.allclose(results[("init", 0)], results[("end", 0)])
