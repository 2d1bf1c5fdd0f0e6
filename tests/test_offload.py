"""Offload of feature maps (offload.py): the plan transformation, the prefetch points,
DYNAMIC's choice over fake layer times, the budget errors, the schema, the command line.

Everything here runs on the CPU: the plan and the schedule are pure Python.  The CUDA
side (copies, events, graph capture, bit-identical weights) is in test_offload_gpu.py.
"""
import functools
import os

import numpy as np
import pytest

from minicaffe import Net
from minicaffe.engine import offload
from minicaffe.core.config import RunConfig
from minicaffe.core.errors import ConfigError
from minicaffe.engine.plan import MemoryPlan
from minicaffe.proto import caffe_pb2
from repo_scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHAIN = """
name: "chain"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 16 dim: 16 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv1b" type: "Convolution" bottom: "conv1" top: "conv1b"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1b" type: "ReLU" bottom: "conv1b" top: "conv1b" }
layer { name: "pool1" type: "Pooling" bottom: "conv1b" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _net(text=CHAIN):
    return Net(text, phase=caffe_pb2.TRAIN)


def _synthetic(model, batch, shape):
    mod = load_script("benchmarks/gpu_step.py")
    return Net(mod.synthetic(os.path.join(ROOT, model), batch, shape), phase=caffe_pb2.TRAIN)


@pytest.fixture(scope="module")
def resnet():
    return _synthetic("models/resnet50/train_val.prototxt", 2, [3, 224, 224])


@pytest.fixture(scope="module")
def googlenet():
    return _synthetic("models/bvlc_googlenet/train_val.prototxt", 2, [3, 224, 224])


def _fake_times(net, conv=1e-3, other=1e-6):
    """Seconds per step: convolutions slow, everything else nearly free."""
    L = len(net.layers)
    t = [0.0] * (2 * L)
    for i, layer in enumerate(net.layers[offload.n_prologue(net):], offload.n_prologue(net)):
        f = conv if layer.type in offload.CONV_TYPES else other
        t[i], t[2 * L - 1 - i] = f, 2 * f
    return t


# -- invariants every offload plan must keep --------------------------------------------
def check_plan(op):
    """The schedule is safe: lives cover every use, copies come after the last write and
    before the first backward use, nothing alive at once shares memory, every buffer is
    offloaded once, inputs/outputs/losses never leave."""
    plan, net = op.plan, op.net
    L = len(net.layers)
    mems = [id(e.buf.mem) for e in op.entries]
    assert len(mems) == len(set(mems)), "a buffer offloaded twice"
    for e in op.entries:
        b = e.buf
        assert not b.pinned
        # the forward life covers every forward use, and may hold the place longer
        # (hide_copies) while the copy out runs, never into the backward life
        assert e.fwd.start == min(b.writes + b.reads) and e.fwd.end >= max(b.writes + b.reads)
        assert e.fwd.end == e.hold and e.d2h_after <= e.fwd.end < 2 * L
        if b.bwd_reads:
            assert e.fwd.end + 1 < e.prefetch
        if e.release is not None:
            assert e.release > e.fwd.end
        if b.bwd_reads:
            # (a recomputed map's producer may read it before its own readers do)
            assert e.bwd.start == e.prefetch and e.bwd.end == e.bwd_last >= max(b.bwd_reads)
            assert L <= e.prefetch <= e.bwd_first <= min(b.bwd_reads)
            assert e.prefetch > e.fwd.end + 1          # the buffer is off the device between
        else:
            assert e.bwd is None
    # a recomputed map: no copy, no slot; its producers' inputs are on the device when
    # it is made again (kept, back by then, or made again before it at the same step)
    by_mem = {id(e.buf.mem): e for e in op.entries}
    for e in op.entries:
        if e.recompute is None:
            continue
        assert e.release is None and e.bwd.start == e.bwd_first and e.fwd.end == e.fwd_end
        own = offload.recompute_layers(net, e.buf)
        assert e.recompute[-len(own):] == own and list(e.recompute) == sorted(e.recompute)
        r = e.bwd_first
        # the maps made on the way: dropped ones, not in use then, each in a place of
        # its own live right before step r only (Buffer.boundary)
        through = op.through.get(id(e), [])
        assert [t.mem for t in through] == offload.recompute_through(net, e)
        for t in through:
            x = by_mem[id(t.mem)]
            assert x.recompute is not None and not x.bwd.start <= r <= x.bwd.end
            assert t.boundary and t.start == t.end == r
        for m in offload.recompute_inputs(net, e):
            x = by_mem.get(id(m))
            if x is not None:
                assert x.bwd is not None and x.bwd.start <= r <= x.bwd.end, (e.name, x.name)
                assert x.bwd_first <= r
                if x.recompute is not None:
                    assert x.bwd_first < r or x.recompute[0] < e.recompute[0]
    bufs = plan.buffers
    for i, a in enumerate(bufs):
        assert a.offset + a.nbytes <= plan.arena_bytes
        for c in bufs[i + 1:]:
            if a.overlaps(c):
                assert a.offset + a.nbytes <= c.offset or c.offset + c.nbytes <= a.offset, \
                    (a.names, a.part, c.names, c.part)
    # the device->host copy is waited for before anything else takes its place
    for e in op.entries:
        if e.recompute is not None:
            continue                                   # no copy to wait for
        f = e.fwd
        for b in bufs:
            if b is not f and b.start > f.end and b.offset < f.offset + f.nbytes and \
                    f.offset < b.offset + b.nbytes:
                assert e.release is not None and e.release <= b.start


# -- the plan -----------------------------------------------------------------------------
def test_plan_records_writes_reads_and_backward_reads():
    net = _net()
    plan = MemoryPlan(net)
    ids = {n: i for i, n in enumerate(net.layer_names)}
    L = len(net.layers)
    conv1 = next(b for b in plan.buffers if b.kind == "data" and "conv1" in b.names)
    # conv1 writes it, relu1 rewrites it in place; relu1 and conv1b read it
    assert conv1.writes == [ids["conv1"], ids["relu1"]]
    assert sorted(conv1.reads) == [ids["relu1"], ids["conv1b"]]
    # backward: conv1b reads its bottom, relu1 its top (the same buffer, counted once)
    assert sorted(conv1.bwd_reads) == sorted({2 * L - 1 - ids["conv1b"], 2 * L - 1 - ids["relu1"]})


def test_none_changes_nothing():
    net = _net()
    op = offload.build(net, "NONE")
    base = MemoryPlan(net)
    assert op.entries == [] and op.peak == base.peak and op.plan.arena_bytes == base.arena_bytes


@pytest.mark.parametrize("policy", ["ALL", "CONV"])
def test_policies_split_feature_maps_safely(policy):
    net = _net()
    op = offload.build(net, policy)
    check_plan(op)
    none = offload.build(net, "NONE")
    assert op.peak < none.peak
    names = {e.name for e in op.entries}
    assert "data" not in names and "loss" not in names and "label" not in names
    if policy == "CONV":
        # the inputs of convolutions only (conv1's output, after relu1, is conv1b's input)
        assert names == {"conv1", "pool1"}
        assert all(e.conv_input for e in op.entries)
    else:
        assert {"conv1", "conv1b", "pool1", "conv2"} <= names
    # one host slot per copied buffer, none overlapping; none for a recomputed one
    copied = [e for e in op.entries if e.recompute is None]
    assert all(e.slot is None for e in op.entries if e.recompute is not None)
    slots = sorted((e.slot, e.slot + e.copy_bytes) for e in copied)
    assert all(a[1] <= b[0] for a, b in zip(slots, slots[1:]))
    assert op.host_bytes >= sum(e.copy_bytes for e in copied) == op.moved_bytes


def test_in_place_layers_offload_their_buffer_once_after_the_last_write():
    net = _net()
    op = offload.build(net, "ALL")
    ids = {n: i for i, n in enumerate(net.layer_names)}
    e = next(e for e in op.entries if e.name == "conv1")
    assert e.d2h_after == ids["relu1"]          # after relu1 rewrote it, not after conv1
    assert sum(1 for x in op.entries if x.buf.mem is net.blobs["conv1"].data_mem) == 1


def test_prefetch_follows_find_prefetch_layer():
    """While layer n runs backward, the nearest layer below it whose input left comes
    back; the search never passes a convolution (without hide_copies, which may move it
    earlier)."""
    net = _net()
    op = offload.build(net, "ALL", hide=False)
    L = len(net.layers)
    for e in op.entries:
        if e.bwd is None:
            continue
        n, _ = offload.step_layer(net, e.prefetch)
        m, _ = offload.step_layer(net, e.bwd_first)
        if e.on_demand:
            assert n == m
            continue
        assert n > m
        assert not any(net.layers[k].type in offload.CONV_TYPES for k in range(m + 1, n)), \
            (e.name, net.layer_names[n], net.layer_names[m])
    # pool1's output is read first by conv2's backward; relu2 and pool2 lie between conv2
    # and ip, so ip's backward... the nearest layer above conv2 with a fetch of its own
    pool1 = next(e for e in op.entries if e.name == "pool1")
    m, _ = offload.step_layer(net, pool1.bwd_first)
    assert net.layer_names[m] == "conv2"
    assert L <= pool1.prefetch < pool1.bwd_first


@pytest.mark.parametrize("policy", ["ALL", "CONV"])
def test_non_linear_nets(resnet, googlenet, policy):
    """Split, Concat, Eltwise: a buffer shared by split tops is one buffer, offloaded
    once, kept until its last forward consumer, back before its first backward one."""
    for net in (resnet, googlenet):
        op = offload.build(net, policy)
        check_plan(op)
        assert op.peak < offload.build(net, "NONE").peak
        assert op.peak >= offload.floor_bytes(op.plan)
        for e in op.entries:
            consumers = [i for i, bots in enumerate(net.bottom_vecs)
                         if any(b.data_mem is e.buf.mem for b in bots)]
            assert e.fwd_end >= max(consumers)
    kinds = {net.layers[i].type for net in (resnet, googlenet)
             for e in offload.build(net, "ALL").entries for i in e.buf.reads}
    assert {"Split", "Concat", "Eltwise"} & kinds


def test_offloaded_split_buffer_is_read_by_every_branch(resnet):
    op = offload.build(resnet, "ALL")
    split = [e for e in op.entries if any(resnet.layers[i].type == "Split" for i in e.buf.reads)]
    assert split
    for e in split:
        # the Split's tops share the bottom's data: every branch reads the same buffer
        readers = {resnet.layer_names[i] for i in e.buf.reads}
        assert len(readers) >= 2


# -- the timeline model and DYNAMIC ---------------------------------------------------------
def test_simulation_hides_copies_under_long_compute_only(monkeypatch):
    monkeypatch.setattr(offload, "RECOMPUTE", False)     # every map copied
    net = _net()
    op = offload.build(net, "ALL")
    first = offload.n_prologue(net)
    slow = _fake_times(net, conv=1.0, other=1.0)
    total, stall = offload.simulate(slow, op.entries, first)
    assert total == pytest.approx(sum(slow[first:])) and stall == pytest.approx(0)
    fast = _fake_times(net, conv=1e-9, other=1e-9)
    total, stall = offload.simulate(fast, op.entries, first)
    moved = sum(e.copy_bytes for e in op.entries) / offload.D2H_BYTES_PER_S
    assert total >= moved and stall > 0
    # placed waits are never earlier than the conservative ones
    lazy, _ = offload.simulate(fast, op.entries, first, lazy=True)
    assert lazy <= total + 1e-12


def test_dynamic_moves_nothing_when_the_net_fits():
    net = _net()
    none = offload.build(net, "NONE")
    op = offload.build(net, "DYNAMIC", none.peak, times=_fake_times(net))
    assert op.entries == [] and op.info["fits_without"]


def test_dynamic_fits_the_budget_with_copies_that_hide(resnet):
    net = resnet
    none = offload.build(net, "NONE")
    every = offload.build(net, "ALL")
    budget = (none.peak + every.peak) // 2
    slow = _fake_times(net, conv=1.0, other=1.0)         # every copy hides
    op = offload.build(net, "DYNAMIC", budget, times=slow)
    check_plan(op)
    assert op.peak <= budget
    assert 0 < len(op.entries) < len(every.entries)     # only as many as the budget needs
    assert op.info["exposed"] == 0
    assert op.info["total_s"] == pytest.approx(op.info["compute_s"], rel=1e-2)
    text = "\n".join(op.describe())
    assert "DYNAMIC" in text and "planned peak" in text and op.entries[0].name in text


def test_dynamic_prefers_buffers_whose_copies_hide(resnet):
    """With convolutions slow and everything else free, the copies that hide are those
    overlapping convolutions; DYNAMIC takes them before any that would stall."""
    net = resnet
    none = offload.build(net, "NONE")
    every = offload.build(net, "ALL")
    budget = none.peak - (none.peak - every.peak) // 4
    times = _fake_times(net, conv=5e-3, other=1e-9)
    op = offload.build(net, "DYNAMIC", budget, times=times)
    assert op.peak <= budget
    first = offload.n_prologue(net)
    compute = sum(times[first:])
    total, _ = offload.simulate(times, op.entries, first)
    assert total <= compute * (1 + offload.HIDE_SLACK * (len(op.entries) + 1)) or \
        op.info["exposed"] > 0
    # a tighter budget with copies that cannot hide: it still fits, and says so
    tiny = _fake_times(net, conv=1e-9, other=1e-9)
    op2 = offload.build(net, "DYNAMIC", every.peak + (none.peak - every.peak) // 10, times=tiny)
    assert op2.peak <= every.peak + (none.peak - every.peak) // 10
    assert op2.info["exposed"] > 0 and op2.info["total_s"] > sum(tiny[first:])
    assert "do not hide" in "\n".join(op2.describe())


def test_estimated_times_rank_convolutions_above_activations():
    net = _net()
    t = offload.estimate_times(net)
    ids = {n: i for i, n in enumerate(net.layer_names)}
    L = len(net.layers)
    assert t[ids["conv1b"]] > 0 and t[2 * L - 1 - ids["conv1b"]] == 2 * t[ids["conv1b"]]
    assert t[ids["data"]] == 0


# -- budgets ------------------------------------------------------------------------------------
def test_budget_too_small_even_for_all_is_one_line_naming_the_layer():
    net = _net()
    every = offload.build(net, "ALL")
    # under the floor no plan fits (above it, maps fetched on demand may make ALL fit)
    low = offload.floor_bytes(every.plan) - 1
    for policy in ("ALL", "DYNAMIC"):
        with pytest.raises(offload.BudgetError) as err:
            offload.build(net, policy, low, times=_fake_times(net))
        msg = str(err.value)
        assert "\n" not in msg and "even with offload policy ALL" in msg
        named = [n for n in net.layer_names if f"layer '{n}'" in msg]
        assert len(named) == 1
        need = int(msg.split(" needs ")[1].split(" bytes")[0])
        assert need > low


def test_budget_without_offload_points_at_offload():
    net = _net()
    none = offload.build(net, "NONE")
    with pytest.raises(offload.BudgetError, match="without offload.*--offload"):
        offload.build(net, "NONE", none.peak - 1)
    assert offload.build(net, "NONE", none.peak).peak == none.peak


def test_floor_is_a_lower_bound(resnet):
    for policy in ("NONE", "ALL", "CONV"):
        op = offload.build(resnet, policy)
        assert offload.floor_bytes(op.plan) <= op.peak


# -- settings, schema, command line ------------------------------------------------------------
def test_settings_read_every_field_and_the_override():
    p = caffe_pb2.NetParameter()
    assert offload.settings(p) == ("NONE", 0)
    p.offload_param.policy = caffe_pb2.OffloadParameter.CONV
    p.offload_param.gpu_memory_budget = 5 << 30
    assert offload.settings(p) == ("CONV", 5 << 30)
    assert offload.settings(p, RunConfig()) == ("CONV", 5 << 30)
    assert offload.settings(p, RunConfig(offload_policy="dynamic")) == ("DYNAMIC", 5 << 30)
    assert offload.settings(p, RunConfig(offload_budget=123)) == ("CONV", 123)
    with pytest.raises(ConfigError, match="unknown offload policy 'sometimes'"):
        RunConfig(offload_policy="sometimes")
    with pytest.raises(ConfigError, match="gpu_mem_limit"):
        RunConfig(offload_budget=-1)


def test_offload_in_cpu_mode_warns_and_training_goes_on(monkeypatch):
    from google.protobuf import text_format
    from minicaffe.core import log
    from minicaffe.solvers import get_solver
    said = []
    monkeypatch.setattr(log, "warning", lambda msg, *a: said.append(msg % a))
    s = caffe_pb2.SolverParameter()
    text_format.Merge(CHAIN + "offload_param { policy: ALL }", s.net_param)
    s.base_lr, s.lr_policy, s.display, s.momentum = 0.01, "fixed", 0, 0.9
    solver = get_solver(s)
    assert len(said) == 1 and "policy ALL" in said[0] and "CPU mode" in said[0]
    before = [b.data.copy() for b in solver.net.learnable_params]
    solver.step(2)
    assert solver.iter == 2
    assert any((a != b.data).any() for a, b in zip(before, solver.net.learnable_params))


def test_memory_report_rows():
    net = _net()
    every = offload.build(net, "ALL")
    rows, summary = offload.memory_rows(net, offload.POLICIES, every.peak + 1,
                                        times=_fake_times(net))
    assert [r["layer"] for r in rows] == net.layer_names
    assert set(summary) == set(offload.POLICIES)
    assert summary["ALL"]["peak"] == every.peak and summary["ALL"]["fits"]
    assert summary["NONE"]["peak"] > every.peak and "over" in summary["NONE"]
    assert summary["DYNAMIC"]["peak"] <= every.peak + 1
    conv1 = rows[net.layer_names.index("conv1")]
    assert conv1["ALL"]["offloaded"] and not conv1["NONE"]["offloaded"]
    assert conv1["ALL"]["live"] <= conv1["NONE"]["live"]
    lines = offload.format_memory_report(net, rows, summary, every.peak + 1)
    assert any(l.startswith("ALL") and "planned peak" in l for l in lines)
    # no budget: DYNAMIC has nothing to fit
    _, summary = offload.memory_rows(net, ("NONE", "DYNAMIC"))
    assert "needs a budget" in summary["DYNAMIC"]["error"]


def test_memory_command(cli, tmp_path):
    (tmp_path / "net.prototxt").write_text(CHAIN)
    rc, out, err = cli("memory", "--model", "net.prototxt", "--offload", "NONE")
    assert rc == 0, err
    for p in offload.POLICIES:
        assert any(l.startswith(p + " ") for l in out.splitlines()), out
    assert "conv1b" in out and "offload_param" not in err
    rc, out, err = cli("memory", "--model", "net.prototxt", "--offload", "conv",
                       "--gpu_mem_limit", "1000")
    assert rc == 0, err
    peaks = [l for l in out.splitlines() if "planned peak" in l and ":" in l[:9]]
    assert [l.split(":")[0].strip() for l in peaks] == ["NONE", "CONV"]
    assert "over the budget" in out and "even with offload policy CONV" in out
    rc, out, err = cli("memory", "--model", "net.prototxt", "--offload", "most")
    assert rc == 1 and err.strip().splitlines()[-1] == \
        "minicaffe: error: unknown offload policy 'most' (NONE, ALL, CONV or DYNAMIC)"
    assert offload.settings(caffe_pb2.NetParameter()) == ("NONE", 0)   # flags hold per command


def test_memory_command_on_a_model_with_data_layers(cli):
    rc, out, err = cli("memory", "--model", os.path.join(ROOT, "models/lenet/train_val.prototxt"),
                       "--batch", "64", "--input_shape", "1,28,28", "--offload", "ALL")
    assert rc == 0, err
    assert "conv1" in out and any(l.startswith("ALL ") for l in out.splitlines())


def test_train_flag_in_cpu_mode_warns_and_trains(cli, tmp_path):
    (tmp_path / "net.prototxt").write_text(CHAIN)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 2\ndisplay: 1\n'
        'snapshot_after_train: false\nsolver_mode: CPU\n')
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--offload", "ALL",
                       "--gpu_mem_limit", "100000000")
    assert rc == 0, err
    warn = [l for l in err.splitlines() if l.startswith("W") and "offload_param" in l]
    assert len(warn) == 1 and "CPU mode" in warn[0]
    assert "Optimization Done." in err


# -- the CUDA side on a fake device ---------------------------------------------------------
class _FakeDev(np.ndarray):
    """A "device" array: host memory with CuPy's ``.data.ptr`` and ``.set``."""

    @property
    def data(self):
        import types
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def set(self, a, stream=None):
        self[...] = a

    def get(self, out=None, stream=None):
        if out is None:
            return np.array(self)
        out[...] = self
        return out


