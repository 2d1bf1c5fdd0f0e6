"""Data-parallel training: P2PManager and P2PSync (NVIDIA Caffe's parallel.cpp design).

One model, several ranks (one per GPU), synchronous SGD:

- :class:`P2PManager` is given the root solver and one device per local rank.  It checks
  ``solver_count``, makes the communicator's unique id, starts one :class:`P2PSync`
  thread per rank, supervises them from the calling (main) thread -- signals, a failure
  in any rank, a failure reported by another process -- joins them, and reports each
  rank's and the total images/s.
- :class:`P2PSync` (one thread per rank) adopts the root solver (first local rank) or
  builds its own Solver and Net on its device with ``root_solver`` false in its
  thread-local manager (seeded with random_seed + rank), creates its communicator between
  two barriers, and makes a high-priority communication stream.  At the start it
  broadcasts rank 0's parameters, solver history and iteration.  During backward it
  all-reduces the gradients bucket by bucket (:func:`make_bucket_plan`): a bucket is a
  contiguous range of the net's flat diff buffer, reduced in place on the communication
  stream as soon as every layer owning its parameters has finished its backward (the
  net's ``after_backward`` hook), ordered by CUDA events, then scaled by 1/N.  The update
  waits for the last reduction through an event (no host synchronisation), so the update,
  and clip_gradients' global norm, always see the fully reduced gradient.
- Stop and snapshot requests are agreed on by every rank (a tiny all-reduce per iteration,
  read one iteration later so that it never stalls the host): every rank stops at the same
  iteration; only the root snapshots.
- Test: every rank tests its own shard of the test data; the root sums every rank's scores
  (``Solver.gather_test_results``) and logs them.  Only the root logs INFO lines, tests
  are logged, and snapshots are written by the root.
- Failure: the first exception in any rank is the run's error; the manager aborts every
  communicator and barrier so that no rank waits in a collective, and raises one
  :class:`ParallelError` naming the rank.

The data each rank reads is its own shard (``layers/data_layers.py``: record i goes to
rank i % N); :func:`prepare_solver_param` divides each data layer's batch by N (rounded
up, with one warning), so the global batch and learning recipe are those of one GPU.
Process mode (one process per GPU) is in ``parallel_launch.py``.
"""
import collections
import contextlib
import logging
import os
import threading
import time

import numpy as np

from ..core import backend, context, log
from . import comm as comm_mod
from ..core.errors import ConfigError, MinicaffeError
from ..network.net import read_net_param

NONE, SNAPSHOT, STOP = "none", "snapshot", "stop"


class ParallelError(MinicaffeError):
    """One rank failed; the message names the rank and its error."""


# -- the bucket plan (pure Python) -----------------------------------------------------------
Bucket = collections.namedtuple("Bucket", "index start stop params ready_layer")
Bucket.__doc__ = """Elements [start, stop) of the flat diff buffer: learnable params ``params``
(indices in ``net.learnable_params``) plus the alignment gaps after them; reduced once the
backward of layer ``ready_layer`` is done."""


def param_ready_layers(net):
    """For each learnable param, the index of the last layer in backward order (the lowest
    index) that uses it: its gradient is complete after that layer's backward.  Shared
    parameters count every layer that shares them."""
    ready = [None] * len(net.learnable_params)
    for lid, pids in enumerate(net.param_id_vecs):
        for pid in pids:
            i = net.learnable_param_ids[pid]
            ready[i] = lid if ready[i] is None else min(ready[i], lid)
    return [0 if r is None else r for r in ready]


