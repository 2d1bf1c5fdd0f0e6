"""Offload on the GPU (offload.py's Offloader inside engine/step.py's GpuStep): the weights
after N iterations are bit-identical with and without offload, eager and replayed as CUDA
graphs; pycaffe reads after a step see the offloaded values; DYNAMIC times an iteration
and re-plans under its budget; the measured peak goes down; bad budgets stop before
training.  All marked gpu: they skip without CuPy and a device."""
import gc

import numpy as np
import pytest
from google.protobuf import text_format

from minicaffe.core import backend, context
from minicaffe.engine import offload
from minicaffe.proto import caffe_pb2
from test_offload import CHAIN as _CPU_CHAIN

pytestmark = pytest.mark.gpu

# conv, in-place ReLU, max and average pooling, a Split into two branches joined by an
# Eltwise and a Concat, dropout in place, and a loss: what VGG, ResNet and GoogLeNet use
NET = """
name: "offload_net"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 16 dim: 3 dim: 64 dim: 64 } shape { dim: 16 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 3 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "a" type: "Convolution" bottom: "pool1" top: "a"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu_a" type: "ReLU" bottom: "a" top: "a" }
layer { name: "b" type: "Convolution" bottom: "pool1" top: "b"
  convolution_param { num_output: 16 kernel_size: 1 weight_filler { type: "xavier" } } }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "sum" }
layer { name: "cat" type: "Concat" bottom: "sum" bottom: "pool1" top: "cat" }
layer { name: "conv2" type: "Convolution" bottom: "cat" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  inner_product_param { num_output: 32 weight_filler { type: "xavier" } } }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


@pytest.fixture
def gpu(monkeypatch):
    from minicaffe.gpu import options
    old = options.deterministic
    options.set_deterministic(True)
    # The same cuDNN algorithms with and without offload: an offloading net prices its
    # workspace higher (layers/cudnn_layers.py), so from Find's timings it may take
    # algorithms with less workspace, whose rounding differs -- what these tests compare
    # is the copies' effect, so here both nets price it alike.
    from minicaffe.layers import cudnn_layers
    monkeypatch.setattr(cudnn_layers, "OFFLOAD_PRICE_PER_GIB", cudnn_layers.PRICE_PER_GIB)
    context.set_mode_gpu()
    yield backend.cp
    context.set_mode_cpu()
    options.set_deterministic(old)


def _solver(policy="NONE", budget=0, graphs=True, text=NET, **fields):
    from minicaffe.solvers import get_solver
    p = caffe_pb2.SolverParameter()
    text_format.Merge(text, p.net_param)
    p.net_param.offload_param.policy = caffe_pb2.OffloadParameter.Policy.Value(policy)
    p.net_param.offload_param.gpu_memory_budget = budget
    p.base_lr, p.lr_policy, p.momentum, p.weight_decay = 0.01, "fixed", 0.9, 0.0005
    p.display, p.random_seed = 0, 1701
    p.solver_mode = caffe_pb2.SolverParameter.GPU
    p.cuda_graph = graphs
    for k, v in fields.items():
        setattr(p, k, v)
    context.set_random_seed(1701)
    return get_solver(p)


def _weights(s):
    return [b.data.copy() for b in s.net.learnable_params]


def _between(lo, hi):
    return (lo + hi) // 2


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("policy", ["ALL", "CONV", "DYNAMIC"])
def test_offload_changes_no_number(gpu, policy, graphs):
    ref = _solver("NONE", graphs=graphs)
    ref.step(8)
    budget = 0
    if policy == "DYNAMIC":   # between ALL's peak and NONE's: something must move
        net = ref.net
        budget = _between(offload.build(net, "ALL").peak, offload.build(net, "NONE").peak)
    s = _solver(policy, budget, graphs=graphs)
    s.step(8)
    st = s.gpu_step
    assert st.offload is not None and st.offload.oplan.entries
    if graphs:
        assert st.graphs, "nothing was captured"
    if policy == "DYNAMIC":
        assert not st.offload.pending_profile and st.plan.peak <= budget
        assert sum(st.offload.times) > 0
    for a, b in zip(_weights(ref), _weights(s)):
        np.testing.assert_array_equal(a, b)
    assert ref.smoothed_loss == s.smoothed_loss
    # what pycaffe reads after the step is Caffe's value, offloaded or not (a recomputed
    # map is transient, as a diff: docs/offload.md)
    redone = {e.name for e in st.offload.oplan.entries if e.recompute is not None}
    for name in {"conv1", "pool1", "a", "sum", "cat", "conv2", "ip1"} - redone:
        np.testing.assert_array_equal(ref.net.blobs[name].data, s.net.blobs[name].data, name)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("policy", ["ALL", "DYNAMIC"])
def test_recompute_changes_no_number(gpu, monkeypatch, policy, graphs):
    """Every map that can be recomputed is (``choose_recompute(force=True)``: the fused
    Convolution+ReLU, max pooling, a chain of them): the same cuDNN kernels on the same
    inputs, each convolution's forward workspace at the recompute's own place, so the
    weights after 8 iterations are bit-identical with no offload, eager and replayed;
    the timeline shows the recomputes on the compute stream."""
    import functools
    monkeypatch.setattr(offload, "choose_recompute",
                        functools.partial(offload.choose_recompute, force=True))
    ref = _solver("NONE", graphs=graphs)
    ref.step(8)
    budget = 0
    if policy == "DYNAMIC":
        net = ref.net
        budget = _between(offload.build(net, "ALL").peak, offload.build(net, "NONE").peak)
    s = _solver(policy, budget, graphs=graphs)
    s.step(8)
    st = s.gpu_step
    redone = {e.name for e in st.offload.oplan.entries if e.recompute is not None}
    print("recomputed:", sorted(redone), "fused pairs:", s.net.fusions)
    # ALL offloads every map, so every recomputable one is recomputed; DYNAMIC offloads
    # only what its budget needs, which depends on the timed steps (in the whole GPU suite
    # on the H100 it offloaded 'a' alone, not conv1): at least one map is recomputed
    assert "conv1" in redone if policy == "ALL" else redone
    if graphs:
        assert st.graphs, "nothing was captured"
    for a, b in zip(_weights(ref), _weights(s)):
        np.testing.assert_array_equal(a, b)
    assert ref.smoothed_loss == s.smoothed_loss
    tl = offload.trace_iteration(st).as_dict()
    assert {c["name"] for c in tl["copies"] if c["kind"] == "redo"} == redone
    assert tl["summary"]["recompute"] > 0


# a chain of recomputable layers (test_offload.py's, with filled inputs): conv2's output
# made from the data through conv1's, conv1b's and pool1's (offload.through_chain), each
# made on the way in a place of its own and made again later for its own readers
CHAIN = _CPU_CHAIN.replace(
    """layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 16 dim: 16 } shape { dim: 4 } } }""",
    """layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 16 dim: 3 dim: 32 dim: 32 } shape { dim: 16 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 3 } } }""")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_recompute_through_changes_no_number(gpu, monkeypatch, graphs):
    """Maps made on the way (``choose_recompute(force=True)`` takes the longest chains:
    a recompute that runs its recomputed inputs' producers first, into places of their
    own live right before its reader's step) change no number: the weights after 8
    iterations are bit-identical with no offload, eager and replayed."""
    import functools
    monkeypatch.setattr(offload, "choose_recompute",
                        functools.partial(offload.choose_recompute, force=True))
    ref = _solver("NONE", graphs=graphs, text=CHAIN)
    ref.step(8)
    s = _solver("ALL", graphs=graphs, text=CHAIN)
    s.step(8)
    op = s.gpu_step.offload.oplan
    through = {e.name: [t.names[0] for t in op.through[id(e)]] for e in op.entries
               if op.through.get(id(e))}
    print("made on the way:", through)
    assert through
    if graphs:
        assert s.gpu_step.graphs, "nothing was captured"
    for a, b in zip(_weights(ref), _weights(s)):
        np.testing.assert_array_equal(a, b)
    assert ref.smoothed_loss == s.smoothed_loss


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_second_stream_and_pieces_change_no_number(gpu, monkeypatch, graphs):
    """Copies out on both device->host streams (every other map on the second) and cut
    into 64 KiB pieces: the same weights and blobs as without offload, eager and
    replayed; the step's timeline shows copies on both streams."""
    def alternate(entries, times, first=0, *a, **kw):
        for k, e in enumerate(sorted(entries, key=lambda e: e.d2h_after)):
            e.lane = k % 2
        return sum(e.lane for e in entries)
    monkeypatch.setattr(offload, "choose_lanes", alternate)
    monkeypatch.setattr(offload, "COPY_CHUNK", 64 << 10)
    ref = _solver("NONE", graphs=graphs)
    ref.step(8)
    s = _solver("ALL", graphs=graphs)
    s.step(8)
    st = s.gpu_step
    assert {e.lane for e in st.offload.oplan.entries} == {0, 1}
    if graphs:
        assert st.graphs, "nothing was captured"
    for a, b in zip(_weights(ref), _weights(s)):
        np.testing.assert_array_equal(a, b)
    for name in ("conv1", "pool1", "a", "sum", "cat", "conv2", "ip1"):
        np.testing.assert_array_equal(ref.net.blobs[name].data, s.net.blobs[name].data, name)
    tl = offload.trace_iteration(st).as_dict()
    assert {c["lane"] for c in tl["copies"] if c["kind"] == "out"} == {0, 1}


def test_iter_size_and_a_forward_after_training(gpu):
    ref = _solver("NONE", iter_size=2)
    ref.step(4)
    s = _solver("ALL", iter_size=2)
    s.step(4)
    for a, b in zip(_weights(ref), _weights(s)):
        np.testing.assert_array_equal(a, b)
    # a plain pycaffe forward on the trained net still works (fresh device memory for the
    # offloaded blobs), and the next step offloads again
    runs = []
    for solver in (ref, s):        # the same random data and dropout for both
        context.set_random_seed(7)
        runs.append(solver.net.forward()["loss"].copy())
    np.testing.assert_array_equal(runs[0], runs[1])
    for solver in (ref, s):
        context.set_random_seed(8)
        solver.step(2)
    for a, b in zip(_weights(ref), _weights(s)):
        np.testing.assert_array_equal(a, b)


def test_offload_lowers_the_planned_and_the_measured_peak(gpu):
    from minicaffe.gpu import pool
    peaks = {}
    for policy in ("NONE", "ALL"):
        s = _solver(policy, graphs=False)
        backend.cp.cuda.Device().synchronize()
        pool.reset_peak()          # after the net is built (cuDNN's Find takes its own)
        before = pool.used_bytes()
        s.step(3)
        backend.cp.cuda.Device().synchronize()
        peaks[policy] = (pool.peak_bytes() - before, s.gpu_step.plan.peak)
        del s
        gc.collect()               # (the offload hooks make a cycle through the net)
    print("measured / planned peak bytes:", peaks)
    assert peaks["ALL"][1] < peaks["NONE"][1]
    assert peaks["ALL"][0] < peaks["NONE"][0]


def test_budget_too_small_stops_before_training(gpu):
    s = _solver("ALL", budget=1 << 20)
    before = _weights(s)
    with pytest.raises(offload.BudgetError, match="too small .* even with offload policy ALL"):
        s.step(1)
    assert s.iter == 0
    for a, b in zip(before, _weights(s)):
        np.testing.assert_array_equal(a, b)


def test_copies_and_events_are_captured_in_the_graph(gpu):
    """One replay is one launch: the copy streams fork from and join into the capture."""
    s = _solver("ALL")
    s.step(3)
    st = s.gpu_step
    assert st.graphs_on and st.graphs
    g = next(iter(st.graphs.values()))
    st.stream.synchronize()
    for _ in range(3):
        g.launch(st.stream)
    st.stream.synchronize()
    st.offload.park()
    assert all(e.buf.mem.device_array is None for e in st.offload.oplan.entries)


def test_each_convolution_gets_its_workspace_in_the_plan(gpu):
    """Under the GPU step each cuDNN convolution's forward and backward workspace is a
    buffer of the memory plan, the size its chosen algorithms need, placed apart from
    everything alive at its step; training does not grow the thread's shared workspace."""
    from minicaffe.engine.plan import workspace_need
    context.get().handles.pop("cudnn_ws", None)
    s = _solver("NONE")
    s.step(3)
    plan = s.gpu_step.plan
    convs = [l for l in s.net.layers if getattr(l, "uses_cudnn", False)]
    assert convs
    want = {(l.name, d): workspace_need(l, d) for l in convs
            for d in ("forward", "backward") if workspace_need(l, d)}
    got = {(b.mem.layer.name, b.mem.direction): b.mem.size
           for b in plan.buffers if b.kind == "workspace"}
    print("planned workspaces (bytes):", got)
    assert got == want
    for b in plan.buffers:
        if b.kind == "workspace":
            for c in plan.buffers:
                if c is not b and c.overlaps(b):
                    assert b.offset + b.nbytes <= c.offset or c.offset + c.nbytes <= b.offset
    assert context.get().handles.get("cudnn_ws") is None


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_a_budget_under_the_floor_squeezes_the_workspaces_of_its_steps(gpu, graphs):
    """A budget under the floor that the net's workspaces make: the convolutions whose
    steps are over it take smaller workspaces, and the net trains within the budget."""
    net = _solver("NONE").net
    plan = offload.build(net, "ALL").plan
    f = offload.floor_parts(plan)
    maps, _ = offload.step_floor(plan)
    # half the worst step's workspace too little, never below the floor without any
    budget = max(f["total"] - f["workspace"] // 2, int(maps.max()) + plan.side_bytes + (1 << 20))
    if budget >= f["total"]:
        pytest.skip("cuDNN chose algorithms without workspace for this net here")
    s = _solver("ALL", budget, graphs=graphs)
    s.step(4)
    st = s.gpu_step
    print("budget", budget, "floor", f["total"], "planned peak", st.plan.peak)
    assert st.offload is not None and st.plan.peak <= budget
    assert offload.floor_bytes(st.plan) <= budget < f["total"]
    assert np.isfinite(s.smoothed_loss)
    if graphs:
        assert st.graphs