class _FakeStream:
    """A stream whose work runs only when something waits for it ("late": the latest
    the events allow, so a missing wait shows up as a copy of overwritten data) or as
    soon as it is queued ("early")."""
    registry = {}

    def __init__(self, non_blocking=True, early=False, compute=False):
        self.ops, self.done = [], 0
        self.early, self.compute = early, compute
        self.ptr = id(self)
        _FakeStream.registry[self.ptr] = self

    def enqueue(self, fn):
        self.ops.append(fn)
        if self.compute or self.early:
            self.flush(len(self.ops))

    def flush(self, upto):
        while self.done < upto:
            op = self.ops[self.done]
            self.done += 1
            op()

    def wait_event(self, ev):
        src, pos = ev.stream, ev.pos
        if src is None or src is self:
            return
        self.enqueue(lambda: src.flush(pos))

    def record(self, ev=None):
        ev = ev or _FakeEvent()
        ev.record(self)
        return ev

    def synchronize(self):
        self.flush(len(self.ops))

    def is_capturing(self):
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeEvent:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.stream, self.pos = None, 0

    def record(self, stream=None):
        self.stream, self.pos = stream, len(stream.ops)


def _fake_cupy(early):
    import ctypes
    import types
    hosts = {}

    def host_alloc(n, flags):
        buf = np.zeros(n, np.uint8)
        hosts[buf.ctypes.data] = buf
        return buf.ctypes.data

    def memcpy(dst, src, n, kind, stream_ptr):
        _FakeStream.registry[stream_ptr].enqueue(lambda: ctypes.memmove(dst, src, n))

    rt = types.SimpleNamespace(hostAlloc=host_alloc, freeHost=lambda p: hosts.pop(p, None),
                               hostAllocPortable=1, memcpyAsync=memcpy,
                               memGetInfo=lambda: (1 << 40, 1 << 40))
    compute = _FakeStream(compute=True)

    def stream(non_blocking=True):
        return _FakeStream(early=early)
    stream.null = _FakeStream(compute=True)     # the legacy default stream (the arena's)
    cuda = types.SimpleNamespace(
        Stream=stream, Event=_FakeEvent,
        runtime=rt, get_current_stream=lambda: compute,
        memory=types.SimpleNamespace(OutOfMemoryError=MemoryError))
    return types.SimpleNamespace(cuda=cuda, empty=lambda n, dtype: np.zeros(n, dtype).view(
        _FakeDev)), compute


