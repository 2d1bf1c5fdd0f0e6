"""The training iteration on the GPU, run eagerly or captured once as CUDA graphs and
replayed (Caffe's Solver::Step body, for the SGD family of solvers).

One iteration: clear the parameter diffs; ``iter_size`` times {the data layers' forward,
then forward and backward of the rest}; the update.  Here it is cut into

- the *prologue*: the data layers at the head of the net (``Layer.graph_prologue``), whose
  forward is host work and a copy into their tops.  It runs eagerly before each
  forward-backward, on the step's stream, into tops at fixed addresses;
- the *body*: forward of the other layers, each loss added into a host-visible ring,
  backward, and (when nothing has to run between backward and the update) the fused
  update and the iteration counter.  Without ``on_gradients_ready`` callbacks and with
  iter_size 1 one iteration is one graph launch.

A body is captured once per segment and input shapes, after one eager warm-up run of it
(which compiles the kernels, picks cuDNN's algorithms and makes every persistent
buffer), into a CUDA graph with its own memory pool for the temporaries made while
capturing (PyTorch's rule: nothing else may reuse those addresses), then replayed.  A
layer that cannot be captured (``Layer.capturable`` false: a Python layer, say) turns
graphs off for the net with one log line, and the same body runs eagerly.

Per-iteration scalars (the learning rate, Adam's correction) are written by the host
into a slot of a mapped ring that the update kernel reads through the device's iteration
counter; losses and gradient norms come back through two more rings.  The host reads
them only at log points (display, test, snapshot, the end of ``step``), so it runs up to
``RING`` iterations ahead of the GPU and never waits in between.  Eager and replayed
iterations execute the same kernels in the same order: the same bits come out.

fp16 loss scaling (``solver.loss_scaler``) runs on the device as well
(engine/precision.DeviceLossScale): the loss gradient times the device's scale, the diffs
unscaled and checked into a flag that the update kernel reads (a step with a non-finite
gradient changes nothing), the scale moved by array operations inside the body; the host
reads the scale and the skipped steps only at display and snapshot.
"""
import collections

import numpy as np

from ..core import backend, context, log
from ..core import precision as P
from ..core.blob import Blob
from ..gpu import graph as cuda_graph
from ..gpu.host import HostRing
from ..kernels import step as step_kernels
from .executor import run_ops
from .schedule import Schedule, schedule_for
from ..core.synced_memory import SyncedMemory, HEAD_AT_CPU

RING = 64
N_SCALARS = 2   # learning rate, Adam's bias correction


def why_not_capturable(net, first_body):
    """None when layers [first_body, end) can all be captured, else the reason."""
    for i in range(first_body, len(net.layers)):
        layer = net.layers[i]
        if layer.graph_prologue:
            return f"data layer '{layer.name}' ({layer.type}) is not at the head of the net"
        if not layer.capturable:
            return f"layer '{layer.name}' ({layer.type}) cannot be captured"
    return None


