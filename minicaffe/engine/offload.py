"""Offload of feature maps to host memory for the GPU training step (vDNN, Rhu et al.).

A feature map that backward needs much later leaves the GPU during forward and comes
back just in time during backward, so the device holds only a window of layers.  Here
that is a transformation of the step's memory plan (engine/plan.py) and of its schedule,
not a branch inside any layer:

- **the plan**: an offloaded data buffer (a SyncedMemory, counted once however many
  blobs share it: Split tops, in-place layers) gets two device lives instead of one
  for the whole iteration -- *forward*, from its first writer to its last forward reader,
  and *backward*, from its prefetch point to its last backward reader -- each placed on
  its own in the arena's shared region, plus a slot in a pinned host slab of our own
  (one ``cudaHostAlloc``, not CuPy's power-of-two pinned pool);
- **the schedule** (``Schedule``): after the last forward writer of a buffer, a
  device-to-host copy on one of two copy streams (``choose_lanes``: the maps the
  backward needs first beside the large early ones, not behind them), issued in pieces
  of ``COPY_CHUNK``, started by an event from the compute stream and overlapping the
  next layers' compute; the compute stream waits for that copy (an event)
  only before the first step that reuses the buffer's place in the arena.  During
  backward, a host-to-device copy on a second copy stream, issued where the paper's
  ``findPrefetchLayer`` says (while the nearest layer above with offloaded input runs,
  never searching past a convolution), waited for by the compute stream right before the
  first backward reader.  No device-wide synchronisation anywhere.  The same calls are
  captured into the step's CUDA graph (the copy streams fork from and join back into the
  capturing stream through events) or run eagerly when graphs are off;
- **the policies** (``offload_param { policy }`` of the NetParameter, or ``--offload``):
  NONE; ALL (every feature map that can leave: not the inputs, outputs or losses); CONV
  (the inputs of convolution layers, vDNN_conv); DYNAMIC: if the plan of NONE fits the
  budget nothing moves; otherwise the first iterations run under ALL, one of them timed
  layer by layer with CUDA events, and then buffers are offloaded one at a time, those
  live at the planned peak first, only where the copies hide under compute (a timeline
  model of the compute and copy streams at ``D2H_BYTES_PER_S``/``H2D_BYTES_PER_S``) until
  the planned peak fits ``gpu_memory_budget``; then the chosen maps whose stretch off
  the device fits the budget stay on it (``keep_on_device``);
- **hiding the copies** (``hide_copies``): the lives then grow where the copies need
  time and the budget (or, without one, the plan's own peak) allows -- a copy back
  starting before vDNN's point, a forward place held while its copy out runs -- in the
  way the timeline model finds shortest, from estimated step times and then, for every
  policy, from one timed iteration (the plan is made again);
- **the budget** (``--gpu_mem_limit 12GiB``/``auto``: ``resolve_budget``): a budget
  under the plan's peak but over the floor fetches maps on demand rather than ahead
  (``_fetch_on_demand``); cuDNN's workspaces are buffers of the plan, each live at its
  own step (engine/plan.py), and where a step's floor is over the budget that step's
  convolution takes a smaller one (``fit_workspace``, per step); ``floor_parts`` says
  what the floor is made of;
- **recomputation** (``choose_recompute``): a map whose producers may run again
  (``RECOMPUTABLE``: convolution, ReLU, pooling, LRN) may be dropped after its last
  forward reader and made again right before its first backward reader instead of
  copied out and back, where the timeline model says that is shorter within the memory
  (VGG-16's conv1_1: ~3 ms of convolution against ~2 x 60 ms of link), its recomputed
  inputs made on the way where that is shorter or keeping them does not fit
  (``through_chain``), what a recompute takes counted right before its reader's step
  (``recompute_fits``, ``plan.Buffer.boundary``);
- **the timeline** (``Timeline``, ``trace_iteration``): CUDA events on the compute and
  both copy streams over one eager forward-backward, for benchmarks/offload.py, with
  ``budget_bound``, the least time any copy schedule could take within a budget.

What the plan does not hold stays where it was: parameters, their diffs and the solver's
history, what layers keep from forward to backward (``Layer.state_bytes``).  After a step an offloaded blob's host side is its slot in the
slab (what pycaffe reads after ``step()`` is Caffe's value) and it has no device side.
Offload changes no number: the same kernels run on the same values.

Everything down to ``Offloader`` is pure Python over a MemoryPlan and runs (and is
tested) without a GPU; ``Offloader`` is the CUDA side.  See docs/offload.md.
"""
import collections

import numpy as np

from ..core import backend, context, log
from ..core.config import OFFLOAD_POLICIES as POLICIES, offload_settings, parse_offload_policy
from ..core.errors import ConfigError
from ..gpu.host import HostMemory
from ..proto import caffe_pb2

_P = caffe_pb2.OffloadParameter
CONV_TYPES = ("Convolution", "Deconvolution")

# pinned copies measured on the H100/H200 machines (docs/offload.md, DESIGN.md)
D2H_BYTES_PER_S = 50e9
H2D_BYTES_PER_S = 50e9
# DYNAMIC with no budget given: this share of the device's memory
DEFAULT_BUDGET_SHARE = 0.9
# an offload "hides" when the modelled iteration grows by at most this share of compute
HIDE_SLACK = 1e-3
# `minicaffe memory` without a profile estimates layer times from these (assumptions of
# an H100-class device in strict fp32, not measurements: the real run profiles)
ASSUMED_FLOPS = 40e12
ASSUMED_MEM_BYTES_PER_S = 2.0e12
SLOT_ALIGN = 4096

MiB, GiB = float(1 << 20), float(1 << 30)


class BudgetError(ConfigError):
    """The budget cannot hold the net even with everything possible offloaded."""


# -- settings ---------------------------------------------------------------------------
parse_policy = parse_offload_policy   # in core/config.py, which RunConfig validates with


def settings(net_param, config=None):
    """(policy name, budget bytes) for a NetParameter under a run's ``config`` (see
    ``config.offload_settings``, where the Net reads them too)."""
    return offload_settings(net_param, config)


def resolve_budget(budget):
    """Bytes of a budget from ``settings``: ints as they are; ``"auto"`` and ``"N%"``
    (``--gpu_mem_limit auto``, ``60%``) from the current device's memory, logged; a
    ConfigError where there is no device to ask."""
    from ..core.config import budget_bytes
    if not isinstance(budget, str):
        return int(budget or 0)
    if not context.is_gpu():
        raise ConfigError(f"--gpu_mem_limit {budget} reads the GPU's memory: it needs GPU "
                          f"mode (--gpu N); give a size such as 12GiB to plan without one")
    free, total = backend.device_memory()
    held = backend.used_gpu_bytes()
    n = budget_bytes(budget, free, total, held)
    log.info("gpu_mem_limit %s: %.2f GiB (device: %.2f GiB free, %.2f GiB held by this "
             "process, %.2f GiB in all)", budget, n / GiB, free / GiB, held / GiB, total / GiB)
    return n


def fit_workspace(net, budget, history_sets=1, margin=0):
    """Lower the floor under ``budget``, step by step.  Each cuDNN convolution's forward
    and backward workspace is a buffer of the plan live at its own step (engine/plan.py),
    so what a workspace may take is what that step's floor leaves free: ``budget`` less
    ``margin``, everything beside the arena, and the arena's part of the floor at that
    step (the maps it reads or writes, the diffs alive then, what is kept all iteration:
    ``step_floor``).  A convolution whose chosen algorithms fit there keeps them (the
    same numbers as without a budget); one that does not takes, for that direction, the
    fastest algorithms within what is free there, or the least-workspace ones where
    none fits.  Returns (largest workspace before, after), or None where nothing
    changed.  (Other algorithms may round differently in the last bits.)"""
    from .plan import MemoryPlan, workspace_need
    convs = [l for l in net.layers if getattr(l, "_cudnn_key", None) is not None and
             getattr(l, "candidates", None) and hasattr(l, "use_workspace")]
    if not convs or not budget:
        return None
    plan = MemoryPlan(net, train=True, history_sets=history_sets)
    old = plan.workspace_bytes
    if old == 0:
        return None
    maps, ws = step_floor(plan)
    free = budget - margin - plan.side_bytes - maps          # per step, for a workspace
    caps = {}
    for b in plan.workspaces:
        room = int(free[b.start:b.end + 1].min())
        if b.nbytes > room:
            caps.setdefault(id(b.mem.layer), {})[b.mem.direction] = max(0, room)
    if not caps:
        return None
    changed = []
    for l in convs:
        c = caps.get(id(l))
        if not c:
            continue
        # within the layer's present largest: a call that fits keeps its algorithm
        now = max(workspace_need(l, "forward"), workspace_need(l, "backward"))
        l.use_workspace(min(now, c.get("forward", now)), min(now, c.get("backward", now)))
        changed.append(l)
    new = MemoryPlan(net, train=True, history_sets=history_sets).workspace_bytes
    ws = context.get().handles.get("cudnn_ws")
    if ws is not None and ws.nbytes > new:     # a shared one left from before: let it go
        context.get().handles.pop("cudnn_ws", None)
    log.info("cuDNN workspace of net %s: %d convolution(s) take smaller workspaces (largest "
             "%.1f MiB, was %.1f MiB) to bring their steps under the budget of %.2f GiB%s: %s",
             net.name, len(changed), new / MiB, old / MiB, budget / GiB,
             f" less {margin / MiB:.0f} MiB" if margin else "",
             ", ".join(f"'{l.name}' {workspace_need(l, 'forward') / MiB:.1f}/"
                       f"{workspace_need(l, 'backward') / MiB:.1f} MiB" for l in changed[:8])
             + (f" and {len(changed) - 8} more" if len(changed) > 8 else ""))
    return old, new


def _build_fitting(net, policy, budget, history_sets, times=None):
    """``build(net, policy, budget)`` after ``fit_workspace``: where the plan is still
    over the budget (it holds more than the floor: maps fetched ahead of their readers,
    gaps the placement leaves), the workspaces are fitted again leaving a margin (256
    MiB, 1 GiB, then everything: each convolution's least-workspace algorithms) before
    the BudgetError stands."""
    try:
        return build(net, policy, budget, history_sets, times=times)
    except BudgetError as e:
        err = e
    if not budget:
        raise err
    for margin in (256 << 20, 1 << 30, budget):
        if fit_workspace(net, budget, history_sets, margin) is None:
            continue
        try:
            return build(net, policy, budget, history_sets, times=times)
        except BudgetError as e:
            err = e
    raise err


def step_floor(plan):
    """Per step of ``plan``, (the arena's bytes the floor counts there without the
    workspaces: diffs alive, what lives the whole iteration, the data the step reads or
    writes; the workspaces live there), two int64 arrays (see ``floor_parts``)."""
    n = np.zeros(plan.steps, dtype=np.int64)
    w = np.zeros(plan.steps, dtype=np.int64)
    for b in plan.buffers:
        if b.part == "backward":
            continue
        if b.kind == "workspace":
            w[b.start:b.end + 1] += b.nbytes
        elif b.kind == "diff" or b.pinned:
            n[b.start:min(b.end, plan.steps - 1) + 1] += b.nbytes
        else:
            for s in set(b.writes) | set(b.reads) | set(b.bwd_reads):
                if 0 <= s < plan.steps:
                    n[s] += b.nbytes
    return n, w


def check_solver(solver):
    """A warning (training goes on) where a net asks for offload that will not happen."""
    policy, _ = settings(solver.net.net_param, solver.net.config)
    if policy == "NONE":
        return None
    from ..core import context
    if not context.is_gpu():
        why = "in CPU mode nothing is offloaded"
    elif not solver.uses_gpu_step:
        why = ("it needs the GPU training step of the SGD family without debug_info; "
               "this run trains without it")
    else:
        return None
    log.warning("offload_param: policy %s applies to the GPU training step only: %s; "
                "training goes on", policy, why)
    return why


