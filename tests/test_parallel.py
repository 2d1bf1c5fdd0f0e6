"""Data-parallel training on the CPU: ranks are threads exchanging numpy arrays through a
FakeComm, so P2PManager/P2PSync run here exactly as they run on GPUs (minus CUDA streams).

Covers the bucket plan, the batch division, the shard assignment, the root's test-score
aggregation, stop/snapshot agreement, failure propagation (every wait is bounded), and
equivalence: N iterations on 2 and 3 ranks at global batch B give the weights of 1 rank
at batch B on the same data."""
import os
import signal
import threading
import time

import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.multigpu import parallel
from minicaffe.multigpu.comm import CommAborted, FakeComm, share_uid_by_file, \
    share_uid_by_mpi, encode_uid, decode_uid
from minicaffe.data.db import open_db
from minicaffe.core.errors import MinicaffeError
from minicaffe.compat.io import array_to_datum
from minicaffe.network.net import Net, read_net_param
from minicaffe.proto import caffe_pb2
from minicaffe.solvers import get_solver, read_solver_param

pytest.importorskip("lmdb")

N_RECORDS = 48


def make_db(path, n=N_RECORDS, seed=3, labels=None, bad=()):
    rng = np.random.RandomState(seed)
    with open_db(str(path), "lmdb", "new") as db:
        t = db.new_transaction()
        for i in range(n):
            d = array_to_datum(rng.randint(0, 255, (1, 6, 6)).astype(np.uint8))
            d.label = int(labels[i]) if labels is not None else int(rng.randint(0, 4))
            t.put(b"%08d" % i, b"\x08garbage" if i in bad else d.SerializeToString())
        t.commit()
    return str(path)


NET = """
name: "tiny"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  data_param {{ source: "{db}" batch_size: {batch} backend: LMDB }}
  transform_param {{ scale: 0.00390625 }} }}
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  data_param {{ source: "{test_db}" batch_size: {batch} backend: LMDB }}
  transform_param {{ scale: 0.00390625 }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 3 kernel_size: 3 weight_filler {{ type: "xavier" }}
                       bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relu" type: "ReLU" bottom: "conv" top: "conv" }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "conv" top: "ip1"
  inner_product_param {{ num_output: 8 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 4 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
  include {{ phase: TEST }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
"""

SOLVER = """
net_param {{ {net} }}
base_lr: 0.1 momentum: 0.9 weight_decay: 0.0005 lr_policy: "step" gamma: 0.5 stepsize: 4
max_iter: {max_iter} display: 0 snapshot: 0 snapshot_after_train: false
random_seed: 1701 test_iter: 2 test_interval: {test_interval} test_initialization: false
solver_mode: CPU {extra}
"""


def solver_param(tmp_path, batch=12, max_iter=6, extra="", test_interval=3, db=None,
                 test_db=None, net=None):
    db = db or make_db(tmp_path / "train_db")
    test_db = test_db or make_db(tmp_path / "test_db", seed=4)
    net = net or NET
    text = SOLVER.format(net=net.format(db=db, test_db=test_db, batch=batch),
                         max_iter=max_iter, extra=extra, test_interval=test_interval)
    return read_solver_param(text)[0]


def weights(net):
    return {name: [b.data.copy() for b in blobs] for name, blobs in net.params.items()}


def single_rank(param):
    s = get_solver(param)
    try:
        s.solve()
        return weights(s.net), s.mean_scores, s
    finally:
        for n in [s.net] + s.test_nets:
            n.close()


def assert_same_weights(a, b, rtol=2e-5, atol=2e-6):
    assert a.keys() == b.keys()
    for k in a:
        for x, y in zip(a[k], b[k]):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=k)


