"""Recomputation in place of the copies (offload.py ``choose_recompute``): which maps
may be made again, which the timeline model picks, that a recomputed map is never
read before it is made again (the fake device that checks every read), and that the
weights do not change (the CPU engine, with the recomputes made where the plan says).

The CUDA side (the same, eager and replayed as CUDA graphs) is in test_offload_gpu.py."""
import functools

import numpy as np
import pytest
from google.protobuf import text_format

from minicaffe import Net
from minicaffe.core import context
from minicaffe.engine import offload
from minicaffe.engine.plan import MemoryPlan
from minicaffe.engine.schedule import schedule_for
from minicaffe.proto import caffe_pb2
from test_offload import _fake_times, _net, _run_on_fake_device, _synthetic, check_plan

# every layer type the recompute may run (conv, in-place ReLU, LRN, MAX pooling with
# Caffe's mask, AVE pooling) and two it must not (Dropout, BatchNorm in training)
NET = """
name: "redo_net"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 16 dim: 16 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1" lrn_param { local_size: 3 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "bn" type: "BatchNorm" bottom: "conv2" top: "bn" }
layer { name: "pool2" type: "Pooling" bottom: "bn" top: "pool2"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  inner_product_param { num_output: 16 weight_filler { type: "xavier" } } }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

force = functools.partial(offload.choose_recompute, force=True)


def _redo_net():
    return Net(NET, phase=caffe_pb2.TRAIN)


def _buffers(net):
    plan = MemoryPlan(net)
    return {b.names[0]: b for b in plan.buffers if b.kind == "data" and b.part is None}


def test_only_deterministic_stateless_producers_run_again():
    net = _redo_net()
    bufs = _buffers(net)
    ids = {n: i for i, n in enumerate(net.layer_names)}
    assert offload.recompute_layers(net, bufs["conv1"]) == (ids["conv1"], ids["relu1"])
    assert offload.recompute_layers(net, bufs["norm1"]) == (ids["norm1"],)
    assert offload.recompute_layers(net, bufs["pool1"]) == (ids["pool1"],)
    assert offload.recompute_layers(net, bufs["pool2"]) == (ids["pool2"],)
    assert offload.recompute_layers(net, bufs["bn"]) is None        # batch statistics
    assert offload.recompute_layers(net, bufs["ip1"]) is None       # InnerProduct, Dropout
    stochastic = NET.replace("pool: MAX", "pool: STOCHASTIC")
    net = Net(stochastic, phase=caffe_pb2.TRAIN)
    assert offload.recompute_layers(net, _buffers(net)["pool1"]) is None


def test_the_model_picks_conv1_1_of_vgg16():
    """VGG-16 at batch 256, roofline times: conv1_1's 3 GiB output, made from the data
    in a few ms, is recomputed rather than copied out and back (~2 x 60 ms of link);
    the model is shorter than with every map copied; nothing after pool5 (InnerProduct,
    Dropout) is recomputed; the schedule shows the recompute before its reader."""
    net = _synthetic("models/vgg16/train_val.prototxt", 256, [3, 224, 224])
    times = offload.estimate_times(net)
    first = offload.n_prologue(net)
    op = offload.build(net, "ALL", times=times)
    check_plan(op)
    redo = {e.name: e for e in op.entries if e.recompute is not None}
    assert "conv1_1" in redo and op.info["recomputed"] == len(redo)
    assert not {"fc6", "fc7", "fc8", "pool5"} & set(redo)
    assert op.recomputed_bytes == sum(e.copy_bytes for e in redo.values())
    assert op.moved_bytes + op.recomputed_bytes == sum(e.copy_bytes for e in op.entries)
    with_redo = offload.simulate(times, op.entries, first, lazy=True)[0]
    saved = offload.RECOMPUTE
    try:
        offload.RECOMPUTE = False
        plain = offload.build(net, "ALL", times=times)
    finally:
        offload.RECOMPUTE = saved
    assert not any(e.recompute for e in plain.entries)
    assert with_redo < offload.simulate(times, plain.entries, first, lazy=True)[0]
    assert any("recomputed (forward of 'conv1_1'+'relu1_1' again)" in line
               for line in op.describe())
    # the schedule: the recompute op right before the backward op of its first reader
    ops = schedule_for(net, 1, op).ops
    e = redo["conv1_1"]
    k = next(k for k, o in enumerate(ops) if o.kind == "recompute" and o.name == "conv1_1")
    reader = net.layer_names[offload.step_layer(net, e.bwd_first)[0]]
    nxt = next(o for o in ops[k:] if o.kind in ("forward", "backward"))
    assert nxt.kind == "backward" and reader in nxt.name
    assert "conv1_1+relu1_1 again" in str(ops[k])


def test_a_recompute_that_does_not_pay_is_not_taken():
    """Copies that hide under long compute cost nothing: nothing is recomputed."""
    net = _redo_net()
    op = offload.build(net, "ALL", times=_fake_times(net, conv=1.0, other=1.0))
    assert not any(e.recompute for e in op.entries)


@pytest.mark.parametrize("early", [False, True], ids=["late-copies", "early-copies"])
@pytest.mark.parametrize("which", ["chain", "redo_net", "googlenet"])
def test_a_recomputed_map_is_never_read_before_it_is_made(monkeypatch, which, early):
    """Every map that can be recomputed is (``force``), with chains (a recompute whose
    input is recomputed too, or comes back by a copy): on the fake device every read of
    every step -- and of every layer a recompute runs again -- checks the value."""
    monkeypatch.setattr(offload, "choose_recompute", force)
    net = {"chain": _net, "redo_net": _redo_net,
           "googlenet": lambda: _synthetic("models/bvlc_googlenet/train_val.prototxt", 2,
                                           [3, 224, 224])}[which]()
    op = offload.build(net, "ALL", times=_fake_times(net))
    check_plan(op)
    redo = [e for e in op.entries if e.recompute is not None]
    assert redo and any(e.recompute for e in op.entries if e.recompute is None) is False
    assert any(op.through.values())          # maps made on the way: their reads too
    if which != "googlenet":
        by_mem = {id(e.buf.mem): e for e in op.entries}
        assert any(id(m) in by_mem for e in redo for m in offload.recompute_inputs(net, e))
    assert _run_on_fake_device(monkeypatch, net, op, early) > len(op.entries)


def test_fake_device_catches_a_recompute_made_too_late(monkeypatch):
    """The harness is not blind: a recompute one step after its first reader fails."""
    monkeypatch.setattr(offload, "choose_recompute", force)
    net = _net()
    op = offload.build(net, "ALL", times=_fake_times(net))
    assert any(e.recompute for e in op.entries)
    real = op.tables

    def late():
        t = real()
        for s in sorted((s for s in t if t[s].get("recompute")), reverse=True):
            t[s + 1]["recompute"] = t[s].pop("recompute") + t[s + 1].get("recompute", [])
        return t
    monkeypatch.setattr(op, "tables", late)
    with pytest.raises(AssertionError):
        _run_on_fake_device(monkeypatch, net, op, early=False)


def _cpu_solver(seed=1701):
    from minicaffe.solvers import get_solver
    p = caffe_pb2.SolverParameter()
    text_format.Merge(NET, p.net_param)
    p.base_lr, p.lr_policy, p.momentum, p.weight_decay = 0.05, "fixed", 0.9, 0.0005
    p.display, p.random_seed = 0, seed
    p.solver_mode = caffe_pb2.SolverParameter.CPU
    context.set_random_seed(seed)
    return get_solver(p)


def _drop_and_redo(net, op, skip=()):
    """On the CPU engine, what the offloader does to a recomputed map: after its last
    forward reader its data is spoilt (7.25 everywhere: the place is another map's), and
    right before its first backward reader its producers run again (``Net.forward_again``),
    inputs first, as the plan's tables say.  ``skip``: names not made again."""
    table = op.tables()
    L = len(net.layers)
    redo = [e for e in op.entries if e.recompute is not None]

    def after_forward(i):
        for e in redo:
            if e.fwd_end == i:
                net.blobs[e.name].data[...] = 7.25

    def before_backward(i):
        for e in table.get(2 * L - 1 - i, {}).get("recompute", ()):
            if e.name not in skip:
                for j in e.recompute:
                    net.forward_again(j)
                for m in offload.recompute_through(net, e):     # its place let go
                    next(b for b in net._blobs if b.data_mem is m).data[...] = 7.25
    net.add_hook("after_forward", after_forward)
    net.add_hook("before_backward", before_backward)
    return redo


@pytest.mark.parametrize("spoil", [False, True], ids=["as-planned", "one-left-out"])
def test_recompute_keeps_the_weights_bit_identical_on_the_cpu(spoil):
    """The plan's recomputes (every one that can: conv+ReLU in place, LRN, MAX pooling
    with Caffe's mask, AVE pooling; not the BatchNorm or the Dropout, whose forward
    would change their statistics or draw a new mask) run on the CPU engine where the
    plan puts them: the weights after 4 iterations are bit-identical with a run
    without them.  Not blind: one recompute left out spoils the weights."""
    ref = _cpu_solver()
    ref.step(4)
    s = _cpu_solver()
    saved = offload.choose_recompute
    try:
        offload.choose_recompute = force
        op = offload.build(s.net, "ALL", times=_fake_times(s.net))
    finally:
        offload.choose_recompute = saved
    assert any(op.through.values())   # maps made on the way, let go, made again
    redo = _drop_and_redo(s.net, op, skip=("conv1",) if spoil else ())
    names = {e.name for e in redo}
    assert {"conv1", "norm1", "pool1"} <= names and not {"bn", "ip1"} & names
    s.step(4)
    same = all(np.array_equal(a.data, b.data) for a, b in
               zip(ref.net.learnable_params, s.net.learnable_params))
    assert same != spoil
    if not spoil:
        assert ref.smoothed_loss == s.smoothed_loss


# -- the budget-aware copy bound (benchmarks/offload.py prints it beside each policy) ----------
@pytest.mark.parametrize("scale", [1e-3, 1e-6, 1e-9])
def test_budget_bound_is_under_every_copy_schedule_and_over_the_compute(monkeypatch, scale):
    """The fluid bound: the compute where the budget holds everything, never above what
    the timeline model gives the copy schedules of ALL within the same memory, growing
    as the budget shrinks, None under the floor."""
    monkeypatch.setattr(offload, "RECOMPUTE", False)        # a copy-only bound
    net = _synthetic("models/vgg16/train_val.prototxt", 8, [3, 64, 64])
    times = _fake_times(net, conv=scale, other=scale / 100)
    first = offload.n_prologue(net)
    plan = MemoryPlan(net)
    compute = sum(times[first:])
    none = offload.build(net, "NONE").peak
    assert offload.budget_bound(plan, times, none) == pytest.approx(compute)
    every = offload.build(net, "ALL", times=times)
    floor = offload.floor_bytes(plan)
    assert offload.budget_bound(plan, times, floor - (1 << 20)) is None
    last = compute
    for budget in sorted({none, (none + every.peak) // 2, every.peak,
                          (every.peak + floor) // 2, floor}, reverse=True):
        b = offload.budget_bound(plan, times, budget)
        assert b >= last - 1e-12
        last = b
        if budget >= every.peak:      # ALL's schedule, a copy schedule in this memory
            assert b <= offload.simulate(times, every.entries, first, lazy=True)[0] + 1e-12
    if scale == 1e-9:                  # compute is nothing: the link decides
        assert last > 100 * compute


# -- maps made on the way (offload.through_chain) and memory right before a step --------------
MINI_VGG = """
name: "mini_vgg"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 16 dim: 3 dim: 64 dim: 64 } shape { dim: 16 } } }
layer { name: "conv1_1" type: "Convolution" bottom: "data" top: "conv1_1"
        convolution_param { num_output: 32 kernel_size: 3 pad: 1 } }
layer { name: "relu1_1" type: "ReLU" bottom: "conv1_1" top: "conv1_1" }
layer { name: "conv1_2" type: "Convolution" bottom: "conv1_1" top: "conv1_2"
        convolution_param { num_output: 32 kernel_size: 3 pad: 1 } }
layer { name: "relu1_2" type: "ReLU" bottom: "conv1_2" top: "conv1_2" }
layer { name: "pool1" type: "Pooling" bottom: "conv1_2" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 32 kernel_size: 3 pad: 1 } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: AVE kernel_size: 4 stride: 4 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip" inner_product_param { num_output: 5 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_a_map_is_made_through_recomputed_inputs_where_that_is_shorter(monkeypatch):
    """VGG-16's pattern in small: under a budget a little below ALL's peak, with copies
    dearer than the convolutions, pool1 is made from the data through conv1_1's and
    conv1_2's outputs (made on the way, each in a place of its own right before pool1's
    reader's step, and made again later for their own readers) -- shorter in the
    timeline model than without such chains, within the budget; every read checked on
    the fake device."""
    net = Net(MINI_VGG, phase=caffe_pb2.TRAIN)
    times = _fake_times(net, conv=2e-5, other=1e-6)
    first = offload.n_prologue(net)
    budget = offload.build(net, "ALL", hide=False).peak - (1 << 20)
    op = offload.build(net, "ALL", budget, times=times)
    check_plan(op)
    assert op.peak <= budget
    through = {e.name: [t.names[0] for t in op.through[id(e)]] for e in op.entries
               if op.through.get(id(e))}
    assert through == {"pool1": ["conv1_1 (made again for pool1)",
                                 "conv1_2 (made again for pool1)"]}
    redo = {e.name: e for e in op.entries if e.recompute is not None}
    ids = {n: i for i, n in enumerate(net.layer_names)}
    assert redo["pool1"].recompute == tuple(ids[n] for n in (
        "conv1_1", "relu1_1", "conv1_2", "relu1_2", "pool1"))
    assert {"conv1_1", "conv1_2"} <= set(redo)        # made again for their own readers
    assert any("made on the way, in a place of their own: conv1_1, conv1_2" in line
               for line in op.describe())
    with_chains = offload.simulate(times, op.entries, first, lazy=True)[0]
    monkeypatch.setattr(offload, "THROUGH", False)
    plain = offload.build(Net(MINI_VGG, phase=caffe_pb2.TRAIN), "ALL", budget, times=times)
    assert not any(plain.through.values())
    assert with_chains < offload.simulate(times, plain.entries, first, lazy=True)[0]
    monkeypatch.setattr(offload, "THROUGH", True)
    assert _run_on_fake_device(monkeypatch, net, op, early=False) > len(op.entries)


def test_a_buffer_alive_only_before_a_step_shares_with_what_that_step_first_writes():
    """``Buffer.boundary``: a recompute's place, alive right before step s's op, may
    share memory with a diff or workspace that step s's op is the first to touch, and
    with nothing alive across the boundary, nor with a map fetched or made there."""
    from minicaffe.engine.plan import Buffer

    class Mem:
        size, dtype = 1024, np.dtype(np.float32)

    def buf(kind, start, end, part=None, boundary=False):
        b = Buffer(Mem(), kind, kind)
        b.start, b.end, b.part, b.boundary = start, end, part, boundary
        return b
    t = buf("data", 5, 5, "recompute", True)
    assert not t.overlaps(buf("diff", 5, 7)) and not buf("workspace", 5, 5).overlaps(t)
    assert t.overlaps(buf("diff", 4, 5))               # alive across the boundary
    assert t.overlaps(buf("data", 5, 6, "backward"))   # fetched or made right there
    assert t.overlaps(buf("workspace", 5, 5, "recompute", True))
    assert t.overlaps(buf("data", 3, 9)) and not t.overlaps(buf("diff", 6, 7))
    assert not t.overlaps(buf("data", 2, 4))


def test_vgg16_under_12gib_on_the_h100s_numbers(monkeypatch):
    """benchmarks/offload_replay.py replays a GPU run's planning inputs on the CPU (the
    H100's step times and cuDNN Find results for VGG-16 b256 under 12 GiB): the policy
    makes conv1_2's output from the data through conv1_1's, copies neither, plans
    within 12 GiB less the margin, and the model has no wait left, only compute and
    recomputes (the H100 measured 408.8 ms, no wait: docs/offload.md, round 5).
    Without such chains conv1_2's output is copied out and back."""
    from repo_scripts import load_script
    mod = load_script("benchmarks/offload_replay.py")
    for name in ("THROUGH", "RECOMPUTE", "BUDGET_MARGIN"):     # the replay sets them
        monkeypatch.setattr(offload, name, getattr(offload, name))
    op, total = mod.replay(mod.REPLAY_VGG16)
    redo = {e.name: e for e in op.entries if e.recompute is not None}
    assert [t.names[0] for t in op.through[id(redo["conv1_2"])]] == [
        "conv1_1 (made again for conv1_2)"]
    assert "conv1_1" in redo and op.peak <= (12 << 30) - offload.BUDGET_MARGIN
    with open(mod.REPLAY_VGG16) as f:
        times = mod.json.load(f)["times"]
    first = offload.n_prologue(op.net)
    again = sum(sum(times[i] for i in e.recompute) for e in redo.values())
    assert total == pytest.approx(sum(times[first:]) + again, abs=1e-6)
    plain, _ = mod.replay(mod.REPLAY_VGG16, through=False)
    assert any(e.name == "conv1_2" and e.recompute is None for e in plain.entries)