# -- buffers that may leave, and when they move ------------------------------------------
class Entry:
    """One offloaded buffer: its lives and copies in steps of the iteration."""
    __slots__ = ("buf", "name", "nbytes", "copy_bytes", "first", "d2h_after", "fwd_end",
                 "bwd_first", "bwd_last", "prefetch", "release", "slot", "fwd", "bwd",
                 "conv_input", "on_demand", "hold", "lane", "recompute", "bwd_read",
                 "bwd_end")

    def __init__(self, buf):
        self.buf = buf
        self.name = buf.names[0]
        self.nbytes = buf.nbytes                       # its place in the arena
        self.copy_bytes = buf.mem.size * buf.mem.dtype.itemsize
        touched = buf.writes + buf.reads
        self.first = min(touched)
        self.d2h_after = max(buf.writes)               # the last forward writer
        self.fwd_end = max(touched)                    # the last forward reader
        self.bwd_first = min(buf.bwd_reads) if buf.bwd_reads else None
        self.bwd_last = max(buf.bwd_reads) if buf.bwd_reads else None
        # its own first and last backward readers (``bwd_first``/``bwd_last`` may reach
        # further: a recomputed map's producer reads it there, ``recompute_lives``)
        self.bwd_read, self.bwd_end = self.bwd_first, self.bwd_last
        # None, or the layers whose forward runs again to make it before ``bwd_first``
        # (in place of the copies out and back: ``choose_recompute``)
        self.recompute = None
        self.prefetch = None                           # step the host->device copy starts
        self.hold = self.fwd_end                       # its forward place kept until here
        self.on_demand = False                         # fetched by the layer that needs it
        self.release = None                            # step that waits for device->host
        self.slot = None
        self.fwd = self.bwd = None
        self.conv_input = False
        self.lane = 0                                  # which device->host stream copies it

    def lives(self):
        out = [("forward", self.first, self.hold)]
        if self.bwd_first is not None:
            out.append(("backward", self.prefetch, self.bwd_last))
        return out

    @property
    def copies(self):
        """Whether it moves over the link (False: recomputed, ``recompute``)."""
        return self.recompute is None

    def __repr__(self):
        if self.recompute is not None:
            return (f"Entry({self.name}: fwd {self.first}..{self.fwd_end}, recomputed by "
                    f"layers {list(self.recompute)} before {self.bwd_first}..{self.bwd_last})")
        return (f"Entry({self.name}: fwd {self.first}..{self.fwd_end}/{self.hold}, d2h after "
                f"{self.d2h_after} (lane {self.lane}), bwd {self.prefetch}/{self.bwd_first}.."
                f"{self.bwd_last})")


def n_prologue(net):
    n = 0
    while n < len(net.layers) and net.layers[n].graph_prologue:
        n += 1
    return n


def step_layer(net, step):
    """(layer index, 'forward' | 'backward') of a step of the iteration."""
    L = len(net.layers)
    return (step, "forward") if step < L else (2 * L - 1 - step, "backward")


def candidates(plan, policy):
    """The plan's data buffers that ``policy`` offloads, as Entries with their prefetch
    points (a buffer whose backward life would start right where its forward life ends
    gains nothing and stays)."""
    if policy in ("NONE",):
        return []
    net = plan.net
    first = n_prologue(net)
    out = []
    for b in plan.buffers:
        if (b.kind != "data" or b.part is not None or b.pinned or not b.writes
                or min(b.writes) < first or b.mem.size == 0):
            continue
        e = Entry(b)
        e.conv_input = any(net.layers[i].type in CONV_TYPES for i in b.reads)
        if policy == "CONV" and not e.conv_input:
            continue
        out.append(e)
    _prefetch_points(net, out)
    return [e for e in out if e.bwd_first is None or e.prefetch > e.fwd_end + 1]


def _prefetch_points(net, entries):
    """vDNN's findPrefetchLayer: while layer n runs backward, the offloaded inputs of
    the nearest layer below it not yet fetched start coming back -- searching down from
    n - 1 and stopping at the first convolution (which may itself be the one fetched);
    a layer whose inputs no earlier layer fetched fetches them itself."""
    L = len(net.layers)
    groups = collections.defaultdict(list)       # layer -> entries it reads first
    for e in entries:
        if e.bwd_first is not None:
            groups[2 * L - 1 - e.bwd_first].append(e)
    done = set()
    for n in range(L - 1, -1, -1):
        step = 2 * L - 1 - n
        if n in groups and n not in done:
            done.add(n)
            for e in groups[n]:
                e.prefetch, e.on_demand = step, True
        for m in range(n - 1, -1, -1):
            if m in groups and m not in done:
                done.add(m)
                for e in groups[m]:
                    e.prefetch = step
                break
            if net.layers[m].type in CONV_TYPES:
                break


# -- what a choice costs: live bytes and the timeline model --------------------------------
def live_bytes(plan):
    """Bytes of the plan's buffers alive at each step (the arena without fragmentation)."""
    d = np.zeros(plan.steps + 1, dtype=np.int64)
    for b in plan.buffers:       # (a buffer kept past the iteration ends at ``steps``)
        d[b.start] += b.nbytes
        d[min(b.end, plan.steps - 1) + 1] -= b.nbytes
    return np.cumsum(d)[:plan.steps]


def saving(plan, e):
    """Per step, the bytes offloading ``e`` takes out of the device."""
    s = np.full(plan.steps, e.nbytes, dtype=np.int64)
    for _, a, z in e.lives():
        s[a:z + 1] = 0
    return s


class _OutPipe:
    """The device->host copies of the timeline model: two streams (lanes 0 and 1, each
    FIFO) sharing one link of ``rate`` bytes/s, half each while both copy (one busy
    stream has it all, as one FIFO stream had).  Copies are added in time order; the
    end of a copy is known once no copy added later can share the link before it ends
    (the callers ask only then: the compute stream waits for it, or backward has
    begun and adds no more)."""

    def __init__(self, rate):
        self.rate, self.clock = rate, 0.0
        self.queues = (collections.deque(), collections.deque())   # [key, bytes left]
        self.done = {}

    def add(self, key, t, nbytes, lane=0):
        t = max(t, self.clock)
        self._run(t)
        self.queues[1 if lane else 0].append([key, float(nbytes)])

    def _run(self, until=float("inf"), key=None):
        q0, q1 = self.queues
        done, eps = self.done, 1e-6
        while key is None or key not in done:
            if q0 and q1:
                share = self.rate / 2
                dt = min(q0[0][1], q1[0][1]) / share
                if self.clock + dt > until:
                    moved = share * (until - self.clock)
                    q0[0][1] -= moved
                    q1[0][1] -= moved
                    self.clock = until
                    return
                self.clock += dt
                moved = share * dt
                for q in (q0, q1):
                    q[0][1] -= moved
                    if q[0][1] <= eps:
                        done[q.popleft()[0]] = self.clock
            elif q0 or q1:
                q = q0 or q1
                dt = q[0][1] / self.rate
                if self.clock + dt > until:
                    q[0][1] -= self.rate * (until - self.clock)
                    self.clock = until
                    return
                self.clock += dt
                done[q.popleft()[0]] = self.clock
            else:
                if until != float("inf"):
                    self.clock = max(self.clock, until)
                return

    def end_of(self, key):
        """When the copy ``key`` ends."""
        if key not in self.done:
            self._run(key=key)
        return self.done[key]

    def drain(self):
        self._run()
        return self.clock


def simulate(times, entries, first=0, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S, lazy=False):
    """Modelled seconds of one forward-backward: steps ``first..`` in order on the
    compute stream (``times[s]`` seconds each), the copies out on the device->host
    streams (an entry's ``lane``: ``_OutPipe``, the link shared by the busy ones) and
    the copies back on a host->device stream, with the schedule's event waits.  The
    compute stream waits for a buffer's device->host copy before ``release`` (``lazy``:
    as placed) or else right after its forward place is let go (``hold``: its last
    forward reader, unless ``hide_copies`` kept it longer), and for its host->device
    copy before its first backward reader.  A recomputed entry (``recompute``) has no
    copy: its producers' forward times are added to the compute stream right before its
    first backward reader.  Returns (total, stall), stall being the time compute
    waited."""
    after, release, fetch, need = (collections.defaultdict(list) for _ in range(4))
    redo = collections.defaultdict(float)
    for e in entries:
        layers = getattr(e, "recompute", None)
        if layers is not None:
            redo[e.bwd_first] += sum(times[i] for i in layers)
            continue
        after[e.d2h_after].append(e)
        r = e.release if lazy else e.hold + 1
        if r is not None:
            release[r].append(e)
        if e.bwd_first is not None:
            fetch[e.prefetch].append(e)
            need[e.bwd_first].append(e)
    t = stall = h2d_free = 0.0
    pipe = _OutPipe(d2h)
    in_done = {}
    for s in range(first, len(times)):
        start = t
        for e in release.get(s, ()):
            start = max(start, pipe.end_of(id(e)))
        for e in fetch.get(s, ()):
            h2d_free = in_done[id(e)] = (max(h2d_free, start, pipe.end_of(id(e))) +
                                         e.copy_bytes / h2d)
        for e in need.get(s, ()):
            start = max(start, in_done[id(e)])
        stall += start - t
        t = start + redo.get(s, 0.0) + times[s]
        for e in after.get(s, ()):
            pipe.add(id(e), t, e.copy_bytes, getattr(e, "lane", 0))
    total = max(t, pipe.drain(), h2d_free)
    return total, stall + (total - t)


def fifo_bound(times, entries, first=0, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S):
    """Modelled seconds of one forward-backward with these copies (each stream FIFO, in
    the schedule's order) and no memory limit on the lives: no forward place is reused
    before the end, and every map may come back as soon as it is out and backward has
    begun -- what the same copies could do at best with the device's memory to spare."""
    import types
    L = len(times) // 2
    free = [types.SimpleNamespace(d2h_after=e.d2h_after, hold=10 ** 9, release=None,
                                  bwd_first=e.bwd_first, copy_bytes=e.copy_bytes,
                                  lane=getattr(e, "lane", 0),
                                  recompute=getattr(e, "recompute", None),
                                  prefetch=L if e.bwd_first is not None else None)
            for e in sorted(entries, key=lambda e: (e.bwd_first is None, e.bwd_first or 0))]
    return simulate(times, free, first, d2h, h2d)[0]


def budget_bound(plan, times, budget, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S):
    """A lower bound (seconds) on one forward-backward of ``plan``'s net (not split) by
    any schedule that keeps its device bytes within ``budget`` by copying feature maps
    out and back over links of ``d2h``/``h2d`` bytes/s, the steps taking ``times``
    (seconds each, compute only): a fluid model.  At each step k the device must hold
    what the step and the rest of the iteration cannot do without (parameters and
    everything beside the arena, the diffs alive then, the maps the step reads or
    writes, what lives all iteration: ``live_bytes_with`` over ALL's maps at their
    shortest lives) plus the maps between their last forward use and their first
    backward one; what of that exceeds the budget, E_k, is off the device during step
    k.  So by the start of step k the device->host link has moved at least E_k bytes
    of maps made before it (out of what was made by then, at ``d2h``), and from the
    start of step k to the end the host->device link moves at least E_k (needed after
    it, at ``h2d``).  Forward, the earliest start of each step under the first (the
    link copying as soon as maps are made, compute stalling only where E_k demands);
    backward in reverse time, the least time from each step's start to the end under
    the second; the bound is the largest sum of the two over the steps (at least the
    compute).  Recompute is not in it: it trades link time for compute and may go
    under it.  None where the floor is over the budget.  Pure Python."""
    net = plan.net
    first = n_prologue(net)
    steps = len(times)
    entries = candidates(plan, "ALL")
    for e in entries:
        if e.bwd_first is not None:
            e.prefetch = e.bwd_first
    must = live_bytes_with(plan, entries)[:steps].astype(np.float64)
    between = np.zeros(steps)
    made, needed = collections.defaultdict(float), collections.defaultdict(float)
    for e in entries:
        if e.bwd_first is not None:
            between[e.fwd_end + 1:e.bwd_first] += e.nbytes
            made[e.d2h_after] += e.nbytes
            needed[e.bwd_first] += e.nbytes
    room = budget - plan.side_bytes
    if (must[first:] > room).any():
        return None
    excess = np.maximum(0.0, must + between - room)
    start, t, out, avail = [0.0] * steps, 0.0, 0.0, 0.0
    for k in range(first, steps):
        if out < excess[k]:
            t += (excess[k] - out) / d2h
            out = excess[k]
        start[k] = t
        out = min(avail, out + d2h * times[k])
        t += times[k]
        avail += made.get(k, 0.0)
    rest, t, inn, avail = [0.0] * steps, 0.0, 0.0, 0.0
    for k in range(steps - 1, first - 1, -1):
        inn = min(avail, inn + h2d * times[k])
        t += times[k]
        if inn < excess[k]:
            t += (excess[k] - inn) / h2d
            inn = excess[k]
        rest[k] = t
        avail += needed.get(k, 0.0)
    return max([sum(times[first:])] + [start[k] + rest[k] for k in range(first, steps)])