class GpuStep:
    """The GPU iteration of ``solver`` (see the module docstring)."""

    def __init__(self, solver, graphs=True):
        cp = backend.gpu_module()
        self.solver = solver
        net = self.net = solver.net
        self.update = solver.fused_update()   # the solver's update op (solvers/fused.py)
        p = solver.param
        self.iter_size = p.iter_size
        self.clip = p.clip_gradients >= 0
        self.sched = HostRing(RING * N_SCALARS, np.float32)
        self.losses = HostRing(RING, np.float64)
        self.norms = HostRing(RING, np.float32)
        self.counter = cp.zeros(1, dtype=np.int64)
        self.scalars = cp.zeros(N_SCALARS, dtype=np.float32)
        self.sumsq = cp.zeros(1, dtype=np.float32)
        self.partial = cp.zeros(step_kernels.SUMSQ_BLOCKS, dtype=np.float64)
        # fp16 loss scaling on the device (engine/precision.py): the loss gradient scaled,
        # the diffs unscaled and checked, the update skipped, the scale moved, no host read
        scaler = getattr(solver, "loss_scaler", None)
        self.loss_scale = scaler.to_device(cp) if scaler is not None else None
        self.stream = context.kept_stream("step")
        self.launched = 0
        self.pending = collections.deque()
        n = 0
        while n < len(net.layers) and net.layers[n].graph_prologue:
            n += 1
        self.first_body = n
        produced = set()
        inputs = []
        for i in range(n, len(net.layers)):
            for b in net.bottom_vecs[i]:
                if id(b) not in produced and all(b is not x for x in inputs):
                    inputs.append(b)
            for t in net.top_vecs[i]:
                produced.add(id(t))
        self.input_blobs = inputs
        self.schedule = schedule_for(net)     # one pass: the solver loops over iter_size
        # its prologue ops (the data layers), run eagerly before the body each time
        self.prologue = Schedule([op for op in self.schedule if op.kind == "prologue"])
        reason = why_not_capturable(net, n)
        if reason is None and self.iter_size > 1 and solver.config.world_size > 1:
            # the all-reduce runs in the last of iter_size passes only: a pass's graph
            # would carry the choice made when it was captured
            graphs_reason = "several GPUs with iter_size > 1"
        else:
            graphs_reason = reason
        self.graphs_on = bool(graphs) and graphs_reason is None
        self.plan = None
        self.wcast = None
        self.offload = None
        if reason is None:
            # every layer declares what it keeps: activations' diffs can share memory
            from .offload import Offloader, settings
            from .plan import memory_pass
            # bf16/fp16: feature maps in 2-byte buffers (engine/precision.py), unless
            # offloaded (its copies move fp32 buffers)
            policy, budget = settings(net.net_param, net.config)
            # --share_data (minicaffe train's default; RunConfig.share_data): blob data
            # that no backward reads shares memory too, as PyTorch frees such tensors
            # (pycaffe's default keeps every blob's data after a step, as Caffe); not
            # with offload, whose plans move whole feature maps
            lean = net.config.shares_data and policy == "NONE" and not budget
            self.plan = memory_pass(self.schedule, net, train=True,
                                    history_sets=len(solver.history_flat), share_data=lean,
                                    reduced_storage=policy == "NONE" and not budget)
            # offload_param: a plan whose offloaded feature maps live twice (offload.py)
            self.offload = Offloader.for_step(self)
            self.plan.apply()
            if self.offload is not None:
                self.offload.attach()
            # the shared buffers at their final sizes now, not grown layer by layer (cuDNN's
            # workspaces are the plan's, in the arena: engine/plan.py)
            from ..layers.cudnn_layers import LAYER_SCRATCH, scratch
            if self.plan.scratch_bytes:
                scratch(LAYER_SCRATCH, self.plan.scratch_bytes)
            self._weight_cast()
            mib = 1 << 20
            log.info("Memory plan of net %s: %.1f MiB of activations and diffs in one arena "
                     "(%.1f MiB unshared%s); planned peak %.1f MiB", net.name,
                     self.plan.arena_bytes / mib, self.plan.unshared_bytes / mib,
                     "; blob data no backward reads shares memory: --share_data"
                     if lean else "", self.plan.peak / mib)
        # the data layers' tops at fixed places (a replayed graph reads them there, and
        # the host runs ahead): the plan's arena places, else device memory of their own
        self.input_places = {}
        for i in range(n):
            for t in net.top_vecs[i]:
                m = t.data_mem
                if not isinstance(m, SyncedMemory) or m.size == 0:
                    continue
                if not m.planned:
                    m.bind_device(backend.alloc_gpu(m.size, m.dtype))
                self.input_places.setdefault(i, []).append([t, m.device_array])
        if graphs and graphs_reason:
            log.info("CUDA graph: off for net %s: %s; the iteration runs eagerly",
                     net.name, graphs_reason)
        if reason:
            from .offload import settings
            if settings(net.net_param, net.config)[0] != "NONE":
                log.warning("offload_param: no offload for net %s (it needs the memory plan, "
                            "made only for nets whose iteration can be captured: %s)",
                            net.name, reason)
        self.graphs, self.pools, self.warm = {}, {}, set()
        self.shapes = None
        self.mems = []
        self._h2d = None

    def _weight_cast(self):
        """The plan's ``one_cast`` (a small net's 2-byte weight copies) as one launch
        (kernels/wcast.py), run at the start of each forward-backward pass; None when the
        layers cast their own."""
        self.wcast = None
        one = getattr(self.plan, "one_cast", None)
        if not one:
            return
        from ..kernels.wcast import WeightCast
        entries = []
        for layer, s, w in one:
            src = layer.blobs[0].gpu_data()
            bt = P.buffer_dtype(s)
            dst = w.device_array[:src.size * bt.itemsize].view(bt)
            entries.append((src, dst, layer.weight_copy_dims()))
        self.wcast = WeightCast(entries, one[0][1]) if \
            len({s for _, s, _ in one}) == 1 else None
        if self.wcast is None:      # two 2-byte types in one net: the layers cast
            self.plan.one_cast = []
            return
        log.info("Weights of net %s: %d layers' %s copies (%.1f KiB) cast in one launch a "
                 "step", self.net.name, len(entries), one[0][1],
                 self.wcast.nbytes / 1024)

    # -- the host's side of an iteration ------------------------------------------------
    def full(self):
        return len(self.pending) >= RING

    def begin(self, rate, extra=0.0):
        """Start an iteration with learning rate ``rate`` (and the rule's per-iteration
        scalar ``extra``).  The caller drains first when ``full()``."""
        if self.full():
            raise RuntimeError("GpuStep.begin: the ring is full; drain() first")
        slot = self.launched % RING
        self.sched.host[slot * N_SCALARS] = np.float32(rate)
        self.sched.host[slot * N_SCALARS + 1] = np.float32(extra)
        self.losses.host[slot] = 0.0
        self.norms.host[slot] = 0.0
        self.pending.append([None, slot, None])
        # work queued on the default stream (a test pass, user code) comes first
        self.stream.wait_event(backend.null_stream().record())

    def forward_backward(self, first, with_update):
        net = self.net
        if self._h2d is not None:   # the host may write the inputs again only once the
            self._h2d.synchronize()  # copy of their last contents has run
            self._h2d = None
        with self.stream:
            for i in range(self.first_body):
                self._note_places(i)
            # the prologue ops through the same walker, eagerly, nothing read back
            run_ops(self.prologue, net, (0, None, 1))
            for i in range(self.first_body):
                self._tops_in_place(i)
            self._prepare()
            self._run(("fb", bool(first), bool(with_update)))

    def replan(self, plan):
        """Put ``plan`` in force in place of the present one (offload's re-plan after its
        timed iteration): the old arena goes back before the new one is made -- the data
        tops' fixed places in it are let go first and follow them into the new one."""
        for entries in self.input_places.values():
            for entry in entries:
                if entry[0].data_mem.planned:
                    entry[1] = None
        self.plan.release()
        backend.let_freed_go()   # the old arena is gone before the new one is made
        self.plan = plan
        plan.apply()       # (an offload plan holds fp32 maps: no 2-byte weight copies)
        for i in range(self.first_body):
            self._note_places(i)

    def _note_places(self, i):
        """Before data layer i's forward: a top placed now (by the plan in force, or by
        this step) keeps that place; one pointed elsewhere since (a user's forward
        between iterations) goes back to the place it had."""
        for entry in self.input_places.get(i, ()):
            m = entry[0].data_mem
            if isinstance(m, SyncedMemory) and m.planned:
                entry[1] = m.device_array

    def _tops_in_place(self, i):
        """Data layer i's tops back at their fixed places: a top its forward pointed at a
        batch's buffer (data/prefetch.py hands batches over so) is copied there, on the
        step's stream; a top written in place needs nothing.  (This replaces a flag the
        step used to set on the data layers.)"""
        for entry in self.input_places.get(i, ()):
            t, place = entry
            m = t.data_mem
            if not isinstance(m, SyncedMemory) or (place is not None and
                                                   m.device_array is place):
                continue
            if place is None or m.size > place.size:
                # a larger batch: a larger place of its own (the input shapes changed, so
                # the graphs are captured anew, at this address); None: the place was in
                # an arena a new plan replaced (``replan``)
                place = entry[1] = backend.alloc_gpu(m.size, m.dtype)
            place[:m.size] = m.gpu_data()[:m.size]
            m.bind_device(place, keep_contents=False)

    def apply_update(self):
        with self.stream:
            self._prepare()
            self._run(("update",))

    def release_graphs(self):
        """Destroy the captured graphs (the next iteration captures again).  NCCL's abort
        and destroy wait until every graph holding a communicator's collectives is gone,
        so a multi-GPU rank calls this before closing its communicator."""
        backend.synchronize()
        self.graphs, self.warm = {}, set()
        self.shapes = None
        backend.synchronize()   # CUDA runs the graphs' release callbacks

    def abandon(self):
        """Forget the iteration begun last (a stop ended its data wait): no update ran,
        the counter did not move, its ring slot is used again."""
        if self.pending and self.pending[-1][0] is None:
            self.pending.pop()

    def end(self, iteration):
        """Finish iteration ``iteration``: later default-stream work waits for it."""
        ev = self.stream.record()
        backend.null_stream().wait_event(ev)
        if self.pending and self.pending[-1][0] is None:
            self.pending[-1][0] = iteration
            self.pending[-1][2] = ev
        self.launched += 1

    def drain(self, current=None):
        """Wait for the pending iterations (``current`` names the one begun but not yet
        ended, if any); raise what the layers found on the device; return
        [(iteration, summed loss, gradient norm)] oldest first."""
        out = []
        while self.pending:
            it, slot, ev = self.pending.popleft()
            if ev is None:
                self.stream.synchronize()
                it = current
            else:
                ev.synchronize()
            out.append((it, float(self.losses.host[slot]), float(self.norms.host[slot])))
        for layer in self.net.layers:
            layer.check_deferred()
        return out

    # -- the device's side ---------------------------------------------------------------
    def _prepare(self):
        """Bring what the body reads to the device (a user may have written inputs or
        weights on the host since the last iteration)."""
        copied = False
        for b in self.input_blobs:
            copied |= b.data_mem.head == HEAD_AT_CPU
            b.gpu_data()
        if copied:
            self._h2d = self.stream.record()
        self.update.flat.data.mutable_gpu_data()
        self.update.flat.diff.mutable_gpu_data()
        for h in self.update.hist:
            h.data.mutable_gpu_data()

    def _body(self, key):
        net = self.net
        if key[0] == "fb":
            _, first, with_update = key
            if first:
                self.update.flat.diff.mutable_gpu_data().fill(0)
            off = self.offload
            if off is not None:          # the offload copies run from the layer hooks
                off.begin()
            # the schedule's forward and backward ops, the losses into the ring (the one
            # walker of engine/executor.py, here eagerly or under capture); a small net's
            # weights cast to their 2-byte copies in one launch first (plan's one_cast)
            cast = [] if self.wcast is None else self.plan.one_cast
            if cast:
                self.wcast()
            for layer, s, _ in cast:
                layer.weights_cast_by(s)
            try:
                run_ops(self.schedule, net, (self.losses.ptr, self.counter, RING),
                        self.first_body)
            finally:
                for layer, _, _ in cast:
                    layer.weights_cast_by(None)
            if off is not None:
                off.end()
            if with_update:
                self._update_body()
        else:
            self._update_body()

    def _update_body(self):
        ls = self.loss_scale
        if ls is not None:     # before the norm: clipping reads the unscaled diffs
            ls.unscale(self.update.flat.diff.mutable_gpu_data())
        sumsq = None
        if self.clip:
            step_kernels.sumsq(self.update.flat.diff.mutable_gpu_data(), self.partial, self.sumsq,
                               self.norms.ptr, self.counter, RING)
            sumsq = self.sumsq
        step_kernels.fetch_and_advance(self.counter, self.sched.ptr, N_SCALARS, RING, self.scalars)
        self.update.launch(self.scalars, sumsq, ls.found if ls is not None else None)
        if ls is not None:
            ls.update_state()

    def _shape_key(self):
        return tuple(b.shape for b in self.input_blobs)

    def _run(self, key):
        off = self.offload
        if off is not None and off.profiling_due(key, not self.graphs_on or key in self.warm):
            off.profile(lambda: self._body(key))   # timed; DYNAMIC's plan replaces ALL's
            self.graphs = {}
            return
        if not self.graphs_on:
            self._body(key)
            return
        shapes = self._shape_key()
        if shapes != self.shapes:
            self.graphs, self.warm = {}, set()
            self.shapes = shapes
        g = self.graphs.get(key)
        if g is None:
            if key not in self.warm:
                # warm-up: kernels, algorithms, persistent buffers; from the graph's own
                # pool, so that what capture replaces is freed there, not into a
                # stream-ordered pool from inside a capture
                pool = self.pools.setdefault(key, cuda_graph.private_pool())
                with cuda_graph.allocating_from(pool):
                    self._body(key)
                self.warm.add(key)
                return
            g = self._capture(key)
            if g is None:                # capture failed: graphs are off from now on
                self._body(key)
                return
        g.launch(self.stream)
        for m in self.mems:
            m.device_written()
        if off is not None:
            off.park()

    def private_bytes(self):
        """Device bytes held by the graphs' own pools (outside the main allocator)."""
        return sum(p.total_bytes() for p in self.pools.values())

    def _capture(self, key):
        pool = self.pools.setdefault(key, cuda_graph.private_pool())
        try:
            graph = cuda_graph.capture(self.stream, pool, lambda: self._body(key))
        except Exception as e:
            self.graphs_on = False
            log.warning("CUDA graph: capturing net %s failed (%s: %s); running eagerly",
                        self.net.name, type(e).__name__, e)
            return None
        self.graphs[key] = graph
        self.pools[key] = pool
        self.mems = self._written_memories()
        if len(self.graphs) == 1:
            log.info("CUDA graph: the training iteration of net %s is captured and replayed "
                     "(%d layers in the graph, %d data layer(s) before it)", self.net.name,
                     len(self.net.layers) - self.first_body, self.first_body)
        return graph

    def _written_memories(self):
        """Every SyncedMemory with a device side that a replay may write, so that the host
        knows the device copy is the newest after each replay."""
        seen, out = set(), []

        def add(m):
            if isinstance(m, SyncedMemory) and m.device_array is not None and id(m) not in seen:
                seen.add(id(m))
                out.append(m)

        for b in self.net._blobs:
            add(b.data_mem)
            add(b.diff_mem)
        for layer in self.net.layers:
            for v in vars(layer).values():
                for b in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(b, Blob):
                        add(b.data_mem)
                        add(b.diff_mem)
        add(self.update.flat.data)
        add(self.update.flat.diff)
        for h in self.update.hist:
            add(h.data)
        return out