def _value(b, step):
    return float(1000 * (id(b) % 997) + step + 1)


def _run_on_fake_device(monkeypatch, net, op, early, iterations=2):
    """Drive an Offloader through whole iterations: each step writes the data its layer
    writes (a value naming the buffer and the step) and checks the data it reads, and
    diffs write junk where they are placed -- so a copy that reads a place already
    reused, or a read of a buffer that has not come back, fails."""
    from minicaffe.core import backend, context
    fake, compute = _fake_cupy(early)
    monkeypatch.setattr(backend, "cp", fake)
    # streams of this fake only: a kept stream of an earlier test may hold copies that
    # never ran (a test that stopped mid-iteration), into memory freed since
    monkeypatch.setattr(context, "_kept_streams", {})
    op.plan.apply()
    import types
    step = types.SimpleNamespace(net=net, plan=op.plan,
                                 solver=types.SimpleNamespace(history_flat=[]))
    off = offload.Offloader(step, op, op.policy, 0)
    off.attach()
    L = len(net.layers)
    first = offload.n_prologue(net)
    data = [e.buf for e in op.entries] + [b for b in op.plan.buffers
                                          if b.kind == "data" and b.part is None]
    # diffs and cuDNN workspaces (engine/plan.py) write junk where they are placed
    diffs = [b for b in op.plan.buffers if b.kind in ("diff", "workspace")]
    # a recomputed map's forward place holds nothing after its last forward reader
    redone = [e for e in op.entries if e.recompute is not None]
    checked = 0
    for _ in range(iterations):
        latest = {}

        def run(s, again=False):
            """Step s; ``again``: forward step s run again by a recompute (its cuDNN
            workspace is the recompute's own place, not the forward step's)."""
            nonlocal checked
            for b in diffs:
                if (b.part == "recompute" and b.mem.layer is net.layers[s]) if again else \
                        b.start == s:
                    op.plan.arena[b.offset:b.offset + b.nbytes] = 0xEE
            for b in data:
                if s in b.reads or s in b.bwd_reads:
                    v = b.mem.device_array
                    assert v is not None, (b.names, s)
                    got = {float(v[0]), float(v[b.mem.size // 2]), float(v[b.mem.size - 1])}
                    assert got == {latest[id(b)]}, (b.names, s, got, latest[id(b)])
                    checked += 1
            for b in data:
                if s in b.writes:
                    latest[id(b)] = _value(b, s)
                    b.mem.device_array[:b.mem.size] = latest[id(b)]
            for e in redone:
                if s == e.fwd.end and not again:   # its place is free: spoil it
                    op.plan.arena[e.fwd.offset:e.fwd.offset + e.fwd.nbytes] = 0xEE

        # a recompute runs its layers' forward again: here, the same checked reads and
        # writes as their forward step (the value a step writes names the step)
        off.forward_again = lambda i: run(i, again=True)
        for i in range(first):       # the data layers, before the body
            run(i)
        off.begin()
        for i in range(first, L):
            net.run_hooks("before_forward", i)
            run(i)
            net.run_hooks("after_forward", i)
        for i in range(L - 1, -1, -1):
            net.run_hooks("before_backward", i)
            run(2 * L - 1 - i)
            net.run_hooks("after_backward", i)
        off.end()
        for e in op.entries:     # parked: the host side holds the last forward value
            m = e.buf.mem
            assert m.device_array is None
            if e.recompute is None:   # (a recomputed map is transient, as a diff)
                assert (np.asarray(m.cpu_data()) == latest[id(e.buf)]).all(), e.name
    off.detach()
    return checked


@pytest.mark.parametrize("early", [False, True], ids=["late-copies", "early-copies"])
@pytest.mark.parametrize("policy", ["ALL", "CONV", "DYNAMIC"])
def test_offloader_moves_the_right_bytes_at_the_right_time(monkeypatch, googlenet, policy, early):
    net = googlenet if policy != "CONV" else _net()
    budget = 0
    if policy == "DYNAMIC":
        none, every = offload.build(net, "NONE"), offload.build(net, "ALL")
        budget = (none.peak + every.peak) // 2
    op = offload.build(net, policy, budget, times=_fake_times(net))
    assert op.entries
    assert _run_on_fake_device(monkeypatch, net, op, early) > len(op.entries)


def test_fake_device_catches_a_missing_wait(monkeypatch):
    """The harness is not blind: drop the waits before reuse and a copy reads junk."""
    net = _net()
    op = offload.build(net, "ALL")
    assert any(e.release is not None for e in op.entries)
    for e in op.entries:
        e.release = None
    with pytest.raises(AssertionError):
        _run_on_fake_device(monkeypatch, net, op, early=False)


# -- round 3: a second device->host stream, copies in pieces, DYNAMIC keeping maps --------
def _entry(d2h_after, nbytes, lane=0, bwd_first=None, prefetch=None):
    import types
    return types.SimpleNamespace(d2h_after=d2h_after, copy_bytes=nbytes, lane=lane,
                                 hold=d2h_after, release=None, bwd_first=bwd_first,
                                 prefetch=prefetch)


def test_two_device_to_host_streams_share_the_link_in_the_model():
    """One stream is FIFO at the full rate; two busy streams share it: a small copy on
    the second stream ends long before the large one queued ahead of it on the first
    would have let it, and the total bytes still take the same time."""
    rate = 1e9
    big, small = 8e8, 1e8                   # 0.8 s and 0.1 s alone
    fifo = offload._OutPipe(rate)
    fifo.add("big", 0.0, big)
    fifo.add("small", 0.0, small)
    assert fifo.end_of("small") == pytest.approx(0.9)
    two = offload._OutPipe(rate)
    two.add("big", 0.0, big, lane=0)
    two.add("small", 0.0, small, lane=1)
    assert two.end_of("small") == pytest.approx(0.2)      # half the link while both run
    assert two.end_of("big") == pytest.approx(0.9)         # the link never idles
    # the timeline model: the compute stream waits for the small map's copy at step 2
    times = [0.0, 0.0, 0.1, 0.1]
    a, b = _entry(0, big), _entry(1, small)
    b.release = 2
    one_lane = offload.simulate(times, [a, b], lazy=True)[0]
    b.lane = 1
    assert offload.simulate(times, [a, b], lazy=True)[0] < one_lane


def test_lanes_put_the_late_small_maps_beside_the_early_large_ones():
    """On VGG's shape (large maps first, needed last) the model picks the second stream
    for the maps needed first in backward, and is shorter than one FIFO stream;
    LANES = 1 keeps every copy on one stream."""
    saved = offload.RECOMPUTE
    offload.RECOMPUTE = False        # every map copied (a recomputed one takes no stream)
    try:
        net = _synthetic("models/vgg16/train_val.prototxt", 64, [3, 32, 32])
        op = offload.build(net, "ALL", times=_fake_times(net, conv=1e-4, other=1e-6))
    finally:
        offload.RECOMPUTE = saved
    times = _fake_times(net, conv=1e-4, other=1e-6)      # copies long against compute
    first = offload.n_prologue(net)
    check_plan(op)                                     # lives lengthened (hide_copies)
    lanes = {e.name: e.lane for e in op.entries}
    two = offload.simulate(times, op.entries, first)[0]
    assert op.info["lanes"] == sum(lanes.values()) > 0
    assert lanes["conv5_3"] == 1 and lanes["conv1_1"] == 0
    assert "conv5_3: " in "\n".join(l for l in op.describe() if "(second stream)" in l)
    for e in op.entries:
        e.lane = 0
    assert offload.simulate(times, op.entries, first)[0] > two
    saved = offload.LANES
    try:
        offload.LANES = 1
        assert offload.choose_lanes(op.entries, times, first) == 0
        assert all(e.lane == 0 for e in op.entries)
    finally:
        offload.LANES = saved


@pytest.mark.parametrize("early", [False, True], ids=["late-copies", "early-copies"])
def test_second_stream_and_pieces_on_the_fake_device(monkeypatch, googlenet, early):
    """Every read after its copy with copies out on both device->host streams (every
    other map on the second) and each copy cut into many pieces: a missing wait on
    either stream shows up as a read of junk."""
    monkeypatch.setattr(offload, "COPY_CHUNK", 4096)
    net = googlenet
    op = offload.build(net, "ALL", times=_fake_times(net))
    for k, e in enumerate(op.entries):
        e.lane = k % 2
    assert _run_on_fake_device(monkeypatch, net, op, early) > len(op.entries)


def test_fake_device_catches_a_missing_wait_on_the_second_stream(monkeypatch):
    net = _net()
    op = offload.build(net, "ALL")
    for e in op.entries:
        e.lane = 1
        e.release = None
    with pytest.raises(AssertionError):
        _run_on_fake_device(monkeypatch, net, op, early=False)


def test_dynamic_keeps_on_the_device_what_fits_the_budget(resnet):
    """Under a budget, DYNAMIC's maps whose stretch off the device fits stay there: fewer
    copies, the plan within the budget, the schedule safe."""
    net = resnet
    every = offload.build(net, "ALL")
    none = offload.build(net, "NONE")
    budget = (none.peak + every.peak) // 2
    times = _fake_times(net, conv=1e-3, other=1e-5)
    op = offload.build(net, "DYNAMIC", budget, times=times)
    check_plan(op)
    assert op.peak <= budget
    plain = offload.build(net, "DYNAMIC", budget, times=times, hide=False)
    assert op.info.get("kept", 0) >= 0
    assert op.moved_bytes <= plain.moved_bytes
    # keep_on_device itself: with room for everything, every map stays
    from minicaffe.engine.plan import MemoryPlan
    plan = MemoryPlan(net, train=True)
    entries = offload.candidates(plan, "ALL")
    kept = offload.keep_on_device(plan, entries, times, none.peak + (1 << 30))
    assert set(kept) == {e.name for e in entries}
    assert offload.keep_on_device(plan, entries, times, every.peak // 2) == []


def test_replan_lets_the_old_arena_go_before_the_new_one_is_made(monkeypatch):
    """Offload's re-plan after its timed iteration (``Offloader.profile`` ->
    ``GpuStep.replan``): when the new arena is allocated, nothing holds the old one any
    more (no SyncedMemory, layer, entry or plan), so the device never holds both."""
    import gc
    import types
    import weakref
    from minicaffe.core import backend, context
    from minicaffe.engine.step import GpuStep
    fake, compute = _fake_cupy(early=False)
    fake.cuda.get_elapsed_time = lambda a, b: 1.0
    monkeypatch.setattr(backend, "cp", fake)
    monkeypatch.setattr(context, "_kept_streams", {})       # (see _run_on_fake_device)
    net = _net()
    # convolutions with workspaces, recomputed: a recompute's workspace place (in the
    # arena) must not outlive its plan either
    from test_offload_budget import _two_fake_convs
    _two_fake_convs(net)
    monkeypatch.setattr(offload, "choose_recompute",
                        functools.partial(offload.choose_recompute, force=True))
    op = offload.build(net, "ALL", times=_fake_times(net))
    assert any(op.redo_ws.values())
    op.plan.apply()
    old = weakref.ref(op.plan.arena)
    alive_at_alloc = []
    real = backend.alloc_arena

    def alloc(n):
        gc.collect()
        alive_at_alloc.append(old() is not None)
        return real(n)
    monkeypatch.setattr(backend, "alloc_arena", alloc)
    step = types.SimpleNamespace(net=net, plan=op.plan, input_places={}, first_body=0,
                                 solver=types.SimpleNamespace(history_flat=[]))
    step.replan = lambda plan: GpuStep.replan(step, plan)
    off = offload.Offloader(step, op, "ALL", 0)
    off.forward_again = lambda i: None          # (no layer runs here: the arenas matter)
    off.attach()
    L = len(net.layers)
    first = offload.n_prologue(net)

    def body():
        off.begin()
        for i in range(first, L):
            net.run_hooks("before_forward", i)
            net.run_hooks("after_forward", i)
        for i in range(L - 1, -1, -1):
            net.run_hooks("before_backward", i)
            net.run_hooks("after_backward", i)
        off.end()
    body()
    del op
    off.profile(body)
    off.detach()
    assert alive_at_alloc == [False]
    assert step.plan.arena is not None