def make_bucket_plan(offsets, counts, total, ready_layers, n_buckets):
    """Split a flat buffer of params (``offsets``/``counts`` in elements, ``total`` its
    length) into at most ``n_buckets`` contiguous buckets of about ``total / n_buckets``
    elements each, formed from the end of the buffer (the last layers, whose backward runs
    first).  The buckets tile [0, total) exactly; a param is never split.  Returned in
    launch order: by ready layer, highest first, then from the end of the buffer."""
    n = len(counts)
    if n == 0:
        return []
    n_buckets = max(1, min(int(n_buckets), n))
    target = total / n_buckets
    groups, cur, stop = [], [], total
    for i in range(n - 1, -1, -1):
        cur.append(i)
        size = stop - offsets[i]
        if i > 0 and size >= target and len(groups) < n_buckets - 1:
            groups.append((offsets[i], stop, cur))
            stop, cur = offsets[i], []
    if cur:
        groups.append((0, stop, cur))
    buckets = [Bucket(k, start, stop_, sorted(params), min(ready_layers[p] for p in params))
               for k, (start, stop_, params) in enumerate(groups)]
    buckets.sort(key=lambda b: (-b.ready_layer, -b.start))
    return [b._replace(index=k) for k, b in enumerate(buckets)]


def bucket_plan_for(net, n_buckets):
    """The bucket plan of ``net``'s flat parameter buffer."""
    flat = net.flat_params()
    return make_bucket_plan(flat.offsets, flat.counts, flat.total, param_ready_layers(net),
                            n_buckets)


def describe_plan(plan, net, itemsize=4):
    """One line per bucket (for the log): its size and the layer that completes it."""
    return [f"bucket {b.index}: {(b.stop - b.start) * itemsize / 2 ** 20:.2f} MiB, "
            f"{len(b.params)} params, reduced after the backward of layer "
            f"'{net.layer_names[b.ready_layer]}'" for b in plan]


# -- batch division -------------------------------------------------------------------------------
_BATCH_FIELDS = {"Data": "data_param", "ImageData": "image_data_param",
                 "HDF5Data": "hdf5_data_param", "WindowData": "window_data_param",
                 "MemoryData": "memory_data_param"}