def estimate_times(net):
    """Seconds per step from a roofline guess (``ASSUMED_FLOPS``,
    ``ASSUMED_MEM_BYTES_PER_S``): what ``minicaffe memory`` uses for DYNAMIC before
    anything has run.  Backward counts twice its forward."""
    L = len(net.layers)
    t = [0.0] * (2 * L)
    first = n_prologue(net)
    for i in range(first, L):
        layer, bot, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
        moved = sum(b.count() * b.dtype.itemsize for b in list(bot) + list(top))
        flops = 0
        if layer.type in CONV_TYPES and layer.blobs:
            w = layer.blobs[0]
            out = top[0].count() if layer.type == "Convolution" else bot[0].count()
            flops = 2 * out * w.count() // max(1, w.shape[0])
        elif layer.type == "InnerProduct" and layer.blobs:
            flops = 2 * top[0].count() * layer.blobs[0].count() // max(1, layer.blobs[0].shape[0])
        f = max(flops / ASSUMED_FLOPS, moved / ASSUMED_MEM_BYTES_PER_S)
        t[i] = f
        if net.layer_need_backward[i]:
            t[2 * L - 1 - i] = 2 * f
    return t


# -- choosing ---------------------------------------------------------------------------
def _peak_layer(net, live, side):
    s = int(np.argmax(live))
    i, direction = step_layer(net, s)
    return net.layer_names[i], direction, int(live[s]) + side


def _fmt_bytes(n):
    return f"{int(n)} bytes ({n / GiB:.2f} GiB)"


def budget_error(net, plan, budget, policy):
    """The one line for a budget below what ``policy``'s plan needs."""
    name, direction, need = _peak_layer(net, live_bytes(plan), plan.side_bytes)
    need = max(need, plan.peak) if plan.peak > budget >= need else need
    return BudgetError(
        f"gpu_memory_budget of {_fmt_bytes(budget)} is too small for net {net.name} even "
        f"with offload policy {policy}: layer '{name}' ({direction}) needs "
        f"{_fmt_bytes(need)} of device memory ({(plan.side_bytes) / GiB:.2f} GiB of it "
        f"parameters, diffs, solver history, workspaces and layer state)")


def choose_dynamic(plan, entries, times, budget, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S):
    """DYNAMIC's choice among ``entries`` (ALL's, with their prefetch points) for
    ``plan`` (not yet split): buffers alive at the step of the planned peak first, one
    at a time, those whose copies hide under compute before any that do not, until the
    peak fits ``budget``.  Returns (chosen entries, info dict).  Pure Python: ``times``
    are seconds per step (a profile, or fake ones in tests)."""
    first = n_prologue(plan.net)
    compute = sum(times[first:])
    base = live_bytes(plan)
    info = {"compute_s": compute, "exposed": 0, "fits_without": False}
    if base.max() + plan.side_bytes <= budget and plan.peak <= budget:
        info.update(fits_without=True, total_s=compute)
        return [], info
    savings = {id(e): saving(plan, e) for e in entries}
    chosen, live = [], base.copy()
    left = list(entries)
    exposed = set()                # buffers whose copies were found not to hide
    current, _ = simulate(times, [], first, d2h, h2d)
    slack = HIDE_SLACK * compute
    while left and live.max() + plan.side_bytes > budget:
        s = int(np.argmax(live))
        useful = [e for e in left if savings[id(e)][s] > 0]
        if not useful:
            break
        pick = None
        for e in sorted(useful, key=lambda e: -e.nbytes):
            if id(e) in exposed:
                continue
            total, _ = simulate(times, chosen + [e], first, d2h, h2d)
            if total <= current + slack:
                pick, current = e, total
                break
            exposed.add(id(e))
        if pick is None:           # nothing left that hides: the least exposed per byte
            def cost(e):
                total, _ = simulate(times, chosen + [e], first, d2h, h2d)
                return (total - current) / savings[id(e)][s], total
            pick = min(useful, key=lambda e: cost(e)[0])
            current = cost(pick)[1]
            info["exposed"] += 1
        chosen.append(pick)
        left.remove(pick)
        live -= savings[id(pick)]
    info["total_s"] = current
    info["live_peak"] = int(live.max()) + plan.side_bytes
    return chosen, info


# -- hiding the copies: lives as long as the copies need, as far as memory allows -----------
# benchmarks/offload.py turns it off to measure the schedule without it (the same run)
HIDE = True


def _copy_model(times, entries, first, d2h, h2d):
    """From compute-only step times (seconds): each step's start, and per entry
    (``id``) when its device->host copy ends (the copy stream FIFO in issue order,
    each copy starting after its last forward writer) and the latest moment its
    host->device copy may start so that every copy back, FIFO in the order they are
    needed, ends before its first backward reader."""
    start, t = [0.0] * (len(times) + 1), 0.0
    for k in range(len(times)):
        start[k] = t
        t += times[k] if k >= first else 0.0
    start[len(times)] = t
    out_t, pipe = {}, _OutPipe(d2h)
    entries = [e for e in entries if e.copies]
    for e in sorted(entries, key=lambda e: e.d2h_after):
        pipe.add(id(e), start[e.d2h_after + 1], e.copy_bytes, e.lane)
    for e in entries:
        out_t[id(e)] = pipe.end_of(id(e))
    latest, deadline = {}, float("inf")
    for e in sorted((e for e in entries if e.bwd_first is not None),
                    key=lambda e: -e.bwd_first):
        deadline = min(deadline, start[e.bwd_first])
        deadline = latest[id(e)] = deadline - e.copy_bytes / h2d
    return start, out_t, latest