# -- the bucket plan ---------------------------------------------------------------------------------
def test_bucket_plan_tiles_the_buffer_from_the_end():
    counts = [500, 10, 3000, 20, 800, 4]        # conv1 w/b, conv2 w/b, ip w/b
    offsets, off = [], 0
    for c in counts:
        offsets.append(off)
        off += -(-c // 256) * 256
    ready = [1, 1, 3, 3, 5, 5]                  # the layer owning each param
    plan = parallel.make_bucket_plan(offsets, counts, off, ready, 3)
    assert 1 <= len(plan) <= 3
    spans = sorted((b.start, b.stop) for b in plan)
    assert spans[0][0] == 0 and spans[-1][1] == off
    assert all(s[1] == t[0] for s, t in zip(spans, spans[1:]))     # contiguous, no overlap
    assert sorted(p for b in plan for p in b.params) == list(range(len(counts)))
    for b in plan:                                                   # a param is never split
        for p in b.params:
            assert b.start <= offsets[p] and offsets[p] + counts[p] <= b.stop
        assert b.ready_layer == min(ready[p] for p in b.params)
    # launch order follows backward: the bucket of the last layer first
    assert [b.ready_layer for b in plan] == sorted((b.ready_layer for b in plan), reverse=True)
    assert plan[0].params[-1] == len(counts) - 1 and plan[-1].params[0] == 0
    assert [b.index for b in plan] == list(range(len(plan)))


@pytest.mark.parametrize("n_buckets", [1, 2, 4, 100])
def test_bucket_plan_sizes(n_buckets):
    counts = [256] * 8
    offsets = [256 * i for i in range(8)]
    plan = parallel.make_bucket_plan(offsets, counts, 2048, list(range(8)), n_buckets)
    assert len(plan) == min(n_buckets, 8)
    sizes = [b.stop - b.start for b in plan]
    assert max(sizes) - min(sizes) <= 256                         # about equal
    if n_buckets == 1:
        assert plan[0].ready_layer == 0 and plan[0].params == list(range(8))


def test_bucket_plan_of_a_net_with_shared_params(tmp_path):
    net = Net(read_net_param("""
      name: "shared" layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "a" type: "InnerProduct" bottom: "x" top: "a"
              param { name: "w" } inner_product_param { num_output: 3 bias_term: false } }
      layer { name: "b" type: "InnerProduct" bottom: "a" top: "b"
              inner_product_param { num_output: 5 } }
      layer { name: "c" type: "InnerProduct" bottom: "b" top: "c"
              param { name: "w2" } inner_product_param { num_output: 3 bias_term: false } }
      layer { name: "d" type: "InnerProduct" bottom: "c" top: "d"
              param { name: "w" } inner_product_param { num_output: 3 bias_term: false } }"""),
              caffe_pb2.TRAIN)
    ready = parallel.param_ready_layers(net)
    # 'w' is owned by layer a (1) and shared by d (4): complete only after a's backward
    assert ready == [1, 2, 2, 3]
    plan = parallel.bucket_plan_for(net, 4)
    flat = net.flat_params()
    assert sum(b.stop - b.start for b in plan) == flat.total
    assert min(b.ready_layer for b in plan) == 1


# -- batch division --------------------------------------------------------------------------------
def test_divide_batch_rounds_up_and_reports_uneven(tmp_path):
    p = read_net_param("""
      layer { name: "d" type: "Data" top: "x" data_param { source: "s" batch_size: 64 } }
      layer { name: "i" type: "ImageData" top: "y" image_data_param { source: "s" batch_size: 10 } }
      layer { name: "h" type: "HDF5Data" top: "z" hdf5_data_param { source: "s" batch_size: 9 } }
      layer { name: "m" type: "MemoryData" top: "m" top: "ml"
              memory_data_param { batch_size: 8 channels: 1 height: 1 width: 1 } }
      layer { name: "u" type: "DummyData" top: "u" dummy_data_param { shape { dim: 100 dim: 3 } } }""")
    uneven = parallel.divide_batch(p, 3)
    L = {lp.name: lp for lp in p.layer}
    assert L["d"].data_param.batch_size == 22           # ceil(64 / 3)
    assert L["i"].image_data_param.batch_size == 4
    assert L["h"].hdf5_data_param.batch_size == 3       # 9 / 3 exactly
    assert L["m"].memory_data_param.batch_size == 3
    assert list(L["u"].dummy_data_param.shape[0].dim) == [34, 3]
    assert {(n, o, w) for n, o, w in uneven} == {("d", 64, 22), ("i", 10, 4), ("m", 8, 3),
                                                  ("u", 100, 34)}


def test_prepare_solver_param_inlines_net_files_and_warns_once(tmp_path, caplog):
    net = tmp_path / "net.prototxt"
    net.write_text('layer { name: "d" type: "Data" top: "x" data_param { source: "s" '
                   'batch_size: 100 } }')
    (tmp_path / "s.prototxt").write_text('net: "net.prototxt" test_net: "net.prototxt" '
                                         'test_iter: 1 test_interval: 1 base_lr: 0.1')
    param, path = read_solver_param(str(tmp_path / "s.prototxt"))
    warnings = []
    from minicaffe.core import log
    orig = log.warning
    log.warning = lambda msg, *a: warnings.append(msg % a)
    try:
        p = parallel.prepare_solver_param(param, 3, path)
    finally:
        log.warning = orig
    assert not p.HasField("net") and not len(p.test_net)
    assert p.net_param.layer[0].data_param.batch_size == 34
    assert p.test_net_param[0].layer[0].data_param.batch_size == 34
    assert len(warnings) == 1 and "34" in warnings[0] and "3 GPUs" in warnings[0]
    p2 = parallel.prepare_solver_param(param, 2, path)
    assert p2.net_param.layer[0].data_param.batch_size == 50


# -- shards ------------------------------------------------------------------------------------------
def test_each_rank_reads_its_own_shard_in_train_and_test(tmp_path):
    """With shard_test set (multi-GPU training), rank r of N reads records i % N == r in
    TRAIN and in TEST; without it TEST is whole."""
    db = make_db(tmp_path / "db", n=12, labels=list(range(12)))
    from minicaffe.core.blob import Blob
    from minicaffe.compat.testing import make_layer

    def labels_seen(phase, rank, n):
        layer = make_layer(f'name: "d" type: "Data" top: "data" top: "label" '
                           f'data_param {{ source: "{db}" batch_size: 2 backend: LMDB }}', phase)
        top = [Blob(), Blob()]
        context.set_solver_rank(rank)
        layer.setup([], top)
        out = []
        for _ in range(12 // n // 2):
            layer.forward([], top)
            out += top[1].data.astype(int).tolist()
        layer.close()
        return out

    try:
        context.set_solver_count(3)
        context.set_shard_test(True)
        for phase in (caffe_pb2.TRAIN, caffe_pb2.TEST):
            seen = [labels_seen(phase, r, 3) for r in range(3)]
            assert seen == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
        context.set_shard_test(False)
        assert labels_seen(caffe_pb2.TEST, 1, 3) == [0, 1, 2, 3]
    finally:
        context.set_solver_count(1)
        context.set_shard_test(False)
        context.set_solver_rank(0)


# -- the fake communicator -----------------------------------------------------------------------
def run_ranks(n, fn, timeout=20):
    world = FakeComm.new_uid(n)
    out, errs = [None] * n, []

    def body(r):
        try:
            out[r] = fn(FakeComm(n, world, r))
        except Exception as e:
            errs.append(e)
    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    return out, errs


def test_fake_comm_allreduce_and_bcast_are_identical_on_every_rank():
    def fn(c):
        a = np.arange(5, dtype=np.float32) * (c.rank + 1)
        c.allreduce(a[1:4])                    # a slice, in place
        b = np.full(3, c.rank, np.float64)
        c.bcast(b, root=2)
        return a, b, c.allreduce_host([c.rank, 1])
    out, errs = run_ranks(3, fn)
    assert not errs
    for r, (a, b, h) in enumerate(out):
        # inside the slice: 1 + 2 + 3 times the index; outside: this rank's own value
        np.testing.assert_array_equal(a, [0, 6, 12, 18, 4 * (r + 1)])
        np.testing.assert_array_equal(b, [2, 2, 2])
        np.testing.assert_array_equal(h, [3, 3])


def test_fake_comm_abort_ends_every_waiting_rank(finishes):
    def fn(c):
        if c.rank == 1:
            time.sleep(0.2)
            c.abort()
            raise RuntimeError("rank 1 gives up")
        c.allreduce(np.zeros(2))
    with finishes():
        out, errs = run_ranks(3, fn)
    assert sum(isinstance(e, CommAborted) for e in errs) == 2
    assert sum(isinstance(e, RuntimeError) for e in errs) == 1


def test_uid_travels_by_file_and_refuses_a_stale_file(tmp_path):
    path = tmp_path / "init"
    got = {}

    def peer(r):
        got[r] = share_uid_by_file(path, r, lambda: b"\x01\x02secret", timeout=10)
    ts = [threading.Thread(target=peer, args=(r,)) for r in (2, 1)]
    for t in ts:
        t.start()
    time.sleep(0.1)
    got[0] = share_uid_by_file(path, 0, lambda: b"\x01\x02secret")
    for t in ts:
        t.join(10)
    assert got == {0: b"\x01\x02secret", 1: b"\x01\x02secret", 2: b"\x01\x02secret"}
    with pytest.raises(MinicaffeError, match="already exists"):
        share_uid_by_file(path, 0, lambda: b"x")
    with pytest.raises(MinicaffeError, match="waited"):
        share_uid_by_file(tmp_path / "never", 1, lambda: b"x", timeout=0.2)
    assert decode_uid(encode_uid((1, -2, 3))) == (1, -2, 3)


def test_uid_travels_by_mpi_broadcast():
    class FakeMPIComm:  # what mpi4py's COMM_WORLD offers: Get_rank and a pickling bcast
        def __init__(self, rank, box):
            self.rank, self.box = rank, box

        def Get_rank(self):
            return self.rank

        def bcast(self, obj, root=0):
            if self.rank == root:
                self.box.append(obj)
            while not self.box:
                time.sleep(0.01)
            return self.box[0]
    box, made = [], []

    def make():
        made.append(1)
        return b"uid"
    res = [share_uid_by_mpi(FakeMPIComm(r, box), make) for r in (0, 1)]
    assert res == [b"uid", b"uid"] and made == [1]


# -- training: equivalence ---------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_n_ranks_at_global_batch_b_equal_one_rank_at_b(tmp_path, n):
    param = solver_param(tmp_path, batch=12, max_iter=6)
    ref_w, ref_scores, _ = single_rank(param)
    m = parallel.train_threads(param, [None] * n)
    root = m.syncs[0].solver
    assert root.iter == 6
    assert_same_weights(weights(root.net), ref_w)
    for s in m.syncs[1:]:                       # every rank holds the same weights
        assert s.solver.iter == 6
        for k, v in weights(s.solver.net).items():
            for x, y in zip(v, weights(root.net)[k]):
                np.testing.assert_array_equal(x, y)
    # per-rank batch 12 / n; the root's test scores are the sums over every rank's shard
    assert root.net.blobs["data"].shape[0] == 12 // n
    np.testing.assert_allclose(root.mean_scores[0], ref_scores[0], rtol=1e-4, atol=1e-6)
    init = get_solver(param)
    try:
        assert not np.allclose(weights(init.net)["ip1"][0], ref_w["ip1"][0])  # it trained
    finally:
        init.net.close()
    assert len(m.rates) == n and all(r > 0 for r in m.rates)   # images/s of every rank


@pytest.mark.parametrize("extra", ["clip_gradients: 0.05", "iter_size: 2", 'type: "Adam" ',
                                   "reduce_buckets: 1", "reduce_buckets: 50"])
def test_equivalence_holds_for_clipping_iter_size_adam_and_any_bucket_count(tmp_path, extra):
    batch = 6 if "iter_size" in extra else 12
    param = solver_param(tmp_path, batch=batch, max_iter=4, extra=extra)
    if "Adam" in extra:
        param.base_lr = 0.01
        param.momentum2 = 0.999
    ref_w, _, _ = single_rank(param)
    m = parallel.train_threads(param, [None] * 2)
    assert_same_weights(weights(m.syncs[0].solver.net), ref_w)


def test_resume_broadcasts_the_root_state(tmp_path):
    """A run resumed from a snapshot on 2 ranks starts from the root's state (iteration,
    lr step, momentum history and weights), every rank alike.  (Data positions are exact
    on one device only: the snapshot holds the root's reader, docs/multi_gpu.md.)"""
    param = solver_param(tmp_path, max_iter=6, extra=f'snapshot: 3 snapshot_prefix: '
                                                     f'"{tmp_path}/snap"')
    single_rank(param)
    state = f"{tmp_path}/snap_iter_3.solverstate"
    assert os.path.exists(state)
    param.snapshot = 0
    param.max_iter = 3          # resume, then no iteration: the state as broadcast
    m = parallel.train_threads(param, [None] * 2, snapshot=state)
    s0, s1 = m.syncs[0].solver, m.syncs[1].solver
    assert s0.iter == s1.iter == 3 and s0.current_step == s1.current_step
    w0, w1 = weights(s0.net), weights(s1.net)
    assert_same_weights(w1, w0, rtol=0, atol=0)
    for a, b in zip(s0.history, s1.history):
        np.testing.assert_array_equal(a.data, b.data)
    ref = get_solver(param)
    try:
        ref.restore(state)
        assert_same_weights(w0, weights(ref.net), rtol=0, atol=0)
    finally:
        for n in [ref.net] + ref.test_nets:
            n.close()


# -- the root sums every rank's scores -------------------------------------------------------------
def test_root_test_scores_are_the_sum_over_every_rank(tmp_path):
    """Labels are the record parity: rank 0's test shard is all 0, rank 1's all 1.  The
    mean label over both shards is 0.5; the root's own shard alone would give 0."""
    labels = [i % 2 for i in range(N_RECORDS)]
    test_db = make_db(tmp_path / "test_db", labels=labels)
    net = NET.replace('layer {{ name: "accuracy"',
                      'layer {{ name: "lm" type: "Reduction" bottom: "label" top: "label_mean" '
                      'reduction_param {{ operation: MEAN }} include {{ phase: TEST }} }}\n'
                      'layer {{ name: "accuracy"')
    param = solver_param(tmp_path, max_iter=3, test_db=test_db, net=net)
    m = parallel.train_threads(param, [None] * 2)
    root = m.syncs[0].solver
    names = [root.test_nets[0].blob_names[i] for i in root.test_nets[0].output_blob_indices]
    scores = dict(zip(names, root.mean_scores[0]))
    assert scores["label_mean"] == pytest.approx(0.5)


# -- stop, snapshot, failure ------------------------------------------------------------------------
def test_stop_request_ends_every_rank_at_the_same_iteration(tmp_path, finishes):
    param = solver_param(tmp_path, max_iter=100000, test_interval=0)
    param.ClearField("test_iter")
    calls = []

    def action():
        calls.append(1)
        return "stop" if len(calls) == 3 else "none"
    with finishes():
        m = parallel.train_threads(param, [None] * 2, action_function=action)
    iters = [s.solver.iter for s in m.syncs]
    assert iters[0] == iters[1] and 0 < iters[0] < 100000
    assert all(s.solver.requested_early_exit for s in m.syncs)


def test_sigint_with_snapshot_effect_snapshots_once_from_the_root(tmp_path):
    from minicaffe.solvers.signal_handler import SignalHandler
    param = solver_param(tmp_path, max_iter=400, test_interval=0,
                         extra=f'snapshot_prefix: "{tmp_path}/snap"')
    param.ClearField("test_iter")
    root = {}
    orig = parallel.P2PManager.__init__

    def spy(self, solver, *a, **k):
        root["solver"] = solver
        orig(self, solver, *a, **k)

    def send_sigint():
        while root.get("solver") is None or root["solver"].iter < 3:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)
    parallel.P2PManager.__init__ = spy
    try:
        threading.Thread(target=send_sigint, daemon=True).start()
        with SignalHandler("snapshot", "none") as h:
            m = parallel.train_threads(param, [None] * 2, action_function=h.get_action)
    finally:
        parallel.P2PManager.__init__ = orig
    snaps = sorted(p for p in os.listdir(tmp_path) if p.endswith(".caffemodel"))
    assert len(snaps) == 1, snaps
    assert m.syncs[0].solver.iter == m.syncs[1].solver.iter == 400


def test_a_data_error_in_one_rank_ends_every_rank_with_one_error(tmp_path, finishes):
    db = make_db(tmp_path / "train_db", bad={7})        # record 7: rank 1's shard
    param = solver_param(tmp_path, db=db, max_iter=50, test_interval=0)
    param.ClearField("test_iter")
    with finishes():
        with pytest.raises(parallel.ParallelError) as e:
            parallel.train_threads(param, [None] * 2)
    msg = str(e.value)
    assert msg.startswith("rank 1 (CPU): ") and "00000007" in msg and "\n" not in msg


@pytest.mark.parametrize("failing_rank", [0, 2])
def test_an_exception_in_any_rank_ends_every_rank(tmp_path, monkeypatch, failing_rank, finishes):
    param = solver_param(tmp_path, max_iter=10000, test_interval=0)
    param.ClearField("test_iter")
    orig = parallel.P2PSync.on_start

    def on_start(self):
        if self.rank == failing_rank and self.solver.iter == 5:
            raise RuntimeError("injected")
        orig(self)
    monkeypatch.setattr(parallel.P2PSync, "on_start", on_start)
    with finishes():
        with pytest.raises(parallel.ParallelError,
                           match=f"^rank {failing_rank} \\(CPU\\): RuntimeError: injected$"):
            parallel.train_threads(param, [None] * 3)


def test_a_nan_loss_in_one_rank_ends_every_rank(tmp_path, monkeypatch):
    param = solver_param(tmp_path, max_iter=10000, test_interval=0)
    param.ClearField("test_iter")
    orig = parallel.P2PSync.on_start

    hooked = []

    def on_start(self):
        net = self.solver.net
        if self.rank == 1 and net not in hooked:   # once, at iteration 0: rank 1's input
            hooked.append(net)                     # turns nan at iteration 4 (a Net hook)
            solver = self.solver

            def poison(i):
                if i == 0 and solver.iter == 4:
                    net.blobs["data"].data[...] = np.nan
            net.add_hook("after_forward", poison)
        orig(self)
    monkeypatch.setattr(parallel.P2PSync, "on_start", on_start)
    with pytest.raises(parallel.ParallelError, match="^rank 1 .*Iteration 4: the loss is nan"):
        parallel.train_threads(param, [None] * 2)


def test_a_failure_while_building_a_rank_does_not_hang(tmp_path, monkeypatch):
    param = solver_param(tmp_path, max_iter=10)
    orig = parallel.P2PManager.build_solver

    def build(self, rank):
        if context.solver_rank() == 1:
            raise MinicaffeError("no memory for rank 1")
        return orig(self, rank)
    monkeypatch.setattr(parallel.P2PManager, "build_solver", build)
    with pytest.raises(parallel.ParallelError, match="^rank 1 \\(CPU\\): no memory for rank 1$"):
        parallel.train_threads(param, [None] * 2)


def test_python_layers_are_refused_in_thread_mode(tmp_path):
    net = NET.replace('layer {{ name: "relu"', 'layer {{ name: "py" type: "Python" bottom: "conv" '
                      'top: "conv2" python_param {{ module: "m" layer: "L" }} }}\nlayer {{ name: "relu"')
    param = solver_param(tmp_path, net=net)
    with pytest.raises(MinicaffeError, match="Python layer 'py' cannot run on several ranks"):
        parallel.train_threads(param, [None] * 2)


def test_manager_checks_solver_count(tmp_path):
    param = solver_param(tmp_path)
    s = get_solver(param)
    try:
        with pytest.raises(MinicaffeError, match="set_solver_count\\(2\\) before"):
            parallel.P2PManager(s, [None, None])
    finally:
        s.net.close()
        for t in s.test_nets:
            t.close()


def test_only_the_root_logs_info(tmp_path):
    import io
    from minicaffe.core import log
    stream = io.StringIO()
    log.init_log(stream=stream)
    try:
        param = solver_param(tmp_path, max_iter=2, extra="display: 1")
        parallel.train_threads(param, [None] * 2)
    finally:
        log.init_log()
    text = stream.getvalue()
    assert text.count("Iteration 1, lr = ") == 1          # the root's display, once
    # the root's train and test nets (built before the manager); not rank 1's
    assert text.count("Creating Layer conv") == 2
    assert "P2PManager: total" in text and "P2PManager: rank 1:" in text


def test_nccl_multicast_stays_off_unless_the_user_chose(monkeypatch):
    from minicaffe.multigpu.comm import keep_multicast_off
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    keep_multicast_off()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    keep_multicast_off()
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