def per_rank_batch(batch, n):
    """The per-rank batch for a global ``batch`` on ``n`` ranks: rounded up."""
    return -(-int(batch) // int(n))


def divide_batch(net_param, n):
    """Divide the batch of every data layer of ``net_param`` (in place) by ``n``, rounding
    up.  Returns [(layer name, old batch, new batch)] for the batches that ``n`` does not
    divide."""
    uneven = []

    def div(name, old):
        new = per_rank_batch(old, n)
        if new * n != old:
            uneven.append((name, old, new))
        return new

    for lp in net_param.layer:
        field = _BATCH_FIELDS.get(lp.type)
        if field is not None and lp.HasField(field):
            p = getattr(lp, field)
            if p.batch_size > 0:
                p.batch_size = div(lp.name, p.batch_size)
        elif lp.type == "DummyData":
            d = lp.dummy_data_param
            for shape in d.shape:
                if len(shape.dim):
                    shape.dim[0] = div(lp.name, shape.dim[0])
            for i in range(len(d.num)):
                d.num[i] = div(lp.name, d.num[i])
    return uneven


def _resolve(path, solver_dir):
    if os.path.exists(path) or solver_dir is None or os.path.isabs(path):
        return path
    alt = os.path.join(solver_dir, path)
    return alt if os.path.exists(alt) else path


def prepare_solver_param(param, n, source=None, warn=True):
    """A copy of SolverParameter ``param`` for ``n`` ranks: net files are read into the
    inline fields (``net`` -> ``net_param``, ``train_net`` -> ``train_net_param``,
    ``test_net`` -> ``test_net_param``, resolved as the Solver resolves them) and every data
    layer's batch is divided by ``n`` (rounded up; one warning lists the batches ``n`` does
    not divide)."""
    from ..proto import caffe_pb2
    p = caffe_pb2.SolverParameter()
    p.CopyFrom(param)
    solver_dir = os.path.dirname(os.path.abspath(source)) if source else None
    if p.HasField("net"):
        p.net_param.CopyFrom(read_net_param(_resolve(p.net, solver_dir)))
        p.ClearField("net")
    if p.HasField("train_net"):
        p.train_net_param.CopyFrom(read_net_param(_resolve(p.train_net, solver_dir)))
        p.ClearField("train_net")
    for f in p.test_net:
        p.test_net_param.add().CopyFrom(read_net_param(_resolve(f, solver_dir)))
    p.ClearField("test_net")
    uneven = []
    nets = [p.net_param] if p.HasField("net_param") else []
    nets += [p.train_net_param] if p.HasField("train_net_param") else []
    for net_param in nets + list(p.test_net_param):
        if n > 1:
            uneven += divide_batch(net_param, n)
    if uneven and warn:
        what = ", ".join(f"'{name}' {old} -> {new}" for name, old, new in uneven)
        log.warning("%d GPUs do not divide the batch of every data layer; each GPU takes the "
                    "batch rounded up, so the global batch grows (%s per GPU)", n, what)
    return p


def python_layers(param):
    """Names of the Python layers in every net of a prepared SolverParameter."""
    nets = [param.net_param, param.train_net_param] + list(param.test_net_param)
    return [lp.name for net in nets for lp in net.layer if lp.type == "Python"]


# -- logging: only the root logs INFO -------------------------------------------------------------
class _RootOnly(logging.Filter):
    def filter(self, record):
        return record.levelno >= logging.WARNING or context.root_solver()


@contextlib.contextmanager
def root_only_logging():
    """While inside, INFO lines from threads of non-root ranks are dropped (Caffe's
    ``LOG_IF(INFO, Caffe::root_solver())``); warnings and errors still show."""
    f = _RootOnly()
    log.logger.addFilter(f)
    try:
        yield
    finally:
        log.logger.removeFilter(f)


# -- one rank ----------------------------------------------------------------------------------------
def _high_priority_stream():
    return backend.new_stream(non_blocking=True, priority="highest")


def _capturing(stream):
    try:
        return stream.is_capturing()
    except AttributeError:  # pragma: no cover - old CuPy
        return False


def _async_get(dev, out, stream):
    """Device -> pinned host copy on ``stream`` without waiting for it."""
    try:
        dev.get(stream=stream, out=out, blocking=False)
    except TypeError:  # pragma: no cover - CuPy without ``blocking`` copies asynchronously
        dev.get(stream=stream, out=out)


def _batch_of(net):
    """Samples per forward: the first top of the first layer without bottoms."""
    for lid, layer in enumerate(net.layers):
        if not net.bottom_vecs[lid] and net.top_vecs[lid]:
            shape = net.top_vecs[lid][0].shape
            if shape:
                return int(shape[0])
    return 0


class P2PSync:
    """One rank: its solver, its communicator and its part of every collective.  Used as
    the solver's callback (``on_start``, ``on_gradients_ready``, ``gather_test_results``)
    and as the net's ``after_backward`` hook."""

    def __init__(self, manager, rank, device, solver=None):
        self.manager = manager
        self.rank = rank
        self.device = device
        self.solver = solver
        self.adopted = solver is not None
        self.comm = None
        self.host_comm = None
        self.plan = []
        self.images_per_s = 0.0
        self.exposed_ms = []   # per iteration: all-reduce time not hidden under backward
        self._pass = 0
        self._agreed = NONE
        self._n_ctrl = 0
        self._last_start = None
        self._tested = False
        self._n_timed, self._busy_s = 0, 0.0

    @property
    def gpu(self):
        return self.device is not None

    def _release_graphs(self):
        """Destroy this rank's captured graphs: NCCL's abort waits for every graph that
        holds the communicator's collectives to be gone."""
        st = self.solver.gpu_step if self.solver is not None else None
        if st is None:
            return
        try:
            st.release_graphs()
        except Exception as e:  # noqa: BLE001 - after a failure the device may be failing too
            log.warning("rank %d: releasing the CUDA graphs: %s", self.rank, e)

    # -- the thread ---------------------------------------------------------------------------
    def run(self):
        m = self.manager
        try:
            self._set_context()
            if self.solver is None:
                self.solver = m.build_solver(self.rank)
            if not self.solver.test_nets and len(self.solver.param.test_iter):
                self.solver.init_test_nets()  # every rank tests its own shard
            m.barrier()                 # every net (and data layer) is built
            self.comm = m.comm_kind(m.world_size, m.uid, self.rank)
            m.register_comm(self.comm)
            if m.host_world is not None:   # thread mode: host numbers sum on the host
                self.host_comm = comm_mod.FakeComm(m.world_size, m.host_world, self.rank)
                m.register_comm(self.host_comm)
            m.barrier()                 # every communicator is made
            self._attach()
            self._sync_start_state()
            self._train()
            self._report()
            self._release_graphs()
            self.comm.close()
        except BaseException as e:  # noqa: B902 - handed to the manager, never lost
            m.fail(self.rank, e)
            self._release_graphs()
        finally:
            if not self.adopted and self.solver is not None:
                self.solver.close()

    def _set_context(self):
        parent = self.manager.parent_state if self.adopted else None
        st = context.get()
        if self.gpu:
            context.set_device(self.device)
            context.set_mode_gpu()
        else:
            context.set_mode_cpu()
        context.set_solver_rank(self.rank)
        if parent is not None:  # the adopted solver keeps its generators
            st.seed, st._rng, st._gpu_rng = parent.seed, parent._rng, parent._gpu_rng

    def _attach(self):
        s = self.solver
        net = s.net
        self.flat = net.flat_params()
        self.plan = bucket_plan_for(net, s.param.reduce_buckets)
        self.by_layer = collections.defaultdict(list)
        for b in self.plan:
            self.by_layer[b.ready_layer].append(b)
        self.iter_size = s.param.iter_size
        self.scale = self.flat.dtype.type(1.0 / self.manager.world_size)
        self.batch = _batch_of(net)
        if self.rank == 0:
            for line in describe_plan(self.plan, net, self.flat.dtype.itemsize):
                log.info("P2PSync: %s", line)
        if self.gpu:
            cp = backend.gpu_module()
            self.compute = backend.current_stream()
            self.comm_stream = _high_priority_stream()
            self._ctrl_dev = [cp.zeros(2, np.float32) for _ in range(2)]
            self._ctrl_send = [backend.alloc_host(2, np.float32, pinned=True) for _ in range(2)]
            self._ctrl_host = [backend.alloc_host(2, np.float32, pinned=True) for _ in range(2)]
        else:
            self._ctrl_host = [np.zeros(2, np.float32) for _ in range(2)]
        self._ctrl_ready = [None, None]
        self._events = self._events_now = None
        self._comm_s = 0.0
        s.add_callback(self)
        net.add_hook("after_backward", self._after_backward)
        s.set_action_function(self._agreed_action)

    def _diff_array(self):
        if not self.flat.intact():
            raise MinicaffeError("a learnable parameter was reshaped during multi-GPU "
                                 "training; the flat gradient buffer no longer holds it")
        return self.flat.diff.mutable_gpu_data() if self.gpu else self.flat.diff.mutable_cpu_data()

    def _sync_start_state(self):
        """Rank 0's parameters, solver history, iteration and lr step go to every rank."""
        s = self.solver
        bufs = [self.flat.data] + [h.data for h in getattr(s, "history_flat", [])]
        arrays = [mem.mutable_gpu_data() if self.gpu else mem.mutable_cpu_data() for mem in bufs]
        if self.gpu:   # after any upload the compute stream has queued (a restore)
            self.comm_stream.wait_event(self.compute.record())
        for a in arrays:
            self.comm.bcast(a, 0, self.comm_stream if self.gpu else None)
        if self.gpu:
            self.comm_stream.synchronize()
        v = self._host_sum([s.iter, s.current_step] if self.rank == 0 else [0, 0])
        s.iter, s.current_step = int(v[0]), int(v[1])

    def _host_sum(self, values):
        """The sum over the ranks of a few host numbers.  On the GPU it runs on the
        communication stream, like every collective of this rank, after the compute
        stream's queued work."""
        if not self.gpu:
            return self.comm.allreduce_host(values)
        if self.host_comm is not None:
            return self.host_comm.allreduce_host(values)
        current = backend.current_stream()
        for stream in {id(current): current, id(self.compute): self.compute}.values():
            self.comm_stream.wait_event(stream.record())
        with self.comm_stream:
            return self.comm.allreduce_host(values)

    def _train(self):
        s = self.solver
        if self.rank == 0:
            s.solve()
        else:
            s.step(s.param.max_iter - s.iter)
            p = s.param
            if not s.requested_early_exit and p.test_interval and s.iter % p.test_interval == 0:
                s.test_all()

    # -- solver callbacks ---------------------------------------------------------------------
    def on_start(self):
        self._pass = 0
        self._diff = self._diff_array()
        # images/s: the time from one iteration's start to the next, after two warm-up
        # iterations, leaving out the intervals that held a test pass
        now = time.perf_counter()
        if self._last_start is not None and not self._tested:
            self._n_timed += 1
            if self._n_timed > 2:
                self._busy_s += now - self._last_start
        self._last_start, self._tested = now, False

    def _after_backward(self, layer_index):
        if self._pass < self.iter_size - 1:   # accumulate locally; reduce in the last pass
            if layer_index == 0:
                self._pass += 1
            return
        if not self.gpu:
            for b in self.by_layer.get(layer_index, ()):
                self._reduce(b)
            return
        # the stream the backward runs on (the null stream, or a GPU step's own stream)
        self.compute = backend.current_stream()
        bwd_end = None
        if layer_index == 0 and self.manager.measure and not _capturing(self.compute):
            bwd_end = self.compute.record()
        for b in self.by_layer.get(layer_index, ()):
            self._reduce(b)
        if layer_index == 0:
            # join: the compute stream (so the update) waits for the last reduction, by
            # an event; inside a CUDA-graph capture this joins the forked comm stream
            done = self.comm_stream.record()
            self.compute.wait_event(done)
            if bwd_end is not None:
                self._events_now = (bwd_end, done)

    def _reduce(self, b):
        sl = self._diff[b.start:b.stop]
        if self.gpu:
            self.comm_stream.wait_event(self.compute.record())
            self.comm.allreduce(sl, self.comm_stream)
            with self.comm_stream:
                sl *= self.scale
        else:
            t0 = time.perf_counter()
            self.comm.allreduce(sl)
            sl *= self.scale
            self._comm_s += time.perf_counter() - t0

    def on_gradients_ready(self):
        """Before the update (the reductions were joined at the end of backward): agree
        on stop/snapshot."""
        if not self.gpu:
            self.exposed_ms.append(self._comm_s * 1e3)
            self._comm_s = 0.0
        self.agree()

    # -- agreeing on stop / snapshot ----------------------------------------------------------
    def agree(self):
        """Contribute this rank's request to a 2-number all-reduce (snapshot, stop) and act
        on the previous iteration's result, which is long done: the host never waits.
        Host work (it reads pinned memory): outside a captured graph, after its launch."""
        req = self.manager.take_request(self)
        slot, prev = self._n_ctrl % 2, (self._n_ctrl + 1) % 2
        self._n_ctrl += 1
        # a snapshot is the root's to ask for: one Ctrl-C reaches every process (the
        # launcher forwards it), and their requests would land in different iterations
        vals = [float(req == SNAPSHOT and self.rank == 0), float(req == STOP)]
        result = None
        if self.gpu:
            if self._ctrl_ready[prev] is not None:
                self._ctrl_ready[prev].synchronize()
                result = np.array(self._ctrl_host[prev])
                if self._events is not None:  # the previous iteration's: complete
                    bwd_end, done = self._events
                    bwd_end.synchronize()
                    self.exposed_ms.append(max(0.0, backend.elapsed_ms(bwd_end, done)))
            self._events, self._events_now = self._events_now, None
            self._ctrl_send[slot][...] = vals
            # after this iteration's reductions (and in a captured graph, after its launch)
            self.comm_stream.wait_event(self.compute.record())
            dev = self._ctrl_dev[slot]
            dev.set(self._ctrl_send[slot], stream=self.comm_stream)
            self.comm.allreduce(dev, self.comm_stream)
            _async_get(dev, self._ctrl_host[slot], self.comm_stream)
            self._ctrl_ready[slot] = self.comm_stream.record()
        else:
            if self._ctrl_ready[prev] is not None:
                result = np.array(self._ctrl_host[prev])
            a = np.array(vals, np.float32)
            self.comm.allreduce(a)
            self._ctrl_host[slot][...] = a
            self._ctrl_ready[slot] = True
        if result is not None:
            if result[1] > 0:
                self._agreed = STOP
            elif result[0] > 0 and self.rank == 0:
                self._agreed = SNAPSHOT

    def _agreed_action(self):
        """The solver's action function: the agreed request, once."""
        a, self._agreed = self._agreed, NONE
        return a

    # -- test --------------------------------------------------------------------------------------
    def gather_test_results(self, loss, scores, n_iter):
        """Every rank tested its own shard: sum the loss and scores over the ranks."""
        self._tested = True
        v = self._host_sum([loss] + [float(x) for x in scores])
        return float(v[0]), [np.float32(x) for x in v[1:]], n_iter * self.manager.world_size

    # -- the end ------------------------------------------------------------------------------------
    def _report(self):
        n_timed = self._n_timed - 2
        if n_timed > 0 and self._busy_s > 0:
            self.images_per_s = self.batch * self.iter_size * n_timed / self._busy_s
        w = self.manager.world_size
        rates = np.zeros(w)
        rates[self.rank] = self.images_per_s
        exposed = np.zeros(w)
        tail = self.exposed_ms[2:] if len(self.exposed_ms) > 2 else self.exposed_ms
        exposed[self.rank] = float(np.mean(tail)) if tail else 0.0
        v = self._host_sum(np.concatenate([rates, exposed]))
        self.manager.rates, self.manager.exposed = v[:w], v[w:]
        if self.rank == 0:
            for r in range(w):
                log.info("P2PManager: rank %d: %.1f images/s", r, v[r])
            log.info("P2PManager: total %.1f images/s on %d ranks; all-reduce not hidden under "
                     "backward: %.3f ms per iteration (mean over ranks)", float(v[:w].sum()), w,
                     float(v[w:].mean()))


# -- the manager -------------------------------------------------------------------------------------
class P2PManager:
    """Runs ``len(devices)`` ranks of data-parallel training in threads of this process.

    ``root_solver`` is adopted by the first local rank; the other local ranks build their
    own solver (same class and parameters).  ``devices``: a GPU id per local rank, or None
    for CPU ranks (which need a FakeComm).  For process mode, ``world_size`` and
    ``first_rank`` place the local ranks in a larger world and ``uid`` is the id shared by
    the launcher; ``abort_channel`` carries a failure to and from the other processes.
    ``action_function`` (default: the root solver's) is polled from this thread: signals
    reach only the main thread."""

    poll_s = 0.05

    def __init__(self, root_solver, devices, world_size=None, first_rank=0, uid=None,
                 comm_kind=None, action_function=None, abort_channel=None, grace_s=30.0,
                 measure=True):
        self.devices = list(devices)
        if not self.devices:
            raise MinicaffeError("P2PManager needs at least one device")
        gpu = self.devices[0] is not None
        if any((d is not None) != gpu for d in self.devices):
            raise MinicaffeError("P2PManager: mix of GPU and CPU ranks")
        dups = sorted({d for d in self.devices if d is not None and self.devices.count(d) > 1})
        if dups:
            raise MinicaffeError(f"GPU {dups[0]} is given to more than one rank")
        self.world_size = int(world_size or len(self.devices))
        if root_solver.config.world_size != self.world_size:
            raise MinicaffeError(f"the root solver was built for {root_solver.config.world_size}"
                                 f" rank(s) but the run has {self.world_size}: build it with "
                                 f"config=RunConfig(world_size={self.world_size}) (or, as in "
                                 f"pycaffe, call set_solver_count({self.world_size}) before "
                                 "building it): its data layers pick their shard when they "
                                 "are set up")
        self.comm_kind = comm_kind or (comm_mod.NcclComm if gpu else comm_mod.FakeComm)
        self.uid = uid if uid is not None else self.comm_kind.new_uid(self.world_size)
        self.parent_state = context.get()
        self.solver_class = type(root_solver)
        self.solver_param = root_solver.param
        self.solver_source = root_solver.source
        self.config = root_solver.config
        self.action_function = action_function or root_solver.action_request_function
        self.abort_channel = abort_channel
        self.grace_s = grace_s
        self.measure = measure
        self._barrier = threading.Barrier(len(self.devices))
        # every rank a thread of this process (thread mode, GPU): sums of a few host
        # numbers (start state, test scores) go through the host, not through NCCL and
        # blocking device copies that one thread can wait on while its peer cannot launch
        self.host_world = (comm_mod.FakeComm.new_uid(self.world_size)
                           if gpu and self.world_size == len(self.devices) else None)
        self._lock = threading.Lock()
        self._comms = []
        self._requests = []
        self.failure = None        # (rank or None, exception, message)
        self.failed_at = None
        self.rates = self.exposed = None
        self.syncs = [P2PSync(self, first_rank + i, d, root_solver if i == 0 else None)
                      for i, d in enumerate(self.devices)]

    # -- used by the ranks ----------------------------------------------------------------------
    def build_solver(self, rank):
        return self.solver_class(self.solver_param, source=self.solver_source,
                                 config=self.config.replace(rank=rank))

    def barrier(self):
        """All local ranks meet (a blocking wait, no polling); aborted on failure."""
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise comm_mod.CommAborted("a barrier was aborted") from None

    def register_comm(self, c):
        with self._lock:
            self._comms.append(c)
            failed = self.failure is not None
        if failed:
            c.abort()

    def take_request(self, sync):
        """The first local rank hands in this process's pending stop/snapshot request."""
        if sync is not self.syncs[0]:
            return NONE
        with self._lock:
            if not self._requests:
                return NONE
            reqs, self._requests = self._requests, []
        return STOP if STOP in reqs else SNAPSHOT

    def post_request(self, action):
        action = str(action or NONE).lower()
        if action in (STOP, SNAPSHOT):
            with self._lock:
                self._requests.append(action)

    def fail(self, rank, exc, message=None, remote=False):
        """Record the run's first failure and abort every collective and barrier.  In
        process mode a failure another process already published is the run's failure (an
        aborted collective here is only its echo)."""
        if self.abort_channel is not None and not remote and self.failure is None:
            echo = _is_comm_failure(exc)
            deadline = time.monotonic() + (2.0 if echo else 0.0)
            while True:
                published = self.abort_channel.poll()
                if published is not None or time.monotonic() >= deadline:
                    break
                time.sleep(self.poll_s)
            if published is not None:
                message, remote = published, True
        with self._lock:
            first = self.failure is None
            if first:
                if message is None:
                    message = _failure_message(self, rank, exc)
                self.failure = (rank, exc, message)
                self.failed_at = time.monotonic()
            comms = list(self._comms)
        if not first:
            return
        if self.abort_channel is not None and not remote:
            self.abort_channel.signal(message)
        self._barrier.abort()
        for c in comms:
            c.abort()

    # -- the main thread ----------------------------------------------------------------------------
    def run(self):
        """Train to the end on every local rank; raises ParallelError on a failure."""
        with root_only_logging():
            threads = [threading.Thread(target=s.run, name=f"P2PSync-{s.rank}", daemon=True)
                       for s in self.syncs]
            for t in threads:
                t.start()
            interrupted = False
            while any(t.is_alive() for t in threads):
                try:
                    next(t for t in threads if t.is_alive()).join(self.poll_s)
                    self._poll()
                except KeyboardInterrupt:
                    interrupted = True
                    self.fail(None, KeyboardInterrupt(), "interrupted")
                if self.failed_at is not None and \
                        time.monotonic() - self.failed_at > self.grace_s:
                    alive = [s.rank for s, t in zip(self.syncs, threads) if t.is_alive()]
                    log.warning("ranks %s did not end within %.0f s of the failure",
                                alive, self.grace_s)
                    break
        if interrupted:
            raise KeyboardInterrupt
        if self.failure is not None:
            rank, exc, message = self.failure
            raise ParallelError(message) from (exc if isinstance(exc, BaseException) else None)
        return self

    def _poll(self):
        if self.action_function is not None and self.failure is None:
            self.post_request(self.action_function())
        if self.abort_channel is not None and self.failure is None:
            msg = self.abort_channel.poll()
            if msg is not None:
                self.fail(None, None, msg, remote=True)


def _is_comm_failure(exc):
    """An error a collective raises when a peer failed (ours, NCCL's or CUDA's)."""
    return isinstance(exc, comm_mod.CommAborted) or \
        type(exc).__name__ in ("NcclError", "CUDARuntimeError", "CUDADriverError")


def _failure_message(manager, rank, exc):
    if rank is None:
        where = "the run"
    else:
        i = rank - manager.syncs[0].rank
        dev = manager.devices[i] if 0 <= i < len(manager.devices) else None
        where = f"rank {rank} ({'GPU %d' % dev if dev is not None else 'CPU'})"
    if isinstance(exc, MinicaffeError):
        text = str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return f"{where}: {text}".replace("\n", " ")


# -- the whole run in threads ---------------------------------------------------------------------
def train_threads(solver_param, devices, source=None, snapshot=None, weights=None,
                  action_function=None, comm_kind=None, progress=None, grace_s=30.0,
                  config=None):
    """Data-parallel training with one thread per device (GPU ids, or None for CPU ranks
    with a FakeComm); the global batch is the prototxt's.  ``progress(root_solver)`` may
    return a progress bar (``update(n)``).  ``config``: the run's RunConfig (the CLI's; the
    environment's by default), its ranks and devices set here.  Returns the P2PManager
    (its ``rates``, ``exposed`` and ``syncs[0].solver``, the root solver)."""
    from ..solvers import solver_class
    n = len(devices)
    param = prepare_solver_param(solver_param, n, source)
    py = python_layers(param)
    if py and n > 1:
        raise ConfigError(f"Python layer '{py[0]}' cannot run on several ranks in one process "
                          "(the ranks would share one interpreter and the layer's module "
                          "state, which Caffe refuses too): use the process mode "
                          "(--parallel process), one process per GPU")
    saved = context.solver_count()
    context.set_solver_count(n)
    context.set_shard_test(True)
    solver = None
    try:
        if devices[0] is not None:
            context.set_device(devices[0])
            context.set_mode_gpu()
        else:
            context.set_mode_cpu()
        context.set_solver_rank(0)
        from ..core.config import RunConfig
        config = (config or RunConfig.from_environment()).replace(world_size=n, rank=0)
        solver = solver_class(param.type, source or "solver")(param, source=source,
                                                              config=config)
        if progress is not None:
            solver.progress = progress(solver)
        if snapshot:
            log.info("Resuming from %s", snapshot)
            solver.restore(snapshot)
        elif weights:
            solver.copy_weights(weights)
        manager = P2PManager(solver, devices, comm_kind=comm_kind,
                             action_function=action_function, grace_s=grace_s)
        return manager.run()
    finally:
        context.set_solver_count(saved)
        context.set_shard_test(False)
        if solver is not None:
            solver.close()
