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
  device-to-host copy on a copy stream, started by an event from the compute stream and
  overlapping the next layers' compute; the compute stream waits for that copy (an event)
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
  the planned peak fits ``gpu_memory_budget``.

What the plan does not hold stays where it was: parameters, their diffs and the solver's
history, cuDNN's workspace, what layers keep from forward to backward
(``Layer.state_bytes``).  After a step an offloaded blob's host side is its slot in the
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
                 "conv_input", "on_demand")

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
        self.prefetch = None                           # step the host->device copy starts
        self.on_demand = False                         # fetched by the layer that needs it
        self.release = None                            # step that waits for device->host
        self.slot = None
        self.fwd = self.bwd = None
        self.conv_input = False

    def lives(self):
        out = [("forward", self.first, self.fwd_end)]
        if self.bwd_first is not None:
            out.append(("backward", self.prefetch, self.bwd_last))
        return out

    def __repr__(self):
        return (f"Entry({self.name}: fwd {self.first}..{self.fwd_end}, d2h after "
                f"{self.d2h_after}, bwd {self.prefetch}/{self.bwd_first}..{self.bwd_last})")


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


def simulate(times, entries, first=0, d2h=D2H_BYTES_PER_S, h2d=H2D_BYTES_PER_S, lazy=False):
    """Modelled seconds of one forward-backward: steps ``first..`` in order on the
    compute stream (``times[s]`` seconds each), the copies on a device->host and a
    host->device stream, with the schedule's event waits.  The compute stream waits for
    a buffer's device->host copy before ``release`` (``lazy``: as placed) or else right
    after its last forward reader, and for its host->device copy before its first
    backward reader.  Returns (total, stall), stall being the time compute waited."""
    after, release, fetch, need = (collections.defaultdict(list) for _ in range(4))
    for e in entries:
        after[e.d2h_after].append(e)
        r = e.release if lazy else e.fwd_end + 1
        if r is not None:
            release[r].append(e)
        if e.bwd_first is not None:
            fetch[e.prefetch].append(e)
            need[e.bwd_first].append(e)
    t = stall = d2h_free = h2d_free = 0.0
    out_done, in_done = {}, {}
    for s in range(first, len(times)):
        start = t
        for e in release.get(s, ()):
            start = max(start, out_done[id(e)])
        for e in fetch.get(s, ()):
            h2d_free = in_done[id(e)] = (max(h2d_free, start, out_done[id(e)]) +
                                         e.copy_bytes / h2d)
        for e in need.get(s, ()):
            start = max(start, in_done[id(e)])
        stall += start - t
        t = start + times[s]
        for e in after.get(s, ()):
            d2h_free = out_done[id(e)] = max(d2h_free, t) + e.copy_bytes / d2h
    total = max(t, d2h_free, h2d_free)
    return total, stall + (total - t)


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
                e2.prefetch, e2.on_demand, e2.conv_input = e.prefetch, e.on_demand, e.conv_input
                e = e2
            parts = plan.split(b, e.lives())
            e.fwd = parts[0]
            e.bwd = parts[1] if len(parts) > 1 else None
            self.entries.append(e)
        plan.place()
        self._releases()
        off = 0
        for e in self.entries:
            e.slot = off
            off += (e.copy_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
        self.host_bytes = off
        self.moved_bytes = sum(e.copy_bytes for e in self.entries)
        self.returned_bytes = sum(e.copy_bytes for e in self.entries if e.bwd is not None)

    @property
    def peak(self):
        return self.plan.peak

    def _releases(self):
        """The compute stream waits for a buffer's device->host copy before the first step
        that puts another buffer where its forward life was (or at the end of the step's
        body, which joins the copy streams anyway)."""
        placed = self.plan.buffers
        for e in self.entries:
            f = e.fwd
            lo, hi = f.offset, f.offset + f.nbytes
            later = [b.start for b in placed if b is not f and b.start > f.end
                     and b.offset < hi and lo < b.offset + b.nbytes]
            e.release = min(later) if later else None

    def tables(self):
        """Per step: {'point_fwd', 'wait_out', 'out', 'fetch', 'need'} -> entries."""
        t = collections.defaultdict(lambda: collections.defaultdict(list))
        for e in self.entries:
            t[e.first]["point_fwd"].append(e)
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
               f"{len(self.entries)} feature map(s) to host memory, "
               f"{self.moved_bytes / GiB:.2f} GiB out and {self.returned_bytes / GiB:.2f} GiB "
               f"back per iteration; planned peak {self.peak / GiB:.2f} GiB "
               f"(without offload {self.base_peak / GiB:.2f} GiB)"]
        if "total_s" in self.info:
            c, t = self.info["compute_s"], self.info["total_s"]
            out.append(f"  model: {c * 1e3:.1f} ms of compute per forward-backward, "
                       f"{t * 1e3:.1f} ms with the copies (+{(t / c - 1) * 100 if c else 0:.1f}%)"
                       f"{'; %d offload(s) do not hide' % self.info['exposed'] if self.info.get('exposed') else ''}")
        for e in self.entries:
            li, _ = step_layer(net, e.d2h_after)
            back = ""
            if e.bwd is not None:
                pi, _ = step_layer(net, e.prefetch)
                ni, _ = step_layer(net, e.bwd_first)
                back = (f", back while '{net.layer_names[pi]}' runs backward, for "
                        f"'{net.layer_names[ni]}'{' (on demand)' if e.on_demand else ''}")
            out.append(f"  {e.name}: {e.copy_bytes / MiB:.1f} MiB out after "
                       f"'{net.layer_names[li]}'{back}")
        return out


