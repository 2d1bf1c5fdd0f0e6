"""Reduced precision on the GPU (issue 20): bf16 and fp16 training steps against fp32
within stated tolerances, the cuDNN convolution's float16/bfloat16 calls, storage in the
reduced type, loss scaling on overflow, and exact resume."""
import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core import precision as P
from minicaffe.core.config import RunConfig
from minicaffe.core.protoio import parse_text
from minicaffe.proto import caffe_pb2
from test_precision import NET, SOLVER

pytestmark = pytest.mark.gpu

CONV_NET = """
name: "convs"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 16 dim: 8 dim: 12 dim: 12 } shape { dim: 16 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: 0 max: 3.99 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 1 weight_filler { type: "msra" } } }
layer { name: "pool" type: "Pooling" bottom: "conv2" top: "pool"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def solver(precision, net=CONV_NET, extra="", graphs=None):
    from minicaffe.solvers import SGDSolver
    context.set_mode_gpu()
    sp = parse_text(SOLVER % net + extra, caffe_pb2.SolverParameter())
    sp.solver_mode = caffe_pb2.SolverParameter.GPU
    return SGDSolver(sp, config=RunConfig(precision=precision, cuda_graphs=graphs))


def weights(s):
    return [b.data.copy() for b in s.net.learnable_params]


@pytest.mark.parametrize("prec,kind,tol", [("bf16", "BFLOAT16", 0.05),
                                           ("fp16", "FLOAT16", 0.01)])
def test_reduced_step_tracks_fp32_and_stores_reduced(prec, kind, tol):
    ref = solver(None)          # each solver seeds the generators (random_seed) when built:
    ref.step(5)                 # build, then step, one after the other (same data)
    low = solver(prec)
    assert [l.uses_cudnn for l in low.net.layers if l.type == "Convolution"] == [True, True]
    low.step(5)
    for a, b in zip(weights(ref), weights(low)):
        assert np.abs(a - b).max() <= tol * np.abs(a).max()
    # each stored diff is read right after the backward that wrote it: the GPU step's
    # memory plan shares activation diffs (docs/gpu_engine.md), so once its consumer's
    # backward has run, a diff's place holds a later buffer (another diff, a cuDNN
    # workspace) -- after the whole backward, only the data are Caffe's to read
    net = low.net
    diffs = {name: net.blobs[name] for name in ("conv1", "conv2", "pool")}
    checked = []

    def after_backward(i):          # after the Net's own hooks (its rounding)
        for name, blob in diffs.items():
            if net.layer_need_backward[i] and any(b is blob for b in net.bottom_vecs[i]):
                assert P.representable(np, blob.diff, kind), (net.layer_names[i], name)
                checked.append(name)

    net.add_hook("after_backward", after_backward)
    net.forward()
    net.backward()
    assert sorted(set(checked)) == ["conv1", "conv2", "pool"]
    for name in ("data", "conv1", "conv2", "pool", "ip"):
        assert P.representable(np, net.blobs[name].data, kind), name
    assert not P.representable(np, net.params["conv1"][0].data, kind)


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_reduced_conv_matches_the_emulation_on_the_cpu(prec):
    """The cuDNN float16/bfloat16 convolution against the CPU's rounding of fp32 math on
    the same (reduced-valued) inputs: they differ by the weights' rounding and the
    summation order only."""
    from minicaffe.network.net import Net
    from test_precision import net_param
    context.set_mode_gpu()
    context.set_random_seed(1701)
    g = Net(net_param(CONV_NET), config=RunConfig(precision=prec))
    g.forward()
    g.backward()
    context.set_mode_cpu()
    c = Net(net_param(CONV_NET), config=RunConfig(precision=prec))
    for name in g.params:
        for a, b in zip(g.params[name], c.params[name]):
            b.data[...] = a.data
    c.blobs["data"].data[...] = g.blobs["data"].data
    c.blobs["label"].data[...] = g.blobs["label"].data
    c.forward(start="conv1")
    c.backward()
    tol = 0.03 if prec == "bf16" else 4e-3
    for name in ("conv1", "conv2", "ip"):
        a, b = g.blobs[name].data, c.blobs[name].data
        assert np.abs(a - b).max() <= tol * np.abs(b).max() + 1e-6, name
    a, b = g.params["conv1"][0].diff, c.params["conv1"][0].diff
    assert np.abs(a - b).max() <= 2 * tol * np.abs(b).max()


def test_graph_replay_equals_eager_in_bf16(deterministic):
    a = solver("bf16", graphs=False)
    a.step(3)
    b = solver("bf16", graphs=True)
    b.step(3)
    for x, y in zip(weights(a), weights(b)):
        assert np.allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.fixture
def deterministic():
    from minicaffe.gpu import options
    was = options.deterministic
    options.set_deterministic(True)
    yield
    options.set_deterministic(was)


def test_fp16_overflow_is_skipped_on_the_gpu():
    s = solver("fp16")
    assert s.loss_scaler is not None and s.loss_scaler.dynamic
    w0 = weights(s)
    s.loss_scaler.scale = 2.0 ** 40
    s.step(1)
    assert s.loss_scaler.skipped == 1 and s.loss_scaler.scale == 2.0 ** 39
    assert all(np.array_equal(a, b) for a, b in zip(w0, weights(s)))
    s.loss_scaler.scale = 2.0 ** 12
    s.step(2)
    assert s.loss_scaler.skipped == 1


def test_fp16_resume_is_exact_on_the_gpu(tmp_path, deterministic):
    prefix = str(tmp_path / "g")
    net = NET.replace('type: "gaussian" std: 1', 'type: "constant" value: 0.5')
    s = solver("fp16", extra=f'snapshot_prefix: "{prefix}"', net=net)
    s.step(2)
    s.snapshot()
    s.step(3)
    want = weights(s)
    r = solver("fp16", extra=f'snapshot_prefix: "{prefix}"', net=net)
    r.restore(prefix + "_iter_2.solverstate")
    r.step(3)
    for a, b in zip(want, weights(r)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("storage", ["BFLOAT16", "FLOAT16"])
def test_gpu_casts_round_as_the_cpu(storage):
    from minicaffe.core import backend
    from minicaffe.kernels.precision import (buffer_dtype, from_reduced, round_storage,
                                             to_reduced)
    cp = backend.gpu_module()
    rng = np.random.RandomState(1701)
    x = (rng.randn(4, 3, 5, 7) * 10.0 ** rng.randint(-6, 6, (4, 3, 5, 7))).astype(np.float32)
    x.flat[:3] = [np.inf, -7e4, np.nan]
    want = x.copy()
    P.round_to(np, want, storage)
    g = cp.asarray(x)
    round_storage(cp, g, storage)
    assert np.array_equal(cp.asnumpy(g), want, equal_nan=True)
    h = to_reduced(cp.asarray(x), cp.empty(x.shape, buffer_dtype(storage)), storage)
    bias = cp.asarray(rng.randn(3).astype(np.float32))
    out = from_reduced(h, cp.empty(x.shape, np.float32), storage, bias=bias, relu=True)
    ref = np.maximum(want + cp.asnumpy(bias)[None, :, None, None], 0)
    ok = ~np.isnan(want)
    assert np.array_equal(cp.asnumpy(out)[ok], ref[ok])


# -- fp16 loss scaling inside the GPU step (the replayed CUDA graph) against the eager path ------
LENET = """
name: "lenet_dummy"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 64 dim: 1 dim: 28 dim: 28 } shape { dim: 64 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: 0 max: 9.99 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 20 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 50 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  inner_product_param { num_output: 500 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def fp16_solver(net, graph, **fields):
    """fp16 on the GPU: ``graph`` True, the GPU step (its body replayed as a CUDA graph,
    loss scaling on the device); False, the eager layer-by-layer path (an SGD solver
    without a fused rule: the eager update, the host's check of the scale)."""
    from minicaffe.solvers import SGDSolver

    class EagerSGD(SGDSolver):
        fused_rule = None

    context.set_mode_gpu()
    sp = parse_text(SOLVER % net, caffe_pb2.SolverParameter())
    sp.solver_mode = caffe_pb2.SolverParameter.GPU
    for k, v in fields.items():
        setattr(sp, k, v)
    s = (SGDSolver if graph else EagerSGD)(sp, config=RunConfig(precision="fp16",
                                                               cuda_graphs=graph))
    assert s.uses_gpu_step == graph and s.loss_scaler.dynamic
    return s


def _scale_lines(caplog):
    return [r.getMessage() for r in caplog.records if "loss scale" in r.getMessage()]


# LeNet with AVE pooling: with MAX, where the two paths round a value an ulp apart a window
# may take another argmax and move a whole gradient element, and at lr 0.1 on random labels
# six steps amplified such flips past any fixed bound (ip1's weights 11.9% of their norm
# apart in one of three H100 runs, 0.5% in the others)
LENET_AVE = LENET.replace("pool: MAX", "pool: AVE")


@pytest.mark.parametrize("net", [LENET_AVE, CONV_NET], ids=["lenet", "convs"])
def test_fp16_graph_step_matches_the_eager_step(net, deterministic, caplog):
    """Step for step the same loss-scaling state and the same display lines on both
    paths, weights within 5% of each blob's L2 norm (the GPU step stores the maps in
    2-byte buffers where the eager path rounds fp32 ones: the same values, rounded at
    other points), and every step follows the dynamic rule: an
    overflow (one injected with a scale of 2^40) is skipped -- the weights do not move,
    the count goes up, the scale halves -- and a clean step counts, the scale doubling
    on the INTERVAL-th in a row (one made sure of: scale 1 at the first step, one clean
    step short of growing).  Which other steps overflow is the net's business; both
    paths must agree (lr 0.01: the paths' roundings stay small against the steps)."""
    import logging
    from minicaffe.engine.precision import INTERVAL

    def scenario(graph):
        caplog.clear()
        seen = []        # per step: (state before, weights before, state after, weights)
        with caplog.at_level(logging.INFO):
            s = fp16_solver(net, graph, display=3, base_lr=0.01)
            for it in range(6):
                if it == 0:
                    s.loss_scaler.scale = 1.0           # no fp16 diff overflows at 1
                    s.loss_scaler.good = INTERVAL - 1   # one clean step short of growing
                if it == 3:
                    s.loss_scaler.scale = 2.0 ** 40     # the fp16 diffs overflow
                if it == 4:
                    s.loss_scaler.scale = 1.0
                before = (s.loss_scaler.state(), weights(s))
                s.step(1)
                seen.append(before + (s.loss_scaler.state(), weights(s)))
        if graph:
            assert s.gpu_step.graphs, "the iteration was not captured as a CUDA graph"
        return seen, _scale_lines(caplog)

    eager, eager_lines = scenario(False)
    graph, graph_lines = scenario(True)
    assert [st for _, _, st, _ in graph] == [st for _, _, st, _ in eager]
    assert graph_lines == eager_lines and len(graph_lines) == 3   # Solver init, iters 0, 3
    # (held to each blob's L2 norm, not its largest element: with the graph step's maps
    # channels-last, its cuDNN algorithms are others than the eager NCHW step's)
    for (_, _, _, we), (_, _, _, wg) in zip(eager, graph):
        for k, (a, b) in enumerate(zip(we, wg)):
            gap = np.linalg.norm(a - b) / np.linalg.norm(a)
            print(f"param {k}: |graph - eager| / |eager| (L2) {gap:.3g}")
            assert gap <= 5e-2, k
    for (scale, good, skipped), w0, after, w1 in graph:
        moved = not all(np.array_equal(a, b) for a, b in zip(w0, w1))
        if after[2] == skipped + 1:                     # an overflow: skipped, counted
            assert after == (scale / 2, 0, skipped + 1) and not moved
        elif good + 1 == INTERVAL:                      # the INTERVAL-th clean step
            assert after == (scale * 2, 0, skipped) and moved
        else:
            assert after == (scale, good + 1, skipped) and moved
    assert graph[0][2] == (2.0, 0, 0)                   # grown at the first step
    k = graph[3][0][2]
    assert graph[3][2] == (2.0 ** 39, 0, k + 1)        # the injected overflow
    assert f"{graph[3][2][2]} steps skipped" in graph_lines[-1]


def test_fp16_huge_loss_weight_is_skipped_and_counted_in_the_graph():
    """A loss weight of 1e8 overflows every fp16 diff until the scale has come down:
    the first 6 steps are all skipped, on both paths (the weights do not move), the
    scale halves each time, the count reaches 6."""
    net = CONV_NET.replace('top: "loss" }', 'top: "loss" loss_weight: 1e8 }')
    for graph in (False, True):
        s = fp16_solver(net, graph)
        w0 = weights(s)
        s.step(6)
        assert s.loss_scaler.state() == (2.0 ** 10, 0, 6), graph
        assert all(np.array_equal(a, b) for a, b in zip(w0, weights(s))), graph


def test_fp16_graph_resume_is_exact_and_carries_the_scale(tmp_path, deterministic):
    prefix = str(tmp_path / "gs")
    net = NET.replace('type: "gaussian" std: 1', 'type: "constant" value: 0.5')
    s = fp16_solver(net, True, snapshot_prefix=prefix)
    s.step(2)
    s.loss_scaler.scale = 2.0 ** 40
    s.step(1)                                   # skipped, counted, in the replayed graph
    assert s.loss_scaler.state() == (2.0 ** 39, 0, 1)
    s.loss_scaler.scale = 2.0 ** 10             # (2^39 would overflow again)
    s.snapshot()
    s.step(3)
    want, state = weights(s), s.loss_scaler.state()
    r = fp16_solver(net, True, snapshot_prefix=prefix)
    r.restore(prefix + "_iter_3.solverstate")
    assert r.loss_scaler.state() == (2.0 ** 10, 0, 1)
    r.step(3)
    assert r.loss_scaler.state() == state == (2.0 ** 10, 3, 1)
    for a, b in zip(want, weights(r)):
        assert np.array_equal(a, b)