def _lengthen(plan, entries, times, target, d2h, h2d, scale=1.0, prefetch=True, hold=True,
              judge=False, tries=6):
    """One way to lengthen the lives (see ``hide_copies``): in the order the maps are
    needed back, the host->device copy starts earlier than vDNN's point (never later),
    up to the step by which the copies back, FIFO, would end before their first backward
    readers (``_copy_model`` over ``times`` x ``scale``: a larger scale asks for less);
    then, in the order the maps go out, the forward place is kept (``hold``) past the
    last forward reader up to the step by which the device->host copy has ended.  Each
    as far as the live bytes stay within ``target``; with ``judge``, only as far as the
    model (``simulate`` over ``times``) gets shorter, among ``tries`` steps."""
    net = plan.net
    L = len(net.layers)
    first = n_prologue(net)
    start, out_t, latest = _copy_model([t * scale for t in times], entries, first, d2h, h2d)
    room = target - plan.side_bytes
    cur = live_bytes_with(plan, entries)
    best = simulate(times, entries, first, d2h, h2d)[0] if judge else None

    def choose(e, attr, candidates):
        nonlocal best
        old = pick = getattr(e, attr)
        if not judge:
            return candidates[-1] if candidates else old
        for c in candidates:
            setattr(e, attr, c)
            total, _ = simulate(times, entries, first, d2h, h2d)
            if total < best - 1e-9:
                best, pick = total, c
        setattr(e, attr, old)
        return pick

    def spread(a, z):              # up to ``tries`` steps from a (excluded) to z
        if z == a:
            return []
        n = min(tries, abs(z - a))
        return [a + (z - a) * k // n for k in range(1, n + 1)]

    if prefetch:
        for e in sorted((e for e in entries if e.bwd_first is not None and e.copies),
                        key=lambda e: (e.bwd_first, e.prefetch)):
            want = e.prefetch
            while want > L and start[want] > latest[id(e)]:
                want -= 1
            s = e.prefetch
            while s - 1 >= max(L, e.hold + 2, want) and cur[s - 1] + e.nbytes <= room:
                s -= 1
            pick = choose(e, "prefetch", spread(e.prefetch, s))
            if pick < e.prefetch:
                cur[pick:e.prefetch] += e.nbytes
                e.prefetch, e.on_demand = pick, False
    if hold:
        for e in sorted((e for e in entries if e.copies), key=lambda e: e.d2h_after):
            end = min(2 * L - 1 if e.bwd_first is None else e.prefetch - 2, 2 * L - 1)
            want = e.hold
            while want + 1 <= end and start[want + 1] < out_t[id(e)]:
                want += 1
            h = e.hold
            while h + 1 <= want and cur[h + 1] + e.nbytes <= room:
                h += 1
            pick = choose(e, "hold", spread(e.hold, h))
            if pick > e.hold:
                cur[e.hold + 1:pick + 1] += e.nbytes
                e.hold = pick


# what keeping, recomputing and lengthening leave free under a budget (at most 1% of
# it), for what the step allocates outside its plan (the measured peak was 8-13 MiB
# over the planned one on the H100: docs/offload.md); a plan that needs it for its
# maps keeps what it has
BUDGET_MARGIN = 64 << 20

# the ways hide_copies tries: (scale of the times, prefetch, hold, judged by the model)
HIDE_WAYS = [(1.0, True, True, True), (1.0, True, True, False), (2.0, True, True, False),
             (4.0, True, True, False), (1.0, True, False, False), (1.0, False, True, False)]


def hide_copies(plan, entries, times, target, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S):
    """Lengthen the lives of offloaded ``entries`` (not yet split) so that their copies
    have time to run, keeping the planned live bytes plus ``plan.side_bytes`` within
    ``target``: a host->device copy may start earlier than vDNN's point, a forward place
    may be kept while its device->host copy runs (``_lengthen``).  Several ways of doing
    so (``HIDE_WAYS``: greedy at several paces, prefetch or hold alone, or one map at a
    time judged by the model) are tried, and the one the timeline model (``simulate``
    over ``times``, seconds per step) finds shortest is kept -- none where none is
    shorter than vDNN's lives.  Returns the number of lives lengthened.  Pure Python."""
    first = n_prologue(plan.net)
    base = [(e.prefetch, e.hold, e.on_demand) for e in entries]

    def reset(state):
        for e, (p, h, o) in zip(entries, state):
            e.prefetch, e.hold, e.on_demand = p, h, o

    best, best_state = simulate(times, entries, first, d2h, h2d)[0], base
    for scale, prefetch, hold, judge in HIDE_WAYS:
        reset(base)
        _lengthen(plan, entries, times, target, d2h, h2d, scale, prefetch, hold, judge)
        total, _ = simulate(times, entries, first, d2h, h2d)
        if total < best - 1e-9:
            best, best_state = total, [(e.prefetch, e.hold, e.on_demand) for e in entries]
    reset(best_state)
    return sum(1 for e, (p, h, _) in zip(entries, base) if e.prefetch != p or e.hold != h)


# device->host streams the schedule may use (1: one FIFO stream, the schedule before
# round 3; benchmarks/offload.py sets it to compare in the same run)
LANES = 2
# a copy out is issued in pieces of at most this many bytes, so that on a copy engine
# shared by the two device->host streams a late small map waits for one piece of a
# large one, not all of it (``Offloader._after``)
COPY_CHUNK = 128 << 20


def _spread(values, n):
    """At most ``n`` of the sorted ``values``, evenly spaced, the last included."""
    if len(values) <= n:
        return list(values)
    return [values[(len(values) - 1) * (k + 1) // n] for k in range(n)]


def choose_lanes(entries, times, first=0, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S,
                 lazy=False):
    """Which device->host stream copies each entry out (``e.lane``: 0, or 1 for the
    second stream), so that the maps the backward needs first do not queue behind the
    large ones made before them (VGG-16: conv5_x's small outputs behind conv1_x's 3 GiB
    ones on one FIFO stream).  Tried on the timeline model (``simulate`` over ``times``,
    the two streams sharing the link): one stream; the second for the maps made from a
    step on (up to 16 steps tried); the second for the maps up to a size (up to 8) --
    the shortest kept, one stream where none is shorter; then each map, in the order
    they go out, moved to the other stream where that is shorter (VGG-16's pool1 beside
    conv1_x's outputs, whose place conv2_2 takes).  ``lazy``: the compute stream waits
    for a copy out where the placement says (``release``; the entries are placed), not
    right after the forward life.  Returns how many go on the second.  Pure Python."""
    for e in entries:
        e.lane = 0
    every, entries = entries, [e for e in entries if getattr(e, "copies", True)]
    if LANES < 2 or len(entries) < 2:
        return 0
    best, pick = simulate(times, every, first, d2h, h2d, lazy)[0], [0] * len(entries)
    ways = [[int(e.d2h_after >= k) for e in entries]
            for k in _spread(sorted({e.d2h_after for e in entries})[1:], 16)]
    ways += [[int(e.copy_bytes <= z) for e in entries]
             for z in _spread(sorted({e.copy_bytes for e in entries})[:-1], 8)]
    for lanes in ways:
        for e, lane in zip(entries, lanes):
            e.lane = lane
        total = simulate(times, every, first, d2h, h2d, lazy)[0]
        if total < best - 1e-6:
            best, pick = total, lanes
    for e, lane in zip(entries, pick):
        e.lane = lane
    for e in sorted(entries, key=lambda e: e.d2h_after):   # then one map at a time
        e.lane = 1 - e.lane
        total = simulate(times, every, first, d2h, h2d, lazy)[0]
        if total < best - 1e-6:
            best = total
        else:
            e.lane = 1 - e.lane
    return sum(e.lane for e in entries)


def keep_on_device(plan, entries, times, target, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S):
    """DYNAMIC's second look, after its maps were chosen to fit (or ALL's taken with some
    fetched on demand): a chosen map whose whole stretch off the device fits beside the
    rest within ``target`` (the budget: live bytes plus ``plan.side_bytes``) stays on
    the device, with no copy either way -- the maps the backward needs first before the
    others (VGG-16 under 12 GiB: conv5_x's and conv4_x's outputs, made last in forward,
    needed first in backward, which otherwise leave behind the large early ones and
    hold the backward up), each only where the timeline model (``simulate`` over
    ``times``) is not longer without its copies.  Returns the names kept.  Pure
    Python."""
    first = n_prologue(plan.net)
    room = target - plan.side_bytes
    live = live_bytes_with(plan, entries)
    left = list(entries)
    best = simulate(times, left, first, d2h, h2d)[0]
    kept = []
    for e in sorted(entries, key=lambda e: (e.bwd_first is None, e.bwd_first or 0)):
        back = saving(plan, e)
        if (live + back).max() > room:
            continue
        rest = [x for x in left if x is not e]
        total = simulate(times, rest, first, d2h, h2d)[0]
        if total <= best + 1e-9:
            kept.append(e.name)
            live += back
            left, best = rest, total
    return kept


def live_bytes_with(plan, entries):
    """``live_bytes`` of ``plan`` (not split) with each of ``entries`` alive only during
    its lives."""
    live = live_bytes(plan)
    for e in entries:
        live -= saving(plan, e)
    return live


# -- recomputation in place of the copies (activation checkpointing) ---------------------------
# benchmarks/offload.py turns it off to measure the schedule without it (the same run)
RECOMPUTE = True
# layer types whose forward may run again: deterministic, and stateless but for what
# the same forward writes again with the same values (Caffe's MAX pooling mask, LRN's
# scale, an in-place ReLU's saved input on the CPU); not Dropout (a new mask), not
# BatchNorm in training (its running statistics), not data layers
RECOMPUTABLE = ("Convolution", "ReLU", "Pooling", "LRN")
# a recompute may make recomputed inputs on the way, in places of their own live only
# at the recompute (``through_chain``); benchmarks/offload.py turns it off to compare
THROUGH = True


def recompute_layers(net, buf):
    """The layers whose forward, run again in order, makes data buffer ``buf`` (its
    producer and the in-place layers after it: ``buf.writes``), or None where one of
    them may not run again (``RECOMPUTABLE``; one top each; no stochastic pooling)."""
    layers = sorted(set(buf.writes))
    for i in layers:
        layer = net.layers[i]
        if layer.type not in RECOMPUTABLE or len(net.top_vecs[i]) != 1:
            return None
        if layer.type == "Pooling" and \
                layer.layer_param.pooling_param.pool == caffe_pb2.PoolingParameter.STOCHASTIC:
            return None
    if any(b.data_mem is buf.mem for b in net.bottom_vecs[layers[0]]):
        return None
    return tuple(layers)


def _chain_io(net, layers, own):
    """(the data memories ``layers`` read that none of them wrote first, those they
    write other than ``own``), each in order."""
    made, read = {id(own): own}, {}
    between = {}
    for i in layers:
        for b in net.bottom_vecs[i]:
            if id(b.data_mem) not in made and id(b.data_mem) not in between:
                read[id(b.data_mem)] = b.data_mem
        for t in net.top_vecs[i]:
            if id(t.data_mem) not in made:
                between[id(t.data_mem)] = t.data_mem
    return list(read.values()), list(between.values())


def recompute_inputs(net, e):
    """The data memories the layers that remake ``e`` read (not ``e``'s own, nor the
    maps those layers make on the way: ``recompute_through``)."""
    return _chain_io(net, e.recompute, e.buf.mem)[0]


def recompute_through(net, e):
    """The data memories that remaking ``e`` makes on the way (its chain runs their
    producers first: conv1_1's output when conv1_2's is made from the data), each in a
    place of its own live only at the recompute (``OffloadPlan.through``)."""
    return _chain_io(net, e.recompute, e.buf.mem)[1]


def redo_workspace(net, e):
    """Bytes of cuDNN forward workspace the layers remaking ``e`` take at once (each
    gets its own place, live at the recompute only: ``OffloadPlan``)."""
    from .plan import workspace_need
    return sum(workspace_need(net.layers[i], "forward") for i in e.recompute)


def redo_bytes(net, e):
    """Bytes remaking ``e`` takes beside the maps alive then: its producers' cuDNN
    forward workspaces and the maps it makes on the way (``recompute_through``)."""
    from .plan import _aligned
    return redo_workspace(net, e) + sum(_aligned(m.size * m.dtype.itemsize)
                                        for m in recompute_through(net, e))


def boundary_bytes(plan, entries, s):
    """Bytes of ``plan`` (not split) with ``entries`` alive right before step ``s``'s
    op, where its recomputes run: every buffer alive at steps s - 1 and s, and those
    first alive at s that something touches before the op (a copy back starting
    there, a map made again there) -- not a diff or workspace that step's op is the
    first to touch (``plan.FIRST_TOUCHED_BY_ITS_STEP``)."""
    from .plan import FIRST_TOUCHED_BY_ITS_STEP
    lives = {id(e.buf): e.lives() for e in entries}
    n = 0
    for b in plan.buffers:
        for _, a, z in lives.get(id(b), [(None, b.start, b.end)]):
            if a < s <= z or (a == s and b.kind not in FIRST_TOUCHED_BY_ITS_STEP):
                n += b.nbytes
                break
    return n


def recompute_fits(plan, entries, room):
    """Whether the lives of ``entries`` (some recomputed) keep within ``room`` bytes of
    the arena: at every step, and right before each step where maps are made again,
    with what the recomputes take then (``redo_bytes``)."""
    net = plan.net
    if live_bytes_with(plan, entries).max() > room:
        return False
    at = collections.defaultdict(int)
    for x in entries:
        if x.recompute is not None:
            at[x.bwd_first] += redo_bytes(net, x)
    return all(boundary_bytes(plan, entries, s) + n <= room for s, n in at.items())


def recompute_lives(net, entries):
    """Set the lives the recomputed ``entries`` (``recompute`` not None) ask for: each is
    made again right before its first backward reader (its backward life starts there,
    no copy), and every input of its producers must be on the device then -- an
    offloaded input comes back by then (its backward life and its wait start there at
    the latest), a recomputed one is made again by then (first, in layer order).  A
    copied entry whose backward life would then touch its forward life, or an input
    that never comes back, makes the choice infeasible: returns False."""
    for e in entries:
        e.bwd_first, e.bwd_last = e.bwd_read, e.bwd_end
    by_mem = {id(e.buf.mem): e for e in entries}
    redo = sorted((e for e in entries if e.recompute is not None),
                  key=lambda e: -e.recompute[0])
    for e in redo:                 # the latest producers first: their needs reach down
        e.hold, e.on_demand, e.release = e.fwd_end, True, None
        r = e.prefetch = e.bwd_first
        for m in recompute_inputs(net, e):
            x = by_mem.get(id(m))
            if x is None:
                continue           # on the device all iteration
            if x.bwd_first is None:
                return False       # it goes out and never comes back
            if r < x.bwd_first:
                x.bwd_first = r
            x.bwd_last = max(x.bwd_last, r)
    for x in entries:
        if x.recompute is None and x.bwd_first is not None:
            if x.prefetch > x.bwd_first:
                x.prefetch, x.on_demand = x.bwd_first, True
            if x.prefetch <= x.hold + 1:
                return False
    for e in redo:                 # a map made on the way is a dropped one, not in use then
        r = e.bwd_first
        for m in recompute_through(net, e):
            x = by_mem.get(id(m))
            if x is None or x.recompute is None or x.bwd_first <= r <= x.bwd_last:
                return False
    return True


def through_chain(net, e, chains, entries):
    """``e``'s chain (``chains``: entry id -> its own producers) run from the producers
    of its inputs that are recomputed themselves, until none is left: those maps are
    made on the way, in places of their own live only at the recompute, instead of
    living from ``e``'s recompute to their own readers (VGG-16: conv1_2's output made
    from the data through conv1_1's, which is made again later for conv1_2's
    backward).  None where no input is recomputed."""
    by_mem = {id(x.buf.mem): x for x in entries}
    chain = set(chains[id(e)])
    while True:
        more = set()
        for m in _chain_io(net, sorted(chain), e.buf.mem)[0]:
            x = by_mem.get(id(m))
            if x is not None and x is not e and x.recompute is not None and id(x) in chains:
                more |= set(chains[id(x)])
        if more <= chain:
            break
        chain |= more
    return tuple(sorted(chain)) if len(chain) > len(chains[id(e)]) else None


def choose_recompute(plan, entries, times, target, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S,
                     force=False):
    """Which of the offloaded ``entries`` (not yet split) are made again in backward
    instead of copied out and back: those whose producers may run again
    (``recompute_layers``) and whose inputs are on the device or come back, tried one
    at a time in the order of what they save (the link time of both copies less their
    producers' forward time in ``times``), each kept where the timeline model
    (``simulate``) gets shorter and the planned live bytes, with the recompute's
    workspace at its step, stay within ``target`` (less ``plan.side_bytes``).  VGG-16:
    conv1_1's 3 GiB output comes back by two copies of ~60 ms each or by one 3 ms
    convolution of the data.  A map whose producers read a recomputed map may also be
    made through it (``through_chain``: its producers run first, into a place of its
    own live only then), where that is shorter or where keeping that input from this
    recompute to its own readers does not fit (VGG-16 under 12 GiB: conv1_2's output
    made from the data, with conv1_1's made on the way).  Memory is counted at every
    step and right before each step that remakes maps (``recompute_fits``).  ``force``:
    every one that can, within ``target``, whatever the model says, through the
    longest chain that fits (the tests' way to recompute much).  Returns how many are
    recomputed.  Pure Python."""
    net = plan.net
    first = n_prologue(net)
    room = target - plan.side_bytes
    chains = {}
    for e in entries:
        if e.bwd_read is not None and e.recompute is None:
            c = recompute_layers(net, e.buf)
            if c is not None:
                chains[id(e)] = c
    if not chains:
        return 0

    def state():
        return [(e.prefetch, e.on_demand, e.hold, e.recompute, e.release) for e in entries]

    def reset(st):
        for e, (p, o, h, r, rel) in zip(entries, st):
            e.prefetch, e.on_demand, e.hold, e.recompute, e.release = p, o, h, r, rel
        recompute_lives(net, entries)

    def gain(e):
        return e.copy_bytes * (1 / d2h + 1 / h2d) - sum(times[i] for i in chains[id(e)])

    best, kept = simulate(times, entries, first, d2h, h2d)[0], state()
    n = 0
    for e in sorted((e for e in entries if id(e) in chains), key=lambda e: -gain(e)):
        if gain(e) <= 0 and not force:
            break
        took = False
        ways = [chains[id(e)]]
        if THROUGH:       # (``force``: the longest chains first, for the tests)
            ways.insert(len(ways) if not force else 0, through_chain(net, e, chains, entries))
        for chain in ways:
            if chain is None:
                continue
            e.recompute = chain
            if recompute_lives(net, entries) and recompute_fits(plan, entries, room):
                total = simulate(times, entries, first, d2h, h2d)[0]
                if total < best - 1e-9 or force:
                    best, kept, took = total, state(), True
            reset(kept)
            if took and force:
                break
        n += took
    reset(kept)
    return n


# -- the plan of a policy ------------------------------------------------------------------
class OffloadPlan:
    """A MemoryPlan with ``entries`` split into their two lives, placed, and the
    schedule's tables filled in.  ``plan`` is changed in place."""

    def __init__(self, plan, entries, policy, budget=0, info=None):
        self.plan, self.policy, self.budget = plan, policy, budget
        self.info = info or {}
        self.net = plan.net
        self.base_peak = plan.peak
        by_mem = {id(b.mem): b for b in plan.buffers if b.part is None}
        self.entries = []
        for e in entries:                       # entries may come from another plan object
            b = by_mem[id(e.buf.mem)]
            if b is not e.buf:
                e2 = Entry(b)
                for k in ("prefetch", "on_demand", "conv_input", "hold", "lane", "recompute",
                          "bwd_first", "bwd_last"):
                    setattr(e2, k, getattr(e, k))
                e = e2
            parts = plan.split(b, e.lives())
            e.fwd = parts[0]
            e.bwd = parts[1] if len(parts) > 1 else None
            self.entries.append(e)
        # a recomputing layer's cuDNN forward workspace: a place of its own, live at the
        # recompute only (its forward step's place is another map's by then)
        # and the maps it makes on the way (``through_chain``): each a place of its own,
        # live right before the op of its first reader's step only (``Buffer.boundary``)
        from .plan import Buffer, WorkspaceMemory, workspace_need
        self.redo_ws, self.through = {}, {}
        for e in self.entries:
            if e.recompute is None:
                continue
            for i in e.recompute:
                need = workspace_need(self.net.layers[i], "forward")
                if need > 0:
                    w = Buffer(WorkspaceMemory(self.net.layers[i], "forward", need),
                               "workspace", f"{self.net.layer_names[i]} (recompute workspace)")
                    w.part, w.start, w.end = "recompute", e.bwd_first, e.bwd_first
                    w.boundary = True
                    plan.buffers.append(w)
                    self.redo_ws.setdefault(id(e), []).append(w)
            for m in recompute_through(self.net, e):
                t = Buffer(m, "data", f"{by_mem[id(m)].names[0]} (made again for {e.name})")
                t.part, t.start, t.end, t.boundary = "recompute", e.bwd_first, e.bwd_first, True
                plan.buffers.append(t)
                self.through.setdefault(id(e), []).append(t)
        plan.place()
        self._releases()
        off = 0
        for e in self.entries:
            if e.recompute is not None:
                continue
            e.slot = off
            off += (e.copy_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
        self.host_bytes = off
        copied = [e for e in self.entries if e.recompute is None]
        self.moved_bytes = sum(e.copy_bytes for e in copied)
        self.returned_bytes = sum(e.copy_bytes for e in copied if e.bwd is not None)
        self.recomputed_bytes = sum(e.copy_bytes for e in self.entries
                                    if e.recompute is not None)

    @property
    def peak(self):
        return self.plan.peak

    def _releases(self):
        """The compute stream waits for a buffer's device->host copy before the first step
        that puts another buffer where its forward life was (or at the end of the step's
        body, which joins the copy streams anyway)."""
        placed = self.plan.buffers
        for e in self.entries:
            if e.recompute is not None:      # no copy to wait for
                e.release = None
                continue
            f = e.fwd
            lo, hi = f.offset, f.offset + f.nbytes
            later = [b.start for b in placed if b is not f and b.start > f.end
                     and b.offset < hi and lo < b.offset + b.nbytes]
            e.release = min(later) if later else None

    def tables(self):
        """Per step: {'point_fwd', 'wait_out', 'out', 'fetch', 'need', 'recompute'} ->
        entries (the recomputed ones in the order their producers run)."""
        t = collections.defaultdict(lambda: collections.defaultdict(list))
        for e in sorted(self.entries, key=lambda e: e.recompute[-1] if e.recompute else -1):
            t[e.first]["point_fwd"].append(e)
            if e.recompute is not None:
                t[e.bwd_first]["recompute"].append(e)
                continue
            t[e.d2h_after]["out"].append(e)
            if e.release is not None:
                t[e.release]["wait_out"].append(e)
            if e.bwd is not None:
                t[e.prefetch]["fetch"].append(e)
                t[e.bwd_first]["need"].append(e)
        return t

    def describe(self):
        """Log lines: the totals, then one line per offloaded buffer."""
        net = self.net
        out = [f"Offload plan of net {net.name} ({self.policy}"
               f"{', budget %.2f GiB' % (self.budget / GiB) if self.budget else ''}): "
               f"{sum(1 for e in self.entries if e.recompute is None)} feature map(s) to "
               f"host memory, {self.moved_bytes / GiB:.2f} GiB out and "
               f"{self.returned_bytes / GiB:.2f} GiB back per iteration"
               + (f", {sum(1 for e in self.entries if e.recompute is not None)} recomputed "
                  f"({self.recomputed_bytes / GiB:.2f} GiB)" if self.recomputed_bytes else "")
               + f"; planned peak {self.peak / GiB:.2f} GiB "
               f"(without offload {self.base_peak / GiB:.2f} GiB)"]
        if "total_s" in self.info:
            c, t = self.info["compute_s"], self.info["total_s"]
            out.append(f"  model: {c * 1e3:.1f} ms of compute per forward-backward, "
                       f"{t * 1e3:.1f} ms with the copies (+{(t / c - 1) * 100 if c else 0:.1f}%)"
                       f"{'; %d offload(s) do not hide' % self.info['exposed'] if self.info.get('exposed') else ''}")
        for e in self.entries:
            if e.recompute is not None:
                ni, _ = step_layer(net, e.bwd_first)
                through = [t.names[0].split(" (")[0] for t in self.through.get(id(e), ())]
                out.append(f"  {e.name}: {e.copy_bytes / MiB:.1f} MiB dropped after its "
                           f"forward, recomputed (forward of "
                           f"{'+'.join(repr(net.layer_names[i]) for i in e.recompute)} "
                           f"again) before '{net.layer_names[ni]}' runs backward, no copy"
                           + (f"; made on the way, in a place of their own: "
                              f"{', '.join(through)}" if through else ""))
                continue
            li, _ = step_layer(net, e.d2h_after)
            back = ""
            if e.bwd is not None:
                pi, _ = step_layer(net, e.prefetch)
                ni, _ = step_layer(net, e.bwd_first)
                back = (f", back while '{net.layer_names[pi]}' runs backward, for "
                        f"'{net.layer_names[ni]}'{' (on demand)' if e.on_demand else ''}")
            out.append(f"  {e.name}: {e.copy_bytes / MiB:.1f} MiB out after "
                       f"'{net.layer_names[li]}'{' (second stream)' if e.lane else ''}{back}")
        return out


def build(net, policy, budget=0, history_sets=1, times=None, hide=None):
    """The OffloadPlan of ``policy`` for ``net``'s training step (a fresh MemoryPlan,
    split).  DYNAMIC needs ``times`` (seconds per step); a budget that even ALL cannot
    meet raises BudgetError.  Unless ``hide`` (default ``HIDE``) is false, then (over
    ``times`` or ``estimate_times``, within the budget less ``BUDGET_MARGIN``, or within
    the peak of the plan without it where there is no budget): DYNAMIC keeps on the device what fits
    (``keep_on_device``), maps are recomputed instead of copied where that is shorter
    (``choose_recompute``, unless ``RECOMPUTE`` is false), and the lives of the copied
    ones are lengthened where their copies need it (``hide_copies``).  Pure Python:
    runs without a GPU."""
    from .plan import MemoryPlan
    op = _build(net, policy, budget, history_sets, times)
    if not op.entries:
        return op
    times = times if times is not None else estimate_times(net)
    first = n_prologue(net)
    # the second device->host stream, chosen over the placed plan, where the compute
    # stream waits as placed (the streams change no place in the arena); hide_copies
    # starts from these lanes, and they are chosen again over its plan
    op.info = dict(op.info, lanes=choose_lanes(op.entries, times, first, lazy=True))
    if not (HIDE if hide is None else hide):
        return op
    limit = max(op.peak, budget - min(BUDGET_MARGIN, budget // 100) if budget else 0)
    names = [e.name for e in op.entries]
    target = limit
    for _ in range(4):       # the placement may leave gaps the live bytes do not show
        plan = MemoryPlan(net, train=True, history_sets=history_sets)
        by_name = {e.name: e for e in candidates(plan, "ALL" if policy != "CONV" else "CONV")}
        entries = [by_name[n] for n in names]
        for e, was in zip(entries, op.entries):     # fetched on demand to fit, say
            e.prefetch, e.on_demand, e.lane = was.prefetch, was.on_demand, was.lane
        kept = keep_on_device(plan, entries, times, target) if op.policy == "DYNAMIC" else []
        entries = [e for e in entries if e.name not in kept]
        redo = choose_recompute(plan, entries, times, target) if RECOMPUTE else 0
        n = hide_copies(plan, entries, times, target)
        if not n and not kept and not redo:
            return op
        live = int(live_bytes_with(plan, entries).max()) + plan.side_bytes
        hidden = OffloadPlan(plan, entries, op.policy, budget, op.info)
        if hidden.peak <= limit:
            lanes = choose_lanes(hidden.entries, times, first, lazy=True)
            hidden.info = dict(op.info, lengthened=n, unhidden_peak=op.peak, lanes=lanes,
                               kept=len(kept), recomputed=redo)
            return hidden
        target = min(target, live) - (hidden.peak - limit)
    return op


def _fetch_on_demand(net, policy, names, budget, history_sets):
    """The OffloadPlan of ``policy`` offloading the maps named ``names`` (with their
    vDNN prefetch points among ``policy``'s candidates), where that plan is over
    ``budget``: maps whose backward life covers the planned peak are fetched on demand
    instead (by their first backward reader, not ahead of it), the largest first, until
    the plan fits or none is left.  A prefetch ahead of a layer adds its map to that
    layer's working set (VGG-16: conv1_1's output coming back while pool1 runs backward
    over conv1_2's output and diff); on demand, that wait is the price of the budget."""
    from .plan import MemoryPlan
    pool = "CONV" if policy == "CONV" else "ALL"
    late = set()
    while True:
        plan = MemoryPlan(net, train=True, history_sets=history_sets)
        by_name = {e.name: e for e in candidates(plan, pool)}
        entries = [by_name[n] for n in names]
        for e in entries:
            if e.name in late:
                e.prefetch, e.on_demand = e.bwd_first, True
        op = OffloadPlan(plan, entries, policy, budget)
        if not budget or op.peak <= budget:
            return op
        s = int(np.argmax(live_bytes(op.plan)))
        more = [e for e in op.entries if e.bwd is not None and e.name not in late and
                e.prefetch <= s < e.bwd_first]
        if not more:
            return op
        late.add(max(more, key=lambda e: e.nbytes).name)


def _build(net, policy, budget, history_sets, times):
    from .plan import MemoryPlan
    policy = parse_policy(policy)
    plan = MemoryPlan(net, train=True, history_sets=history_sets)
    if policy == "NONE":
        if budget and plan.peak > budget:
            raise _none_too_big(net, plan, budget)
        return OffloadPlan(plan, [], policy, budget)
    if policy in ("ALL", "CONV"):
        op = OffloadPlan(plan, candidates(plan, policy), policy, budget)
        if budget and op.peak > budget:
            op = _fetch_on_demand(net, policy, [e.name for e in op.entries], budget,
                                  history_sets)
        if budget and op.peak > budget:
            raise budget_error(net, op.plan, budget, policy)
        return op
    # DYNAMIC
    if times is None:
        raise ValueError("DYNAMIC needs layer times (a profile or estimate_times)")
    if budget and plan.peak > budget:
        every = MemoryPlan(net, train=True, history_sets=history_sets)
        names = [e.name for e in candidates(every, "ALL")]
        if OffloadPlan(every, candidates(every, "ALL"), "ALL").peak > budget:
            fit = _fetch_on_demand(net, "ALL", names, budget, history_sets)
            if fit.peak > budget:
                raise budget_error(net, fit.plan, budget, "ALL")
            fit.policy, fit.info = "DYNAMIC", {"on_demand_to_fit": True}
            return fit            # ALL's maps, some fetched on demand to fit
    entries = candidates(plan, "ALL")
    chosen, info = choose_dynamic(plan, entries, times, budget)
    op = OffloadPlan(plan, chosen, "DYNAMIC", budget, info)
    if op.peak > budget:
        # the greedy placement left gaps the live bytes did not: offload more, by size
        rest = [e for e in candidates(MemoryPlan(net, train=True, history_sets=history_sets),
                                      "ALL") if e.name not in {c.name for c in op.entries}]
        while op.peak > budget and rest:
            rest.sort(key=lambda e: -e.nbytes)
            chosen = [e.name for e in op.entries] + [rest.pop(0).name]
            plan = MemoryPlan(net, train=True, history_sets=history_sets)
            all_e = {e.name: e for e in candidates(plan, "ALL")}
            op = OffloadPlan(plan, [all_e[n] for n in chosen], "DYNAMIC", budget, info)
        if op.peak > budget:
            op = _fetch_on_demand(net, "DYNAMIC", [e.name for e in op.entries], budget,
                                  history_sets)
            op.info = info
        if op.peak > budget:
            raise budget_error(net, plan, budget, "DYNAMIC (everything offloaded)")
    return op


def floor_parts(plan):
    """What the floor (``floor_bytes``) is made of: a dict with the worst step's
    ``layer`` and ``direction``, ``total`` bytes, the parts beside the arena
    (``params``, ``diffs`` (the parameters'), ``history``, ``scratch``, ``state``,
    ``cublas``) and the arena's at that step: ``workspace`` (bytes of the cuDNN
    workspaces live then, ``workspaces`` naming them), ``maps`` (the data that step
    reads or writes), ``map_diffs`` (the activations' diffs alive then) and ``kept``
    (what lives the whole iteration: inputs, outputs, losses), each of these four a
    list of (name, bytes), largest first.  At each step, the diffs alive then, the
    data the step itself touches and what lives the whole iteration: offload moves
    feature maps between their uses; it cannot take away what one layer's forward or
    backward reads and writes at once."""
    n, w = step_floor(plan)
    at = int(np.argmax(n + w)) if plan.steps else 0
    worst = int(n[at] + w[at]) if plan.steps else 0
    maps, diffs, kept = [], [], []
    for b in plan.buffers:
        if b.part == "backward":
            continue
        if b.pinned and b.start <= at <= b.end:
            kept.append((b.names[0], b.nbytes))
        elif b.kind == "diff" and b.start <= at <= b.end:
            diffs.append((b.names[0], b.nbytes))
        elif b.kind == "data" and (at in b.writes or at in b.reads or at in b.bwd_reads):
            maps.append((b.names[0], b.nbytes))
    hist = plan.param_bytes_total // plan.params_bytes - 2 if plan.params_bytes else 0
    i, direction = step_layer(plan.net, at) if plan.steps == 2 * len(plan.net.layers) else \
        (at, "forward")
    out = {"layer": plan.net.layer_names[i], "direction": direction,
           "params": plan.params_bytes, "diffs": plan.params_bytes if plan.train else 0,
           "history": plan.params_bytes * hist if plan.train else 0,
           "workspace": int(w[at]) if plan.steps else 0, "scratch": plan.scratch_bytes,
           "state": plan.state_bytes, "cublas": plan.fixed_bytes}
    wss = [(b.names[0], b.nbytes) for b in plan.buffers
           if b.kind == "workspace" and b.start <= at <= b.end]
    for key, items in (("maps", maps), ("map_diffs", diffs), ("kept", kept),
                       ("workspaces", wss)):
        out[key] = sorted(items, key=lambda x: -x[1])
    out["total"] = max(worst, 0) + plan.side_bytes
    return out


def floor_bytes(plan):
    """A lower bound on the planned peak of any offload policy: the total of
    ``floor_parts`` (the worst step's maps and diffs plus everything beside the arena)."""
    return floor_parts(plan)["total"]


def floor_lines(plan):
    """``minicaffe memory``'s account of the floor: what no offload policy can take off
    the device, part by part (in GiB, or MiB for a floor under 1 GiB)."""
    f = floor_parts(plan)
    unit, size = ("GiB", GiB) if f["total"] >= GiB else ("MiB", MiB)

    def amount(v):
        return f"{v / size:.3f}" if unit == "GiB" else f"{v / size:.2f}"

    def names(items, n=4):
        text = ", ".join(f"{k} {amount(v)}" for k, v in items[:n])
        return text + (f" and {len(items) - n} more" if len(items) > n else "")

    side = [("parameters", f["params"]), ("their diffs", f["diffs"]),
            ("solver history", f["history"]),
            ("scratch", f["scratch"]), ("layer state", f["state"]),
            ("cuBLAS workspace", f["cublas"])]
    arena = [("cuDNN workspace of that step", f["workspaces"]),
             ("feature maps it reads or writes", f["maps"]),
             ("activation diffs alive then", f["map_diffs"]),
             ("inputs, outputs and losses (kept all iteration)", f["kept"])]
    out = [f"floor under any offload policy: {amount(f['total'])} {unit}, at layer "
           f"'{f['layer']}' ({f['direction']}):"]
    out.append(f"  beside the arena: {amount(sum(v for _, v in side))} {unit} (" + ", ".join(
        f"{k} {amount(v)}" for k, v in side[:3]) + ",")
    out.append("    " + ", ".join(f"{k} {amount(v)}" for k, v in side[3:]) + ")")
    for what, items in arena:
        out.append(f"  {what}: {amount(sum(v for _, v in items))} {unit}"
                   + (f" ({names(items)})" if items else ""))
    return out


def _none_too_big(net, plan, budget):
    name, direction, need = _peak_layer(net, live_bytes(plan), plan.side_bytes)
    return BudgetError(
        f"net {net.name} needs {_fmt_bytes(plan.peak)} of device memory without offload "
        f"(layer '{name}', {direction}, at the peak), over the gpu_memory_budget of "
        f"{_fmt_bytes(budget)}: offload (--offload ALL, CONV or DYNAMIC) or a smaller batch")


# -- the report of `minicaffe memory` -------------------------------------------------------
def memory_rows(net, policies=POLICIES, budget=0, history_sets=1, times=None):
    """Per layer and per policy, before anything runs: rows of {'layer', 'type',
    'top_data', 'params', policy: {'live': max device bytes of the arena over the
    layer's forward and backward, 'offloaded': its top data leaves}} and a summary per
    policy ({'peak', 'moved', 'n', 'error'}).  DYNAMIC without ``times`` uses
    ``estimate_times``; without a budget it is left out (nothing to fit).  Each row's
    ``workspace`` is (forward, backward) bytes of the layer's cuDNN workspace, each in the
    arena at its own step (engine/plan.py)."""
    from .plan import workspace_need
    L = len(net.layers)
    rows = []
    for i, layer in enumerate(net.layers):
        seen, data = set(), 0
        for t in net.top_vecs[i]:
            if id(t.data_mem) not in seen:
                seen.add(id(t.data_mem))
                data += t.count() * t.dtype.itemsize
        rows.append({"layer": net.layer_names[i], "type": layer.type, "top_data": data,
                     "params": sum(b.count() * b.dtype.itemsize for b in layer.blobs),
                     "workspace": (workspace_need(layer, "forward"),
                                   workspace_need(layer, "backward"))})
    summary = {}
    for policy in policies:
        policy = parse_policy(policy)
        if policy == "DYNAMIC" and not budget:
            summary[policy] = {"error": "needs a budget (--gpu_mem_limit)"}
            continue
        try:
            op = build(net, policy, budget if policy in ("DYNAMIC",) else 0, history_sets,
                       times=times or (estimate_times(net) if policy == "DYNAMIC" else None))
        except BudgetError as e:
            summary[policy] = {"error": str(e)}
            continue
        live = live_bytes(op.plan)
        out_mems = {id(e.buf.mem) for e in op.entries if e.recompute is None}
        redo_mems = {id(e.buf.mem) for e in op.entries if e.recompute is not None}
        for i, r in enumerate(rows):
            steps = [i, 2 * L - 1 - i]
            r[policy] = {"live": int(max(live[s] for s in steps)),
                         "offloaded": any(id(t.data_mem) in out_mems for t in net.top_vecs[i]),
                         "recomputed": any(id(t.data_mem) in redo_mems
                                           for t in net.top_vecs[i])}
        redo = [e for e in op.entries if e.recompute is not None]
        summary[policy] = {"peak": op.peak, "moved": op.moved_bytes,
                           "n": len(op.entries) - len(redo), "back": op.returned_bytes,
                           "recomputed": len(redo),
                           "recomputed_bytes": sum(e.copy_bytes for e in redo),
                           "host": op.host_bytes, "fits": not budget or op.peak <= budget}
        if not summary[policy]["fits"]:
            summary[policy]["over"] = str(
                budget_error(net, op.plan, budget, policy) if policy != "NONE" else
                _none_too_big(net, op.plan, budget))
    return rows, summary


def format_memory_report(net, rows, summary, budget=0, estimated=False):
    pols = [p for p in summary if "error" not in summary[p]]
    head = f"{'layer':28s} {'type':16s} {'top MiB':>10s} {'params MiB':>10s}"
    for p in pols:
        head += f" {p + ' live MiB':>18s}"
    head += f" {'workspace MiB fwd/bwd':>22s}"
    out = [head]
    for r in rows:
        line = (f"{r['layer'][:28]:28s} {r['type'][:16]:16s} {r['top_data'] / MiB:10.2f} "
                f"{r['params'] / MiB:10.2f}")
        for p in pols:
            c = r.get(p)
            line += (f" {c['live'] / MiB:16.2f} "
                     f"{'h' if c['offloaded'] else 'r' if c.get('recomputed') else ' '}")
        wf, wb = r.get("workspace", (0, 0))
        line += f" {wf / MiB:10.2f} / {wb / MiB:.2f}"
        out.append(line)
    out.append("")
    out.append("live MiB: the feature maps, diffs and cuDNN workspaces on the device during the "
               "layer's forward or backward (the larger); h: its output goes to host memory; "
               "r: its output is dropped and made again in backward (no copy); "
               "workspace MiB fwd/bwd: the layer's cuDNN workspace, in the arena at its step "
               "only")
    for p, s in summary.items():
        if "error" in s:
            out.append(f"{p:8s}: {s['error']}")
            continue
        out.append(f"{p:8s}: planned peak {s['peak'] / GiB:8.3f} GiB; {s['n']} feature map(s) "
                   f"offloaded, {s['moved'] / GiB:.3f} GiB out and {s['back'] / GiB:.3f} GiB back "
                   f"per iteration" + (f"; {s['recomputed']} recomputed in backward "
                                       f"({s['recomputed_bytes'] / GiB:.3f} GiB, no copy)"
                                       if s.get("recomputed") else ""))
        if "over" in s:
            out.append(f"          over the budget: {s['over']}")
    if budget:
        out.append(f"budget: {budget / GiB:.2f} GiB")
    if estimated and "DYNAMIC" in pols:
        out.append("DYNAMIC here chooses from estimated layer times (a roofline guess); "
                   "training chooses from a timed iteration")
    return out


def memory_lines(net, history_sets=1, config=None):
    """``minicaffe memory``'s part: the net's policy and budget (``--offload``,
    ``--gpu_mem_limit`` applied) -- all four policies when it asks for none, else NONE
    and that one -- per layer and per policy, DYNAMIC from estimated layer times."""
    policy, budget = settings(net.net_param, config or net.config)
    budget = resolve_budget(budget)
    policies = POLICIES if policy == "NONE" else ("NONE", policy)
    rows, summary = memory_rows(net, policies, budget, history_sets)
    from .plan import MemoryPlan
    floor = floor_lines(MemoryPlan(net, train=True, history_sets=history_sets))
    return format_memory_report(net, rows, summary, budget, estimated=True) + [""] + floor


# -- the CUDA side ----------------------------------------------------------------------------
# one pinned allocation holding every offloaded buffer's slot (gpu/host.py)
HostSlab = HostMemory


class Offloader:
    """Runs an OffloadPlan inside a GpuStep (engine/step.py): the step calls ``begin()``
    before its body's forward, ``end()`` after its backward, ``park()`` after a graph
    replay; the copies are issued from the Net's layer hooks while a body runs."""

    @classmethod
    def for_step(cls, step):
        """None when the step's net asks for no offload; else the Offloader, its plan in
        ``step.plan`` (not applied yet).  Raises BudgetError before anything runs."""
        net = step.net
        policy, budget = settings(net.net_param, net.config)
        if policy == "NONE" and not budget:
            return None
        budget = resolve_budget(budget)
        hist = len(step.solver.history_flat)
        if budget and policy != "NONE":
            fit_workspace(net, budget, hist)
        if policy == "DYNAMIC":
            if not budget:
                total = backend.device_properties(backend.current_device())["totalGlobalMem"]
                budget = int(total * DEFAULT_BUDGET_SHARE)
            none = build(net, "NONE", 0, hist)
            if none.peak <= budget:
                log.info("Offload (DYNAMIC) of net %s: the planned peak %.2f GiB fits the "
                         "budget of %.2f GiB: nothing is offloaded", net.name,
                         none.peak / GiB, budget / GiB)
                step.plan = none.plan
                return None
            op = _build_fitting(net, "ALL", budget, hist)  # run under ALL until profiled
            log.info("Offload (DYNAMIC) of net %s: %.2f GiB planned without offload, over "
                     "the budget of %.2f GiB; the first iterations run under ALL (%.2f GiB), "
                     "one of them timed layer by layer", net.name, none.peak / GiB,
                     budget / GiB, op.peak / GiB)
        else:
            op = (_build_fitting(net, policy, budget, hist) if budget and policy != "NONE"
                  else build(net, policy, budget, hist))
            if policy == "NONE":
                step.plan = op.plan
                return None
            for line in op.describe():
                log.info("%s", line)
        step.plan = op.plan
        return cls(step, op, policy, budget)

    def __init__(self, step, oplan, policy, budget):
        self.step, self.net = step, step.net
        self.policy, self.budget = policy, budget
        # DYNAMIC chooses its maps, and every policy times its copies' lives
        # (hide_copies), from one iteration timed layer by layer
        self.pending_profile = policy == "DYNAMIC" or HIDE
        self.active = False
        self.profiling = False
        self.bodies = 0
        self.d2h = context.kept_stream("offload_d2h")
        self.h2d = context.kept_stream("offload_h2d")
        # the second device->host stream (``choose_lanes``): the maps the backward needs
        # first go out beside the large early ones, not behind them
        self.d2h2 = context.kept_stream("offload_d2h_late")
        self.lanes = (self.d2h, self.d2h2)
        self._use(oplan)
        net = self.net
        if not hasattr(net, "_offload_timeline"):
            net._offload_timeline = None
        if not getattr(net, "_offload_hooks", False):     # the Net's hooks, once per net
            net._offload_hooks = True
            L = len(net.layers)

            def hook(fn, to_step):
                return lambda i: net._offloader is not None and fn(net._offloader, to_step(i))
            net.add_hook("before_forward", hook(Offloader._before, lambda i: i))
            net.add_hook("after_forward", hook(Offloader._after, lambda i: i))
            net.add_hook("before_backward", hook(Offloader._before, lambda i: 2 * L - 1 - i))
            net.add_hook("after_backward", hook(Offloader._after, lambda i: 2 * L - 1 - i))
        net._offloader = self

    def _use(self, oplan):
        self.oplan = oplan
        self.table = oplan.tables()
        self.slab = HostSlab(oplan.host_bytes)
        ev = lambda: backend.new_event(timing=False)  # noqa: E731
        self.host = {}
        self.out_done, self.in_done = {}, {}
        for e in oplan.entries:
            if e.recompute is not None:
                continue
            m = e.buf.mem
            self.host[id(e)] = self.slab.view(e.slot, m.size, m.dtype)
            self.out_done[id(e)] = ev()
            self.in_done[id(e)] = ev()
        self.fork = {s: ev() for s in self.table}
        self.joins = (ev(), ev(), ev())

    def attach(self):
        """After ``plan.apply()``: every offloaded buffer starts parked in its slot."""
        self.park()

    def detach(self):
        """Stop acting on the Net's hooks (the net runs as if it had no offloader); a later
        Offloader made for the same net attaches itself again."""
        if getattr(self.net, "_offloader", None) is self:
            self.net._offloader = None

    # -- one body ---------------------------------------------------------------------
    def profiling_due(self, key, warm):
        """DYNAMIC: the first forward-backward after a warm one runs timed, then the
        plan is chosen (``profile``)."""
        return self.pending_profile and key[0] == "fb" and self.bodies >= 1 and warm

    def begin(self):
        self.active = True
        self.used = [False, False, False]       # d2h, h2d, the second d2h
        self.compute = backend.current_stream()
        if self.profiling:
            n = 2 * len(self.net.layers)
            Ev = backend.new_event
            self.marks = [(Ev(), Ev()) for _ in range(n)]

    def end(self):
        """Join the copy streams into the compute stream (a capture must end joined);
        park the offloaded buffers."""
        c = self.compute
        for k, s in enumerate((self.d2h, self.h2d, self.d2h2)):
            if self.used[k]:
                self.joins[k].record(s)
                c.wait_event(self.joins[k])
        self.active = False
        self.bodies += 1
        self.park()

    def park(self):
        """Each offloaded buffer's host side is its slot (newest after the step's copies),
        with no device side: what the host reads after a step is Caffe's value.  A
        recomputed one has neither (transient, as a diff): its place is another's by
        the end of the backward."""
        for e in self.oplan.entries:
            if e.recompute is not None:
                e.buf.mem.unbind_device(keep=False)
            else:
                e.buf.mem.park(self.host[id(e)])

    def _point(self, e, view):
        e.buf.mem.bind_device(view, keep_contents=False)

    def _before(self, s):
        if not self.active:
            return
        acts = self.table.get(s)
        c = self.compute
        if acts:
            for e in acts.get("wait_out", ()):
                c.wait_event(self.out_done[id(e)])
            fetch = acts.get("fetch")
            if fetch:
                self.fork[s].record(c)
                self.h2d.wait_event(self.fork[s])
                self.used[1] = True
                tl = self.net._offload_timeline
                for e in fetch:
                    self.h2d.wait_event(self.out_done[id(e)])
                    mark = tl.copy_begins(self.h2d) if tl is not None else None
                    _memcpy(e.bwd.view.data.ptr, self.host[id(e)].ctypes.data, e.copy_bytes,
                            _H2D, self.h2d)
                    if mark is not None:
                        tl.copy_ends(mark, self.h2d, "in", e, s)
                    self.in_done[id(e)].record(self.h2d)
            for e in acts.get("need", ()):
                c.wait_event(self.in_done[id(e)])
                self._point(e, e.bwd.view)
            for e in acts.get("recompute", ()):
                self._recompute(e, s)
            for e in acts.get("point_fwd", ()):
                self._point(e, e.fwd.view)
        if self.profiling:
            self.marks[s][0].record(c)

    def _recompute(self, e, s):
        """Make ``e`` again in its backward place on the compute stream: its producers'
        forward bodies (``Net.forward_again``: no hooks) with their cuDNN forward
        workspace at the recompute's own place (``OffloadPlan.redo_ws``)."""
        self._point(e, e.bwd.view)
        tl = self.net._offload_timeline
        mark = tl.copy_begins(self.compute) if tl is not None else None
        ws = self.oplan.redo_ws.get(id(e), ())
        saved = [(w, (getattr(w.mem.layer, "planned_workspace", None) or {}).get("forward"))
                 for w in ws]
        for w in ws:
            w.mem.bind_device(w.view)
        through = self.oplan.through.get(id(e), ())
        for t in through:            # maps made on the way (dropped ones: no contents)
            t.mem.bind_device(t.view, keep_contents=False)
        try:
            for i in e.recompute:
                self.forward_again(i)
        finally:
            for t in through:        # made again later for their own readers
                t.mem.unbind_device(keep=False)
            for w, old in saved:     # nothing may keep the recompute's view (the arena
                w.mem.unbind_device()   # must go at a re-plan): the forward's place back
                if old is not None:
                    w.mem.layer.planned_workspace["forward"] = old
        if mark is not None:
            tl.copy_ends(mark, self.compute, "redo", e, s)

    def forward_again(self, i):
        """Layer i's forward body once more (the fake device of the tests stands in)."""
        self.net.forward_again(i)

    def _after(self, s):
        if not self.active:
            return
        c = self.compute
        if self.profiling:
            self.marks[s][1].record(c)
        acts = self.table.get(s)
        out = acts.get("out") if acts else None
        if out:
            self.fork[s].record(c)
            tl = self.net._offload_timeline
            for lane, stream in enumerate(self.lanes):
                mine = [e for e in out if e.lane == lane]
                if not mine:
                    continue
                stream.wait_event(self.fork[s])
                self.used[2 if lane else 0] = True
                for e in mine:
                    mark = tl.copy_begins(stream) if tl is not None else None
                    dst, src = self.host[id(e)].ctypes.data, e.fwd.view.data.ptr
                    for a in range(0, e.copy_bytes, COPY_CHUNK):    # pieces: see COPY_CHUNK
                        _memcpy(dst + a, src + a, min(COPY_CHUNK, e.copy_bytes - a), _D2H,
                                stream)
                    if mark is not None:
                        tl.copy_ends(mark, stream, "out", e, s)
                    self.out_done[id(e)].record(stream)

    def synchronize(self):
        """Wait for every copy stream."""
        for stream in (self.d2h, self.d2h2, self.h2d):
            stream.synchronize()

    # -- DYNAMIC ----------------------------------------------------------------------
    def profile(self, run_body):
        """Run one body timed layer by layer (eagerly; DYNAMIC under ALL), choose
        DYNAMIC's buffers and every policy's lives (``hide_copies``) from those times,
        and apply the new plan (the step's ``plan``)."""
        self.profiling = True
        try:
            run_body()
        finally:
            self.profiling = False
        self.compute.synchronize()
        first = n_prologue(self.net)
        times = [0.0] * len(self.marks)
        for s, (a, b) in enumerate(self.marks):
            if s >= first and s < 2 * len(self.net.layers) - first:
                times[s] = backend.elapsed_ms(a, b) * 1e-3
        self.marks = None
        self.times = times
        step = self.step
        hist = len(step.solver.history_flat)
        op = _build_fitting(self.net, self.policy, self.budget, hist, times=times)
        for line in op.describe():
            log.info("%s", line)
        self.synchronize()
        old, old_slab = self.oplan.entries, self.slab
        for e in old:                # nor any device side into the old arena: an offloaded
            e.buf.mem.unbind_device(keep=False)   # map fetched back would keep it allocated
        step.replan(op.plan)         # (what ALL had parked is copied from the old slab)
        self._use(op)
        kept = {id(e.buf.mem) for e in op.entries}
        for e in old:                # no host side may point into the old slab
            if id(e.buf.mem) not in kept:
                e.buf.mem.drop_host()
        self.attach()
        del old_slab
        self.pending_profile = False
        return step.plan


_D2H, _H2D = 2, 1   # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice


def _memcpy(dst, src, nbytes, kind, stream):
    backend.memcpy_async(dst, src, nbytes, kind, stream)


# -- the timeline: what the compute stream and the two copy streams did --------------------
class Timeline:
    """One forward-backward of a GpuStep as CUDA events: each step's start and end on
    the compute stream (its start recorded after the waits the offloader put before
    it), and each copy's start and end on its copy stream.  ``trace_iteration`` makes
    one; ``rows()``/``lines()`` read it.  The events are recorded by the Net's hooks
    (compute) and by the Offloader (copies) while ``net._offload_timeline`` is set."""

    def __init__(self, step):
        self.net = step.net
        self.step = step
        self.marks = {}             # plan step -> (start event, end event)
        self.copies = []            # (kind, entry, issuing step, start event, end event)
        net = self.net
        if not hasattr(net, "_offload_timeline"):
            net._offload_timeline = None
        if not getattr(net, "_timeline_hooks", False):
            net._timeline_hooks = True
            L = len(net.layers)

            def hook(fn, to_step):
                return lambda i: net._offload_timeline is not None and \
                    fn(net._offload_timeline, to_step(i))
            net.add_hook("before_forward", hook(Timeline._begins, lambda i: i))
            net.add_hook("after_forward", hook(Timeline._ends, lambda i: i))
            net.add_hook("before_backward", hook(Timeline._begins, lambda i: 2 * L - 1 - i))
            net.add_hook("after_backward", hook(Timeline._ends, lambda i: 2 * L - 1 - i))

    def _begins(self, s):
        ev = backend.new_event()
        ev.record(backend.current_stream())
        self.marks[s] = (ev, None)

    def _ends(self, s):
        if s in self.marks:
            ev = backend.new_event()
            ev.record(backend.current_stream())
            self.marks[s] = (self.marks[s][0], ev)

    def copy_begins(self, stream):
        ev = backend.new_event()
        ev.record(stream)
        return ev

    def copy_ends(self, start, stream, kind, entry, s):
        ev = backend.new_event()
        ev.record(stream)
        self.copies.append((kind, entry, s, start, ev))

    def read(self, t0):
        """Milliseconds from event ``t0``: ``self.steps`` {step: (start, end)} and
        ``self.copy_times`` [(kind, entry, issuing step, start, end)]."""
        ms = lambda ev: backend.elapsed_ms(t0, ev)  # noqa: E731
        self.steps = {s: (ms(a), ms(b)) for s, (a, b) in self.marks.items() if b is not None}
        self.copy_times = [(k, e, s, ms(a), ms(b)) for k, e, s, a, b in self.copies]
        self.marks, self.copies = {}, []

    def rows(self):
        """Per step that ran, in order: {'step', 'layer', 'dir', 'start', 'ms', 'wait',
        'waited_for', 'out', 'in'}: ``wait`` the milliseconds the compute stream stood
        still before it for copies (the latest end among the copies the offloader made
        it wait for, past the previous step's end), ``waited_for`` those copies' names,
        ``out``/``in`` the milliseconds each copy stream was busy during the step."""
        off = self.step.offload
        table = off.table if off is not None else {}
        end_of = {}
        for k, e, s, a, b in self.copy_times:
            end_of[(k, id(e))] = b
        out, prev_end = [], None
        busy = {k: self._busy(k) for k in ("out", "in")}
        for s in sorted(self.steps):
            a, b = self.steps[s]
            i, direction = step_layer(self.net, s)
            acts = table.get(s, {})
            waits = [("out", e) for e in acts.get("wait_out", ())] + \
                [("in", e) for e in acts.get("need", ())]
            wait, names = 0.0, []
            for k, e in waits:
                done = end_of.get((k, id(e)))
                if done is not None and prev_end is not None and done > prev_end:
                    wait = max(wait, min(done, a) - prev_end)
                    names.append(f"{k} {e.name}")
            redo = [(e.name, z - y) for k, e, t, y, z in self.copy_times
                    if k == "redo" and t == s]
            row = {"step": s, "layer": self.net.layer_names[i], "dir": direction,
                   "start": a, "ms": b - a, "wait": wait, "waited_for": names,
                   "redo": sum(ms for _, ms in redo),
                   "redone": [f"{n} {ms:.2f} ms" for n, ms in redo]}
            for k in ("out", "in"):
                row[k] = sum(max(0.0, min(b, z) - max(a, y)) for y, z in busy[k])
            out.append(row)
            prev_end = b
        return out

    def _busy(self, kind):
        """The intervals (ms) during which at least one copy of ``kind`` ran (the two
        device->host streams' copies overlap: counted once)."""
        out = []
        for a, b in sorted((a, b) for k, _, _, a, b in self.copy_times if k == kind):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    def summary(self, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S):
        """{'span', 'compute', 'wait', 'recompute', 'gaps', 'out_ms', 'in_ms', 'out_bytes',
        'in_bytes', 'bound'} in ms: the forward-backward's span, the compute stream's busy
        time in the steps, its waits for copies, its recomputes of dropped maps (before
        the steps that read them), its other idle time (launch gaps), each copy stream's busy
        time and bytes, and the copy bound max(compute, bytes out / d2h, bytes in / h2d)."""
        rows = self.rows()
        span = max([r["start"] + r["ms"] for r in rows] +
                   [b for *_, b in self.copy_times], default=0.0)
        first = min((r["start"] for r in rows), default=0.0)
        compute = sum(r["ms"] for r in rows)
        wait = sum(r["wait"] for r in rows)
        out_b = sum(e.copy_bytes for k, e, *_ in self.copy_times if k == "out")
        in_b = sum(e.copy_bytes for k, e, *_ in self.copy_times if k == "in")
        redo = sum(r["redo"] for r in rows)
        model = unlimited = None
        off = self.step.offload
        if off is not None and rows:        # the timeline model over the measured steps
            times = [0.0] * (2 * len(self.net.layers))
            for r in rows:
                times[r["step"]] = r["ms"] * 1e-3
            model = simulate(times, off.oplan.entries, n_prologue(self.net), d2h, h2d,
                             lazy=True)[0] * 1e3
            unlimited = fifo_bound(times, off.oplan.entries, n_prologue(self.net), d2h,
                                   h2d) * 1e3
        return {"span": span - first, "compute": compute, "wait": wait, "model": model,
                "unlimited": unlimited, "recompute": redo,
                "gaps": max(0.0, span - first - compute - wait - redo),
                "out_ms": sum(b - a for a, b in self._busy("out")),
                "in_ms": sum(b - a for a, b in self._busy("in")),
                "out_bytes": out_b, "in_bytes": in_b,
                "bound": max(compute, out_b / d2h * 1e3, in_b / h2d * 1e3)}

    def as_dict(self):
        """The rows, the copies and the summary, for JSON."""
        return {"rows": self.rows(), "summary": self.summary(),
                "copies": [{"kind": k, "name": e.name, "bytes": e.copy_bytes,
                            "lane": e.lane if k == "out" else 0,
                            "after" if k == "out" else "during":
                            "%s %s" % (self.net.layer_names[step_layer(self.net, s)[0]],
                                       step_layer(self.net, s)[1]),
                            "start": a, "end": b} for k, e, s, a, b in self.copy_times]}


def trace_iteration(step):
    """One forward-backward of GpuStep ``step`` (no update: the weights do not change),
    run eagerly with the timeline's events; returns the read Timeline.  For benchmarks
    (benchmarks/offload.py): eager launches add the host's dispatch between layers, which
    a replayed graph does not have."""
    tl = Timeline(step)
    net = step.net
    saved = step.graphs_on
    step.graphs_on = False
    net._offload_timeline = tl
    try:
        t0 = backend.new_event()
        t0.record(step.stream)
        step.forward_backward(first=True, with_update=False)
    finally:
        net._offload_timeline = None
        step.graphs_on = saved
    step.stream.synchronize()
    if step.offload is not None:
        step.offload.synchronize()
    tl.read(t0)
    return tl


def timeline_lines(rows, summary, copies=(), label=""):
    """The printed timeline (from ``Timeline.as_dict()``'s parts): one line per step,
    the copies, and the summary."""
    out = [f"timeline{' of ' + label if label else ''}: ms from the start of the forward; "
           f"compute = the step on the compute stream, wait = it stood still for the copies "
           f"named, out/in = ms the device->host / host->device stream copied during it"]
    out.append(f"  {'layer':24s} {'dir':3s} {'start':>8s} {'compute':>8s} {'wait':>7s} "
               f"{'out':>7s} {'in':>7s}  waited for")
    for r in rows:
        out.append(f"  {r['layer'][:24]:24s} {r['dir'][:3]:3s} {r['start']:8.2f} "
                   f"{r['ms']:8.2f} {r['wait']:7.2f} {r['out']:7.2f} {r['in']:7.2f}  "
                   f"{', '.join(r['waited_for'])}"
                   + ("; recomputed " + ", ".join(r["redone"]) if r.get("redone") else ""))
    if copies:
        out.append("  copies: name, direction (out2: the second device->host stream; redo: "
                   "recomputed on the compute stream), MiB, issued, start..end ms, GB/s")
        for c in copies:
            dt = c["end"] - c["start"]
            rate = c["bytes"] / (dt * 1e-3) / 1e9 if dt > 0 else float("nan")
            where = c.get("after") or c.get("during")
            kind = c["kind"] + ("2" if c.get("lane") else "")
            verb = {"out": "after", "redo": "before"}.get(c["kind"], "during")
            out.append(f"    {c['name'][:24]:24s} {kind:4s} {c['bytes'] / MiB:9.1f} "
                       f"{verb:6s} {where:27s} "
                       f"{c['start']:8.2f}..{c['end']:8.2f} {rate:6.1f}")
    sm = summary
    out.append(f"  span {sm['span']:.1f} ms: compute {sm['compute']:.1f}, waits for copies "
               f"{sm['wait']:.1f}, "
               + (f"recomputes {sm['recompute']:.1f}, " if sm.get("recompute") else "")
               + f"other idle (launches) {sm['gaps']:.1f}; device->host busy "
               f"{sm['out_ms']:.1f} ms ({sm['out_bytes'] / GiB:.2f} GiB), host->device busy "
               f"{sm['in_ms']:.1f} ms ({sm['in_bytes'] / GiB:.2f} GiB); copy bound "
               f"{sm['bound']:.1f} ms" + (f"; the timeline model ({D2H_BYTES_PER_S / 1e9:.0f}/"
                                          f"{H2D_BYTES_PER_S / 1e9:.0f} GB/s) says "
                                          f"{sm['model']:.1f} ms" if sm.get("model") else "")
               + (f", and with no memory limit on the lives {sm['unlimited']:.1f} ms"
                  if sm.get("unlimited") else ""))
    worst = sorted((r for r in rows if r["wait"] > 0), key=lambda r: -r["wait"])[:5]
    if worst:
        out.append("  longest waits: " + "; ".join(
            f"{r['layer']} {r['dir']} {r['wait']:.1f} ms ({', '.join(r['waited_for'])})"
            for r in worst))
    return out
