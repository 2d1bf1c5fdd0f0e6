"""The engine's schedule (engine/schedule.py): the training iteration as a list of ops,
the passes over it, the eager executor the CPU solver runs, and where a user sees it
(``minicaffe memory --schedule``)."""
import numpy as np

from minicaffe import Net
from minicaffe.multigpu import parallel
from minicaffe.layers import registry
from minicaffe.engine.executor import run_ops
from minicaffe.engine.schedule import (Schedule, allreduce_pass, compile_iteration, fusion_pass,
                                       schedule_for)
from minicaffe.proto import caffe_pb2

from test_cli import REPO
from test_fusion import RESIDUAL
from test_memory_plan import CHAIN


def _net(text=CHAIN):
    return Net(text, phase=caffe_pb2.TRAIN)


def test_the_base_schedule_is_forward_backward_loss_update():
    net = _net()
    L = len(net.layers)
    s = compile_iteration(net)
    assert s.kinds() == ["prologue"] + ["forward"] * (L - 1) + ["backward"] * L + \
        ["loss", "update"]
    assert [op.index for op in s if op.kind == "backward"] == list(range(L - 1, -1, -1))
    # the data layer's backward only runs the hooks, and says so
    assert str(s.ops[-3]) == "backward 0 data (hooks only: nothing to compute)"
    assert str(s.ops[1]) == "forward 1 conv1"
    # iter_size passes up to the backward, one loss and one update
    two = compile_iteration(net, iter_size=2)
    assert two.kinds().count("forward") == 2 * (L - 1) and two.kinds()[-2:] == ["loss", "update"]


def test_the_fusion_pass_makes_one_op_per_fused_pair(monkeypatch):
    monkeypatch.setattr(registry, "cudnn_available", lambda: (True, ""))
    net = _net(RESIDUAL)
    s = fusion_pass(compile_iteration(net), net)
    assert s.passes == ["fusion"]
    fwd = [str(op) for op in s if op.kind == "forward" and op.detail]
    ids = {n: i for i, n in enumerate(net.layer_names)}
    a, bn, sm = ids["a"], ids["bn"], ids["sum"]
    assert fwd == [f"forward {a}-{a + 1} a+relu_a (Convolution+ReLU)",
                   f"forward {bn}-{bn + 1} bn+scale (BatchNorm+Scale)",
                   f"forward {sm}-{sm + 1} sum+relu (Eltwise+ReLU)"]
    # backward: the pairs that fuse theirs are one op; Convolution+ReLU's ReLU runs its own
    bwd = [str(op) for op in s if op.kind == "backward" and len(op.layers) == 2]
    assert bwd == [f"backward {sm}-{sm + 1} sum+relu (Eltwise+ReLU)",
                   f"backward {bn}-{bn + 1} bn+scale (BatchNorm+Scale)"]
    assert sum(len(op.layers) for op in s if op.kind == "forward") == len(net.layers) - 1


def test_the_allreduce_pass_reduces_each_bucket_after_the_backward_that_completes_it():
    net = _net()
    buckets = parallel.bucket_plan_for(net, 3)
    s = allreduce_pass(compile_iteration(net, iter_size=2), net, buckets)
    ops = s.ops
    reduces = [k for k, op in enumerate(ops) if op.kind == "allreduce"]
    assert sorted(ops[k].index for k in reduces) == [b.index for b in buckets]
    last_forward = max(k for k, op in enumerate(ops) if op.kind == "forward")
    for k in reduces:
        b = buckets[ops[k].index]
        assert k > last_forward                     # in the last pass of iter_size only
        before = [op for op in ops[last_forward:k] if op.kind == "backward"]
        assert before[-1].index == b.ready_layer    # right after the layer that completes it
    assert ops[-1].kind == "update" and max(reduces) < len(ops) - 1


