"""The device memory budget a user can say (``--gpu_mem_limit``, RunConfig.offload_budget):
sizes with units, a share of the device, ``auto``; a budget alone means DYNAMIC; a budget
below what the net needs is one line naming the layer and the bytes, before anything runs
(on the fake device of test_offload.py).  CPU only."""
import types

import pytest

from minicaffe import Net
from minicaffe.core import backend, config, context
from minicaffe.core.config import RunConfig, budget_bytes, parse_gpu_mem_limit
from minicaffe.core.errors import ConfigError
from minicaffe.engine import offload
from minicaffe.proto import caffe_pb2

from test_offload import CHAIN, _fake_cupy, _net, _synthetic

GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def resnet():
    return _synthetic("models/resnet50/train_val.prototxt", 2, [3, 224, 224])


@pytest.mark.parametrize("text,value", [
    ("12GiB", 12 * GiB), ("12gib", 12 * GiB), ("12G", 12 * GiB), ("12000MiB", 12000 * MiB),
    ("12GB", 12 * 10 ** 9), ("1.5GiB", 3 * GiB // 2), ("512KiB", 512 << 10), ("2TB", 2 * 10 ** 12),
    ("12000000000", 12000000000), ("12e9", 12 * 10 ** 9), ("0", 0), ("4096B", 4096),
    (12000000000, 12000000000), (" 12 GiB ", 12 * GiB),
    ("auto", "auto"), ("AUTO", "auto"), ("60%", "60%"), ("12.5%", "12.5%"), ("100%", "100%"),
])
def test_gpu_mem_limit_spellings(text, value):
    assert parse_gpu_mem_limit(text) == value
    assert RunConfig(offload_budget=text).offload_budget == value


@pytest.mark.parametrize("text,words", [
    ("0.6", "a share of the device is written 60%"), ("-1", "at least 0 bytes"),
    ("12 parsecs", "give a size like 12GiB"), ("GiB", "give a size like 12GiB"),
    ("", "give a size like 12GiB"), ("150%", "at most 100%"), ("0%", "above 0%"),
    ("lots%", "give a size like 12GiB"), ("nan", "give a size like 12GiB"),
])
def test_gpu_mem_limit_mistakes_name_the_flag(text, words):
    with pytest.raises(ConfigError, match="--gpu_mem_limit") as e:
        parse_gpu_mem_limit(text)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_auto_and_shares_resolve_against_the_device():
    total = 80 * GiB
    margin = int(config.AUTO_MARGIN_SHARE * total)
    assert budget_bytes("auto", free=70 * GiB, total=total, held=2 * GiB) == 72 * GiB - margin
    # a small device: the margin is at least AUTO_MARGIN_MIN
    assert budget_bytes("auto", free=2 * GiB, total=4 * GiB) == 2 * GiB - config.AUTO_MARGIN_MIN
    assert budget_bytes("50%", free=1, total=total) == 40 * GiB
    assert budget_bytes(123, free=1, total=total) == 123


def test_a_budget_alone_means_dynamic():
    p = caffe_pb2.NetParameter()
    assert offload.settings(p, RunConfig(offload_budget="12GiB")) == ("DYNAMIC", 12 * GiB)
    assert offload.settings(p, RunConfig(offload_budget="auto")) == ("DYNAMIC", "auto")
    # a policy named anywhere is kept: NONE with a budget still refuses a net too large
    assert offload.settings(p, RunConfig(offload_policy="NONE", offload_budget=5)) == ("NONE", 5)
    p.offload_param.policy = caffe_pb2.OffloadParameter.NONE
    assert offload.settings(p, RunConfig(offload_budget=5)) == ("NONE", 5)
    p.offload_param.gpu_memory_budget = 7
    assert offload.settings(p) == ("NONE", 7)
    q = caffe_pb2.NetParameter()
    q.offload_param.gpu_memory_budget = 7
    assert offload.settings(q) == ("DYNAMIC", 7)


def test_auto_needs_a_device_to_read():
    assert offload.resolve_budget(0) == 0 and offload.resolve_budget(5) == 5
    with pytest.raises(ConfigError, match="--gpu_mem_limit auto reads the GPU's memory"):
        offload.resolve_budget("auto")


# -- the command line --------------------------------------------------------------------------
def test_memory_command_takes_units(cli, tmp_path):
    (tmp_path / "net.prototxt").write_text(CHAIN)
    rc, out, err = cli("memory", "--model", "net.prototxt", "--offload", "ALL",
                       "--gpu_mem_limit", "1KiB")
    assert rc == 0, err
    assert "budget: 0.00 GiB" in out and "over the budget" in out
    rc, out, err = cli("memory", "--model", "net.prototxt", "--gpu_mem_limit", "1GiB")
    assert rc == 0, err
    assert "budget: 1.00 GiB" in out
    # a budget alone: NONE and DYNAMIC are shown, DYNAMIC fits
    assert [l.split(":")[0].strip() for l in out.splitlines() if "planned peak" in l
            and ":" in l[:9]] == ["NONE", "DYNAMIC"]


@pytest.mark.parametrize("args,words", [
    (("memory", "--model", "net.prototxt", "--gpu_mem_limit", "auto"),
     "--gpu_mem_limit auto reads the GPU's memory: it needs GPU mode"),
    (("memory", "--model", "net.prototxt", "--gpu_mem_limit", "0.6"),
     "--gpu_mem_limit '0.6': a number alone is bytes"),
    (("bench", "--model", "net.prototxt", "--gpu_mem_limit", "12 parsecs"),
     "--gpu_mem_limit '12 parsecs': give a size like 12GiB"),
    (("time", "--model", "net.prototxt", "--gpu_mem_limit", "1GiB"),
     "--gpu_mem_limit is not a flag of 'time'"),
])
def test_budget_mistakes_are_one_line(cli, tmp_path, args, words):
    (tmp_path / "net.prototxt").write_text(CHAIN)
    rc, out, err = cli(*args)
    lines = [l for l in err.splitlines() if l.startswith("minicaffe: error:")]
    assert rc == 1 and len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err


# -- below the floor on the fake device: one line before anything runs ---------------------
def _step_on_fake_device(monkeypatch, net_config, free, total):
    fake, _ = _fake_cupy(early=False)
    fake.cuda.runtime.memGetInfo = lambda: (free, total)
    monkeypatch.setattr(backend, "cp", fake)
    monkeypatch.setattr(context, "_kept_streams", {})       # this fake's streams only
    monkeypatch.setattr(context, "is_gpu", lambda: True)
    monkeypatch.setattr(backend, "used_gpu_bytes", lambda: 0)
    net = Net(CHAIN, phase=caffe_pb2.TRAIN, config=net_config)
    return types.SimpleNamespace(net=net, plan=None,
                                 solver=types.SimpleNamespace(history_flat=[]))


@pytest.mark.parametrize("budget", ["64KiB", "auto"])
def test_budget_below_the_floor_is_one_line_naming_layer_and_bytes(monkeypatch, budget):
    step = _step_on_fake_device(monkeypatch, RunConfig(offload_policy="ALL",
                                                       offload_budget=budget),
                                free=config.AUTO_MARGIN_MIN + (64 << 10), total=1 << 30)
    with pytest.raises(offload.BudgetError) as e:
        offload.Offloader.for_step(step)
    msg = str(e.value)
    assert "\n" not in msg and "even with offload policy ALL" in msg
    named = [n for n in step.net.layer_names if f"layer '{n}'" in msg]
    assert len(named) == 1
    need = int(msg.split(" needs ")[1].split(" bytes")[0])
    assert need > 64 << 10
    assert step.plan is None          # refused before any plan was applied


def test_auto_budget_between_all_and_none_trains_under_dynamic(monkeypatch):
    net = _net()
    none, every = offload.build(net, "NONE"), offload.build(net, "ALL")
    target = (none.peak + every.peak) // 2
    step = _step_on_fake_device(monkeypatch, RunConfig(offload_budget="auto"),
                                free=target + config.AUTO_MARGIN_MIN, total=1 << 30)
    off = offload.Offloader.for_step(step)
    assert off is not None and off.policy == "DYNAMIC" and off.budget == target
    assert off.pending_profile and step.plan.peak <= every.peak   # ALL until profiled
    off.detach()


def test_bench_takes_the_offload_flags(cli, tmp_path):
    (tmp_path / "net.prototxt").write_text(CHAIN)
    rc, out, err = cli("bench", "--model", "net.prototxt", "--offload", "ALL", "--gpu_mem_limit",
                       "1GiB", "--iterations", "1", "--repeats", "1", "--warmup", "0")
    assert rc == 0, err
    warn = [l for l in err.splitlines() if l.startswith("W") and "offload_param" in l]
    assert len(warn) == 1 and "policy ALL" in warn[0] and "CPU mode" in warn[0]
    assert "chain" in out


# -- what the floor is made of (``minicaffe memory``) ---------------------------------------
def test_floor_parts_add_up(resnet):
    for net in (_net(), resnet):
        for policy in ("NONE", "ALL"):
            plan = offload.build(net, policy, history_sets=2).plan
            f = offload.floor_parts(plan)
            side = sum(f[k] for k in ("params", "diffs", "history", "scratch", "state",
                                      "cublas"))
            assert side == plan.side_bytes and f["history"] == 2 * f["params"] > 0
            arena = f["workspace"] + sum(v for key in ("maps", "map_diffs", "kept")
                                         for _, v in f[key])
            assert f["total"] == side + arena == offload.floor_bytes(plan) <= plan.peak
            assert f["layer"] in net.layer_names and f["direction"] in ("forward", "backward")
    # the chain's worst step is a convolution's backward: its input, its output's diff and
    # its input's diff at once
    f = offload.floor_parts(offload.build(_net(), "ALL").plan)
    assert f["maps"] and f["map_diffs"]


def test_memory_command_shows_the_floor(cli, tmp_path):
    (tmp_path / "net.prototxt").write_text(CHAIN)
    rc, out, err = cli("memory", "--model", "net.prototxt", "--offload", "ALL")
    assert rc == 0, err
    lines = out.splitlines()
    k = next(i for i, l in enumerate(lines) if l.startswith("floor under any offload policy"))
    f = offload.floor_parts(offload.build(_net(), "ALL").plan)
    assert f"{f['total'] / MiB:.2f} MiB, at layer '{f['layer']}' ({f['direction']})" in lines[k]
    block = "\n".join(lines[k:k + 7])
    for words in ("parameters", "their diffs", "solver history", "cuDNN workspace", "scratch",
                  "layer state", "feature maps it reads or writes", "activation diffs alive",
                  "inputs, outputs and losses"):
        assert words in block, block


# -- the timeline (benchmarks/offload.py) on the fake device ----------------------------------
def test_timeline_records_every_step_and_copy_on_the_fake_device(monkeypatch):
    import itertools
    from test_offload import _FakeEvent, _run_on_fake_device
    clock = itertools.count()
    real_record = _FakeEvent.record

    def record(self, stream=None):
        real_record(self, stream)
        self.t = float(next(clock))
    monkeypatch.setattr(_FakeEvent, "record", record)
    monkeypatch.setattr(backend, "elapsed_ms", lambda a, b: b.t - a.t)
    net = _net()
    op = offload.build(net, "ALL")
    tls = []
    real_init = offload.Offloader.__init__

    def init(self, *a, **k):           # a timeline on the net the harness drives
        real_init(self, *a, **k)
        tl = offload.Timeline(types.SimpleNamespace(net=net, offload=self))
        net._offload_timeline = tl
        tls.append(tl)
    monkeypatch.setattr(offload.Offloader, "__init__", init)
    _run_on_fake_device(monkeypatch, net, op, early=False, iterations=1)
    net._offload_timeline = None
    tl = tls[0]
    tl.read(tl.copies[0][3])
    L, first = len(net.layers), offload.n_prologue(net)
    rows = tl.rows()
    assert [r["step"] for r in rows] == list(range(first, 2 * L))
    assert [r["layer"] for r in rows[:L - first]] == net.layer_names[first:]
    outs = [c for c in tl.copy_times if c[0] == "out"]
    ins = [c for c in tl.copy_times if c[0] == "in"]
    redo = [c for c in tl.copy_times if c[0] == "redo"]
    copied = [e for e in op.entries if e.recompute is None]
    assert redo, "the chain net recomputes some map (choose_recompute)"
    assert sorted(e.name for _, e, *_ in outs) == sorted(e.name for e in copied)
    assert sorted(e.name for _, e, *_ in ins) == sorted(e.name for e in copied
                                                       if e.bwd is not None)
    assert sorted(e.name for _, e, *_ in redo) == sorted(e.name for e in op.entries
                                                        if e.recompute is not None)
    for k, e, s, a, b in tl.copy_times:     # issued where the plan says
        assert s == {"out": e.d2h_after, "in": e.prefetch, "redo": e.bwd_first}[k] and b > a
    assert sum(r["redo"] for r in rows) == sum(b - a for *_, a, b in redo)
    sm = tl.summary()
    assert sm["out_bytes"] == op.moved_bytes and sm["in_bytes"] == op.returned_bytes
    assert sm["compute"] == sum(r["ms"] for r in rows) and sm["model"] > 0
    assert sm["recompute"] == sum(b - a for *_, a, b in redo)
    d = tl.as_dict()
    lines = offload.timeline_lines(d["rows"], d["summary"], d["copies"], "chain ALL")
    assert lines[0].startswith("timeline of chain ALL")
    assert sum(1 for l in lines if l.startswith("    ")) == len(tl.copy_times)


def test_timeline_waits_are_the_copies_compute_stood_still_for():
    """``rows()`` charges a step with the time from the previous step's end to the end of
    the copies it waited for (no more than its own start)."""
    net = _net()
    op = offload.build(net, "ALL")
    e = next(x for x in op.entries if x.release is not None)
    r = e.release
    off = types.SimpleNamespace(table=op.tables(), oplan=op)
    tl = offload.Timeline.__new__(offload.Timeline)
    tl.net, tl.step = net, types.SimpleNamespace(offload=off)
    tl.steps = {r - 1: (0.0, 1.0), r: (5.0, 6.0)}
    tl.copy_times = [("out", e, e.d2h_after, 0.5, 4.0)]
    rows = {x["step"]: x for x in tl.rows()}
    assert rows[r]["wait"] == pytest.approx(3.0) and rows[r]["waited_for"] == [f"out {e.name}"]
    assert rows[r - 1]["wait"] == 0 and rows[r - 1]["out"] == pytest.approx(0.5)
    tl.copy_times = [("out", e, e.d2h_after, 0.5, 0.9)]     # done in time: no wait
    assert {x["step"]: x for x in tl.rows()}[r]["wait"] == 0


# -- a budget lowers the floor: each convolution's workspace at its own step -----------------
def _fake_cudnn_conv(layer, sizes_times):
    """Give ``layer`` Find's results: per call [(algorithm, workspace bytes, ms)], and the
    cuDNN layer's workspace protocol (``use_workspace``, ``workspace_need``)."""
    from minicaffe.gpu import cudnn
    layer._cudnn_key = ("fake",)
    layer.candidates = {k: list(sizes_times) for k in ("fwd", "bwd_data", "bwd_filter")}
    picks = {}

    def use_workspace(cap, backward_cap=None):
        b = cap if backward_cap is None else backward_cap
        picks["forward"] = cudnn.pick(layer.candidates["fwd"], cap)[1]
        picks["backward"] = max(cudnn.pick(layer.candidates[k], b)[1]
                                for k in ("bwd_data", "bwd_filter"))
        layer.workspace_bytes = max(picks.values())
    layer.use_workspace = use_workspace
    layer.workspace_need = lambda direction: picks[direction]
    use_workspace(max(a[1] for a in sizes_times))


def _two_fake_convs(net):
    conv1b = net.layers[net.layer_names.index("conv1b")]
    conv2 = net.layers[net.layer_names.index("conv2")]
    _fake_cudnn_conv(conv1b, [(0, 0, 3.0), (1, 8 * MiB, 2.0), (2, 64 * MiB, 1.0)])
    _fake_cudnn_conv(conv2, [(0, 0, 3.0), (1, 8 * MiB, 2.0), (2, 32 * MiB, 1.0)])
    return conv1b, conv2


def test_each_workspace_lives_at_its_own_step_in_the_arena(monkeypatch):
    """The plan counts a convolution's workspace at its forward and its backward step
    only: two convolutions of 64 and 32 MiB raise the planned peak by about the larger,
    not by their sum; the floor's worst step is the larger one's, workspace and all."""
    net = _net()
    bare = offload.build(net, "NONE").plan.peak
    conv1b, conv2 = _two_fake_convs(net)
    plan = offload.build(net, "NONE").plan
    assert plan.workspace_bytes == 64 * MiB
    assert 64 * MiB <= plan.peak - bare < 64 * MiB + 32 * MiB
    f = offload.floor_parts(plan)
    assert f["layer"] == "conv1b" and f["workspace"] == 64 * MiB
    assert [n for n, _ in f["workspaces"]] == [f"conv1b ({f['direction']} workspace)"]
    assert f["total"] == plan.side_bytes + f["workspace"] + sum(
        v for k in ("maps", "map_diffs", "kept") for _, v in f[k])
    # the offload schedule waits for a copy out before a workspace takes its place: on
    # the fake device every workspace writes junk where it is placed
    from test_offload import _run_on_fake_device
    op = offload.build(net, "ALL")
    assert any(b.kind == "workspace" for b in op.plan.buffers)
    assert _run_on_fake_device(monkeypatch, net, op, early=False, iterations=1) > 0


def test_a_budget_squeezes_only_the_workspaces_of_the_steps_over_it():
    net = _net()
    conv1b, conv2 = _two_fake_convs(net)
    before = offload.floor_bytes(offload.build(net, "ALL").plan)
    # a budget the floor meets: nothing changes
    assert offload.fit_workspace(net, before) is None
    assert conv1b.workspace_bytes == 64 * MiB and conv2.workspace_bytes == 32 * MiB
    # 20 MiB too little at conv1b's steps: conv1b takes the largest within what is free
    # there (8 MiB); conv2's steps still have room for its 32 MiB, which it keeps (one
    # workspace for the whole net would have cut both)
    budget = before - 20 * MiB
    assert offload.fit_workspace(net, budget) == (64 * MiB, 32 * MiB)
    assert conv1b.workspace_need("forward") == conv1b.workspace_need("backward") == 8 * MiB
    assert conv2.workspace_bytes == 32 * MiB
    assert offload.floor_bytes(offload.build(net, "ALL").plan) <= budget
    assert offload.build(net, "ALL", budget).peak <= budget
    # far too little: the least-workspace algorithms; the budget error still names the layer
    conv1b.use_workspace(64 * MiB)
    assert offload.fit_workspace(net, before - 63 * MiB) == (64 * MiB, 0)
    assert conv1b.workspace_bytes == conv2.workspace_bytes == 0
    with pytest.raises(offload.BudgetError, match="layer '"):
        offload.build(net, "ALL", before - 100 * MiB)


def test_memory_command_shows_each_layers_workspace(cli, tmp_path):
    """`minicaffe memory` has a workspace column per layer (fwd/bwd; 0 on the CPU engine,
    whose convolutions have no cuDNN workspace) and names the floor's workspace line."""
    (tmp_path / "net.prototxt").write_text(CHAIN)
    rc, out, err = cli("memory", "--model", "net.prototxt", "--offload", "ALL")
    assert rc == 0, err
    lines = out.splitlines()
    heads = [l for l in lines if l.startswith("layer ") and "workspace MiB fwd/bwd" in l]
    assert len(heads) == 2          # the plan's table and the offload policies' table
    rows = [l for l in lines if l.startswith("conv1b ")]
    assert len(rows) == 2 and all(r.split()[-3:] == ["0.00", "/", "0.00"] for r in rows)
    assert any(l.startswith("  cuDNN workspace of that step: ") for l in lines)
    net = _net()
    _two_fake_convs(net)
    from minicaffe.engine.offload import format_memory_report, memory_rows
    rows, summary = memory_rows(net, ("NONE",))
    text = "\n".join(format_memory_report(net, rows, summary))
    row = next(l for l in text.splitlines() if l.startswith("conv1b "))
    assert row.split()[-3:] == ["64.00", "/", "64.00"], row
    row = next(l for l in text.splitlines() if l.startswith("conv2 "))
    assert row.split()[-3:] == ["32.00", "/", "32.00"], row
    row = next(l for l in text.splitlines() if l.startswith("relu1b "))
    assert row.split()[-3:] == ["0.00", "/", "0.00"], row


# -- hiding the copies: longer lives within the memory -------------------------------------------
@pytest.mark.parametrize("policy", ["ALL", "CONV", "DYNAMIC"])
def test_hide_copies_lengthens_lives_within_the_memory(monkeypatch, resnet, policy):
    from test_offload import _fake_times, _run_on_fake_device, check_plan
    net = resnet
    times = _fake_times(net, conv=2e-5, other=2e-6)   # copies long against compute
    first = offload.n_prologue(net)
    budget = 0
    if policy == "DYNAMIC":
        none, every = offload.build(net, "NONE"), offload.build(net, "ALL")
        budget = (none.peak + 2 * every.peak) // 3
    plain = offload.build(net, policy, budget, times=times, hide=False)
    hidden = offload.build(net, policy, budget, times=times, hide=True)
    check_plan(hidden)
    names = [e.name for e in plain.entries]
    if policy == "DYNAMIC":        # DYNAMIC keeps on the device what fits the budget
        assert [e.name for e in hidden.entries] == \
            [n for n in names if n in {e.name for e in hidden.entries}]
        assert len(names) - len(hidden.entries) == hidden.info["kept"]
    else:
        assert [e.name for e in hidden.entries] == names
    assert hidden.info["lengthened"] > 0
    assert hidden.peak <= max(plain.peak, budget)
    vdnn = {e.name: e for e in plain.entries}
    moved = held = 0
    for e in hidden.entries:
        p = vdnn[e.name]
        assert e.hold >= p.hold == p.fwd_end
        held += e.hold > p.hold
        if e.bwd is not None:
            assert e.prefetch <= p.prefetch       # never later than vDNN's point
            moved += e.prefetch < p.prefetch
    assert moved or held
    # the model over the same times: no worse, and the copies out wait less
    t_plain, stall_plain = offload.simulate(times, plain.entries, first, lazy=True)
    t_hidden, stall_hidden = offload.simulate(times, hidden.entries, first, lazy=True)
    assert t_hidden <= t_plain and stall_hidden < stall_plain
    # and the offloader still reads only what was written, on the fake device
    assert _run_on_fake_device(monkeypatch, net, hidden, early=False, iterations=1) > 0


def test_hide_copies_keeps_the_order_copies_are_needed_in():
    net = _net()
    times = [1e-3] * (2 * len(net.layers))
    op = offload.build(net, "ALL", times=times)
    back = sorted((e for e in op.entries if e.bwd is not None), key=lambda e: e.bwd_first)
    assert [e.prefetch for e in back] == sorted(e.prefetch for e in back)


# -- a budget between the floor and ALL's plan: fetch some maps on demand ----------------------
@pytest.mark.parametrize("policy", ["ALL", "DYNAMIC"])
def test_a_budget_at_the_floor_fetches_maps_on_demand(monkeypatch, resnet, policy):
    from test_offload import _fake_times, _run_on_fake_device, check_plan
    net = resnet
    every = offload.build(net, "ALL", hide=False)
    floor = offload.floor_bytes(every.plan)
    assert every.peak > floor                  # a prefetch ahead adds to a working set
    op = offload.build(net, policy, floor, times=_fake_times(net), hide=False)
    check_plan(op)
    assert op.peak <= floor
    assert any(e.on_demand for e in op.entries) and not any(e.on_demand for e in every.entries)
    with pytest.raises(offload.BudgetError, match="even with offload policy ALL"):
        offload.build(net, policy, floor - 4096, times=_fake_times(net))
    assert _run_on_fake_device(monkeypatch, net, op, early=False, iterations=1) > 0