def build(net, policy, budget=0, history_sets=1, times=None, entries_from=None):
    """The OffloadPlan of ``policy`` for ``net``'s training step (a fresh MemoryPlan,
    split).  DYNAMIC needs ``times`` (seconds per step); a budget that even ALL cannot
    meet raises BudgetError.  Pure Python: runs without a GPU."""
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
            raise budget_error(net, plan, budget, policy)
        return op
    # DYNAMIC
    if times is None:
        raise ValueError("DYNAMIC needs layer times (a profile or estimate_times)")
    if budget and plan.peak > budget:
        every = MemoryPlan(net, train=True, history_sets=history_sets)
        if OffloadPlan(every, candidates(every, "ALL"), "ALL").peak > budget:
            raise budget_error(net, every, budget, "ALL")
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
            raise budget_error(net, plan, budget, "DYNAMIC (everything offloaded)")
    return op


def floor_bytes(plan):
    """A lower bound on the planned peak of any offload policy: at each step, the diffs
    alive then, the data the step itself touches and what lives the whole iteration;
    the largest of those plus everything beside the arena.  (Offload moves feature maps
    between their uses; it cannot take away what one layer's forward or backward reads
    and writes at once.)"""
    worst = 0
    for s in range(plan.steps):
        n = 0
        for b in plan.buffers:
            if b.part == "backward":
                continue
            if b.kind == "diff" or b.pinned:
                n += b.nbytes if b.start <= s <= b.end else 0
            elif s in b.writes or s in b.reads or s in b.bwd_reads:
                n += b.nbytes
        worst = max(worst, n)
    return worst + plan.side_bytes


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
    ``estimate_times``; without a budget it is left out (nothing to fit)."""
    L = len(net.layers)
    rows = []
    for i, layer in enumerate(net.layers):
        seen, data = set(), 0
        for t in net.top_vecs[i]:
            if id(t.data_mem) not in seen:
                seen.add(id(t.data_mem))
                data += t.count() * t.dtype.itemsize
        rows.append({"layer": net.layer_names[i], "type": layer.type, "top_data": data,
                     "params": sum(b.count() * b.dtype.itemsize for b in layer.blobs)})
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
        out_mems = {id(e.buf.mem) for e in op.entries}
        for i, r in enumerate(rows):
            steps = [i, 2 * L - 1 - i]
            r[policy] = {"live": int(max(live[s] for s in steps)),
                         "offloaded": any(id(t.data_mem) in out_mems for t in net.top_vecs[i])}
        summary[policy] = {"peak": op.peak, "moved": op.moved_bytes, "n": len(op.entries),
                           "back": op.returned_bytes,
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
    out = [head]
    for r in rows:
        line = (f"{r['layer'][:28]:28s} {r['type'][:16]:16s} {r['top_data'] / MiB:10.2f} "
                f"{r['params'] / MiB:10.2f}")
        for p in pols:
            c = r.get(p)
            line += f" {c['live'] / MiB:16.2f} {'h' if c['offloaded'] else ' '}"
        out.append(line)
    out.append("")
    out.append("live MiB: the feature maps and diffs on the device during the layer's forward "
               "or backward (the larger); h: its output goes to host memory")
    for p, s in summary.items():
        if "error" in s:
            out.append(f"{p:8s}: {s['error']}")
            continue
        out.append(f"{p:8s}: planned peak {s['peak'] / GiB:8.3f} GiB; {s['n']} feature map(s) "
                   f"offloaded, {s['moved'] / GiB:.3f} GiB out and {s['back'] / GiB:.3f} GiB back "
                   f"per iteration")
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
    policies = POLICIES if policy == "NONE" else ("NONE", policy)
    rows, summary = memory_rows(net, policies, budget, history_sets)
    return format_memory_report(net, rows, summary, budget, estimated=True)


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
        hist = len(step.solver.history_flat)
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
            op = build(net, "ALL", budget, hist)          # run under ALL until profiled
            log.info("Offload (DYNAMIC) of net %s: %.2f GiB planned without offload, over "
                     "the budget of %.2f GiB; the first iterations run under ALL (%.2f GiB), "
                     "one of them timed layer by layer", net.name, none.peak / GiB,
                     budget / GiB, op.peak / GiB)
        else:
            op = build(net, policy, budget, hist)
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
        self.pending_profile = policy == "DYNAMIC"
        self.active = False
        self.profiling = False
        self.bodies = 0
        self.d2h = context.kept_stream("offload_d2h")
        self.h2d = context.kept_stream("offload_h2d")
        self._use(oplan)
        net = self.net
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
            m = e.buf.mem
            self.host[id(e)] = self.slab.view(e.slot, m.size, m.dtype)
            self.out_done[id(e)] = ev()
            self.in_done[id(e)] = ev()
        self.fork = {s: ev() for s in self.table}
        self.joins = (ev(), ev())

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
        self.used = [False, False]
        self.compute = backend.current_stream()
        if self.profiling:
            n = 2 * len(self.net.layers)
            Ev = backend.new_event
            self.marks = [(Ev(), Ev()) for _ in range(n)]

    def end(self):
        """Join the copy streams into the compute stream (a capture must end joined);
        park the offloaded buffers."""
        c = self.compute
        for k, s in enumerate((self.d2h, self.h2d)):
            if self.used[k]:
                self.joins[k].record(s)
                c.wait_event(self.joins[k])
        self.active = False
        self.bodies += 1
        self.park()

    def park(self):
        """Each offloaded buffer's host side is its slot (newest after the step's copies),
        with no device side: what the host reads after a step is Caffe's value."""
        for e in self.oplan.entries:
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
                for e in fetch:
                    self.h2d.wait_event(self.out_done[id(e)])
                    _memcpy(e.bwd.view.data.ptr, self.host[id(e)].ctypes.data, e.copy_bytes,
                            _H2D, self.h2d)
                    self.in_done[id(e)].record(self.h2d)
            for e in acts.get("need", ()):
                c.wait_event(self.in_done[id(e)])
                self._point(e, e.bwd.view)
            for e in acts.get("point_fwd", ()):
                self._point(e, e.fwd.view)
        if self.profiling:
            self.marks[s][0].record(c)

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
            self.d2h.wait_event(self.fork[s])
            self.used[0] = True
            for e in out:
                _memcpy(self.host[id(e)].ctypes.data, e.fwd.view.data.ptr, e.copy_bytes,
                        _D2H, self.d2h)
                self.out_done[id(e)].record(self.d2h)

    # -- DYNAMIC ----------------------------------------------------------------------
    def profile(self, run_body):
        """Run one body timed layer by layer (eagerly, under ALL), choose DYNAMIC's
        buffers from those times, and apply the new plan (the step's ``plan``)."""
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
        op = build(self.net, "DYNAMIC", self.budget, hist, times=times)
        for line in op.describe():
            log.info("%s", line)
        self.d2h.synchronize()
        self.h2d.synchronize()
        old, old_slab = self.oplan.entries, self.slab
        step.plan.release()
        step.plan = op.plan
        step.plan.apply()            # (what ALL had parked is copied from the old slab)
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
