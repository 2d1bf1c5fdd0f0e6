"""The static memory plan (engine/plan.py): lifetimes, placement, what is kept."""
import numpy as np
import pytest

from minicaffe import Net
from minicaffe.core import context
from minicaffe.engine.plan import ALIGN, MemoryPlan
from minicaffe.proto import caffe_pb2

CHAIN = """
name: "chain"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 16 dim: 16 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _net(text=CHAIN):
    return Net(text, phase=caffe_pb2.TRAIN)


def _by_name(plan, kind):
    return {b.names[0]: b for b in plan.buffers if b.kind == kind}


def test_no_two_live_buffers_overlap():
    plan = MemoryPlan(_net())
    bufs = plan.buffers
    for i, a in enumerate(bufs):
        assert a.offset % ALIGN == 0
        assert a.offset + a.nbytes <= plan.arena_bytes
        for b in bufs[i + 1:]:
            if a.overlaps(b):
                assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset, \
                    (a.names, b.names)


def test_diffs_share_and_data_stay():
    plan = MemoryPlan(_net())
    diffs = _by_name(plan, "diff")
    data = _by_name(plan, "data")
    L = len(plan.net.layers)
    # every data buffer lives the whole iteration (pycaffe reads them after a step)
    assert all(b.start == 0 and b.end == 2 * L for b in data.values())
    # conv1's diff is written by pool1's backward and read last by conv1's backward
    ids = {n: i for i, n in enumerate(plan.net.layer_names)}
    d = diffs["conv1"]
    assert (d.start, d.end) == (2 * L - 1 - ids["pool1"], 2 * L - 1 - ids["conv1"])
    # the diffs are not all alive at once: the arena is smaller than keeping them all
    assert plan.arena_bytes < plan.unshared_bytes
    # the loss weight lives in the loss top's diff: never planned
    assert "loss" not in diffs


def test_sharing_data_frees_what_backward_does_not_read():
    shared = MemoryPlan(_net(), share_data=True)
    plain = MemoryPlan(_net())
    assert shared.arena_bytes < plain.arena_bytes
    data = _by_name(shared, "data")
    L = len(shared.net.layers)
    # inputs and outputs stay; conv1's data is read by pool1's forward only (MAX keeps a
    # mask) but also by relu1's backward, so it lives into backward
    assert data["data"].end == 2 * L and data["loss"].end == 2 * L
    ids = {n: i for i, n in enumerate(shared.net.layer_names)}
    assert data["conv1"].end == 2 * L - 1 - ids["relu1"]


def test_lower_bound_and_the_data_kept_for_pycaffe_are_reported():
    plan = MemoryPlan(_net())
    lb, at = plan.lower_bound()
    # the buffers live at that step sit side by side in the arena: their sum is the bound,
    # no step has more, and the arena is at least that large
    live = [b for b in plan.buffers if b.start <= at <= b.end]
    assert sum(b.nbytes for b in live) == lb <= plan.arena_bytes
    for s in range(plan.steps + 1):
        assert sum(b.nbytes for b in plan.buffers if b.start <= s <= b.end) <= lb
    # the data kept for pycaffe that no backward reads: ip's (SoftmaxWithLoss's backward
    # reads the probabilities it keeps); conv1 and pool1 are read by relu1's and conv2's
    unread, names = plan.unread_data()
    assert names == ["ip"] and unread == _by_name(plan, "data")["ip"].nbytes
    assert MemoryPlan(_net(), share_data=True).unread_data() == (0, [])
    text = "\n".join(plan.report())
    assert f"lower bound (the most bytes live at one step, the {plan.step_name(at)}): " \
        f"{lb / (1 << 20):.1f} MiB" in text
    assert "no backward reads" in text


def test_forward_only_plan():
    plan = MemoryPlan(_net(), train=False, share_data=True)
    assert all(b.kind == "data" for b in plan.buffers)
    assert plan.param_bytes_total == plan.params_bytes


def test_peak_counts_parameters_history_and_state():
    net = _net()
    plan = MemoryPlan(net, history_sets=2)
    params = sum(b.count() * 4 for b in net.learnable_params)
    assert plan.param_bytes_total >= 4 * params
    # SoftmaxWithLoss keeps its probabilities, MAX pooling its mask
    assert plan.state_bytes >= net.blobs["ip"].count() * 4 + net.blobs["pool1"].count() * 4
    assert plan.peak > plan.arena_bytes + plan.param_bytes_total
    text = "\n".join(plan.report())
    assert "planned peak" in text and "conv1" in text


def test_split_tops_share_their_bottoms_data():
    text = CHAIN.replace('layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"',
                         'layer { name: "ip0" type: "InnerProduct" bottom: "pool2" top: "ip0"\n'
                         '        inner_product_param { num_output: 5 } }\n'
                         'layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"')
    text = text.replace('bottom: "ip" bottom: "label"', 'bottom: "ip" bottom: "label"')
    net = Net(text + 'layer { name: "silence" type: "Silence" bottom: "ip0" }', phase=caffe_pb2.TRAIN)
    plan = MemoryPlan(net)
    names = [n for b in plan.buffers if b.kind == "data" for n in b.names]
    # pool2 and its split tops are one data buffer
    pool2 = [b for b in plan.buffers if b.kind == "data" and "pool2" in b.names][0]
    assert any("split" in n for n in pool2.names)
    assert len(names) == len(set(names))


@pytest.mark.gpu
def test_apply_keeps_inputs_and_points_blobs_into_the_arena():
    from minicaffe.core import backend
    context.set_mode_gpu()
    try:
        net = _net()
        x = np.random.RandomState(0).randn(4, 3, 16, 16).astype(np.float32)
        net.blobs["data"].data[...] = x
        plan = MemoryPlan(net)
        plan.apply()
        base = plan.arena.data.ptr
        for b in plan.buffers:
            assert b.mem.device_array.data.ptr == base + b.offset
        np.testing.assert_array_equal(backend.cp.asnumpy(net.blobs["data"].gpu_data()), x)
    finally:
        context.set_mode_cpu()


def test_a_plan_larger_than_the_gpu_is_one_line_naming_the_layer():
    plan = MemoryPlan(_net())
    err = plan.does_not_fit(1 << 20, "has")
    msg = str(err)
    assert "\n" not in msg and "'conv1'" in msg and "MiB" in msg and "planned peak" in msg


_MEASURE = """
import sys
from minicaffe.core import backend, context
from minicaffe.gpu import pool
from minicaffe.synthetic import synthetic_solver
context.set_mode_gpu()
solver, _ = synthetic_solver(model=sys.argv[1], batch=int(sys.argv[2]))
backend.synchronize()
pool.reset_peak()          # the training iteration's memory, not the net's construction
solver.step(5)
backend.synchronize()
st = solver.gpu_step
print(pool.peak_bytes() + st.private_bytes(), st.plan.peak)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("model,batch", [("models/cifar10_quick/train_val.prototxt", 256),
                                         ("models/bvlc_alexnet/train_val.prototxt", 32)])
def test_planned_peak_agrees_with_the_allocator_within_5_percent(model, batch):
    """In a fresh process (the allocator's high-water mark is per process)."""
    import pathlib
    import subprocess
    import sys
    repo = pathlib.Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(repo / model), str(batch)],
                       cwd=repo, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    real, planned = (int(v) for v in r.stdout.split()[-2:])
    assert abs(real - planned) <= 0.05 * planned, (real, planned)