def test_the_eager_executor_runs_the_schedule_in_order_through_the_net_hooks():
    net = _net()
    seen = []
    for kind in ("before_forward", "before_backward"):
        net.add_hook(kind, lambda i, kind=kind: seen.append((kind.split("_")[1], i)))
    s = schedule_for(net, iter_size=2)
    rng = np.random.RandomState(0)
    net.blobs["data"].data[...] = rng.randn(*net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.randint(0, 5, net.blobs["label"].shape)
    losses = run_ops(s, net)
    want = [("forward" if op.kind == "prologue" else op.kind, i) for op in s
            if op.kind in ("prologue", "forward", "backward") for i in
            (op.layers if op.kind != "backward" else reversed(op.layers))]
    assert seen == want
    # each pass's loss is the net's loss for those inputs
    assert len(losses) == 2 and losses[0] == losses[1]
    np.testing.assert_allclose(losses[0], net.forward()["loss"], rtol=1e-6)


def test_the_gpu_steps_body_runs_the_same_ops_without_reading_the_loss():
    """The one executor's walker with a loss ring (the GPU step: the prologue ops, then
    the body from the first layer after them) walks the same ops as in host mode, through
    the same hooks, to the same gradients; here on the CPU with a null ring address (the
    step adds the losses on the device)."""
    grads, orders = [], []
    for runner in ("eager", "device"):
        net = _net()
        for a, b in zip(net.learnable_params, grads[0][1] if grads else []):
            a.data[...] = b
        seen = []
        net.add_hook("before_forward", lambda i: seen.append(("forward", i)))
        net.add_hook("before_backward", lambda i: seen.append(("backward", i)))
        rng = np.random.RandomState(0)
        net.blobs["data"].data[...] = rng.randn(*net.blobs["data"].shape)
        net.blobs["label"].data[...] = rng.randint(0, 5, net.blobs["label"].shape)
        s = schedule_for(net)
        if runner == "eager":
            assert len(run_ops(s, net)) == 1
        else:
            # the GPU step: its prologue ops first (eagerly), then the body from layer 1
            prologue = Schedule([op for op in s if op.kind == "prologue"])
            assert [str(op) for op in prologue] == ["prologue 0 data"]
            assert run_ops(prologue, net, (0, None, 1)) == []
            assert run_ops(s, net, (0, None, 1), first=1) == []
        grads.append((runner, [p.data.copy() for p in net.learnable_params],
                      [p.diff.copy() for p in net.learnable_params]))
        orders.append(seen)
    assert orders[0] == orders[1]
    for a, b in zip(grads[0][2], grads[1][2]):
        np.testing.assert_array_equal(a, b)


def test_memory_prints_the_schedule_with_the_offload_copies(cli):  # noqa: F811
    model = str(REPO / "models/lenet/train_val.prototxt")
    rc, out, err = cli("memory", "--model", model, "--batch", "4", "--schedule")
    assert rc == 0, err
    sched = out.split("schedule of one training iteration", 1)[1].splitlines()
    assert sched[0] == ""
    assert [l.split()[1] for l in sched[1:]][:2] == ["prologue", "forward"]
    assert sched[-2:] == ["  18  loss", "  19  update"]
    rc, out, err = cli("memory", "--model", model, "--batch", "4", "--schedule",
                       "--offload", "all")
    assert rc == 0, err
    assert "schedule of one training iteration (passes: offload ALL)" in out
    assert "copy_out conv2 (51200 bytes device->host)" in out
    assert "copy_in pool1 (46080 bytes host->device)" in out


def test_the_memory_plan_is_a_pass_reading_the_ops_reads_and_writes():
    """engine/plan.py's ``memory_pass`` takes every buffer's lifetime from what the
    schedule's ops read and write (``accesses``): each buffer lives over every step that
    touches it; a layer's backward reads only the data it retains; iter_size repeats the
    same steps and the plan; ``MemoryPlan(net)`` is the pass over the net's own schedule."""
    from minicaffe.engine.plan import MemoryPlan, memory_pass
    from minicaffe.engine.schedule import accesses
    net = _net()
    s = schedule_for(net)
    plan = memory_pass(s, net)
    where = {(id(b.mem)): b for b in plan.buffers}
    ids = {n: i for i, n in enumerate(net.layer_names)}
    touched = 0
    for op in s:
        for acc in accesses(net, op):
            for u in acc.reads + acc.writes:
                blob = (net.top_vecs if u.side == "top" else net.bottom_vecs)[acc.layer][u.j]
                b = where.get(id(blob.data_mem if u.kind == "data" else blob.diff_mem))
                if b is not None:
                    assert b.start <= acc.step <= b.end, (str(op), u)
                    touched += 1
    assert touched > 2 * len(net.layers)
    # a max pooling's backward reads no data (its mask is its state); a convolution's
    # reads its bottom; a ReLU in place reads its top
    L = len(net.layers)
    back = {op.index: op for op in s if op.kind == "backward"}
    pool = accesses(net, back[ids["pool1"]])[0]
    assert pool.step == 2 * L - 1 - ids["pool1"]
    assert [u for u in pool.reads if u.kind == "data"] == []
    conv = accesses(net, back[ids["conv2"]])[0]
    assert [(u.kind, u.side, net.blob_names[u.blob]) for u in conv.reads if u.kind == "data"] \
        == [("data", "bottom", "pool1")]
    assert where[id(net.blobs["pool1"].data_mem)].bwd_reads == [conv.step]
    # iter_size repeats the steps: the same plan; the net's own schedule: the same plan
    two = memory_pass(schedule_for(net, iter_size=2), net)
    for p in (two, MemoryPlan(net)):
        assert (p.arena_bytes, p.peak) == (plan.arena_bytes, plan.peak)
        assert [(b.names, b.start, b.end, b.offset) for b in p.buffers] == \
            [(b.names, b.start, b.end, b.offset) for b in plan.buffers]
