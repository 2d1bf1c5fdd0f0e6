"""The static memory plan of a net, a pass over the schedule of its training iteration
(engine/schedule.py): every activation's data and diff at a fixed place in one arena,
sharing memory where lifetimes do not overlap.  (No Caffe counterpart: Caffe allocates
every blob; the idea is MXNet's and tinygrad's memory planner.)

``memory_pass(schedule, net, ...)`` (or ``MemoryPlan(net, ...)``, which compiles the
schedule itself) walks the ops in order and reads what each layer step reads and writes
(``schedule.accesses``).  A training iteration is a sequence of steps: forward of layer
0..L-1 (steps 0..L-1), then backward of layer L-1..0 (steps L..2L-1); a fused op runs
the steps of both its layers.  Each device buffer of the net -- a blob's data or diff,
counted once however many blobs share it (Split, Flatten and in-place layers share) --
is live from the first step that writes it to the last that reads it:

- data: written by its producers' forward; read by its consumers' forward and by the
  backward of every layer that declares it retains it (``Layer.retain_inputs`` and
  ``retain_outputs``: a convolution reads its bottom, a ReLU its bottom, a max pooling
  with a mask neither...);
- diff: written by its consumers' backward, read by its producers' backward;
- kept for the whole iteration: what the data layers write (the inputs), what the host
  reads after the iteration (outputs, losses), and the loss weights kept in loss diffs;
  and, unless ``share_data``, every blob's data (see MemoryPlan).

Buffers are placed greedily, largest first, at the lowest offset that overlaps no placed
buffer of overlapping lifetime (offsets aligned to 256 bytes).  The arena is one
allocation made once, so addresses never change and a CUDA graph can replay over it.

A layer's cuDNN workspace (``layer.workspace_need(direction)``: a cuDNN convolution's,
for the algorithms it chose) is a buffer of the arena too, of kind ``workspace``, live
only during the op that runs that layer's forward (or backward): placed like any map,
it shares memory with the maps of other steps, so each convolution's workspace is
counted at its own step, not the largest one for the whole iteration.  ``apply()``
points the layer at its place (``layer.planned_workspace[direction]``).

With ``reduced_storage`` (the GPU step's plan of a net in bf16 or fp16 without offload;
engine/precision.py) the buffers ``storage_plan`` names are held in 2-byte words of their
reduced type (sized and bound so: ``SyncedMemory.bind_device(view, storage)``), and the
fp32 (or 16-bit) scratch of each cast op (``storage_casts``: around the ops whose layers
have no body for the planned type) is a buffer of kind ``cast``, live at its op only;
the weights a layer's 2-byte body casts to its type (``layer.reduced_weights``) are
buffers of kind ``weights``: a channels-last convolution's copy from its forward op to its
backward op, an InnerProduct's at each of its two ops; on a training plan whose copies
total at most ``ONE_CAST_LIMIT`` bytes, every copy from the first body step to its layer's
last call instead (``one_cast``: the step casts them all in one launch, kernels/wcast.py).

What the arena does not hold is counted beside it, so that ``peak`` predicts the device
memory of a training run: the parameters, their diffs and the solver's history (flat
buffers), what layers keep from forward to backward (``Layer.state_bytes``: masks, saved
inputs), scratch and cuBLAS's workspace.
"""

import numpy as np

from ..core import backend
from ..core import precision as P
from ..layers.layer import CAST_WEIGHTS
from .schedule import accesses, compile_iteration, fusion_pass, op_steps

ALIGN = 256
CUBLAS_WORKSPACE = 32 << 20
# the 2-byte weight copies of a net whose copies total at most this many bytes are cast
# in one launch at the start of the training step (kernels/wcast.py): on a small net a
# launch per layer costs more than the bytes; on a large one the copies would be held
# the whole step (each lives from its layer's forward otherwise)
ONE_CAST_LIMIT = 16 << 20


def one_weight_cast(nbytes):
    """Whether copies of ``nbytes`` in all are cast in one launch: ``ONE_CAST_LIMIT``,
    or the environment's ``MINICAFFE_ONE_WEIGHT_CAST`` (1: always, 0: never)."""
    from ..core import config
    forced = config.env("MINICAFFE_ONE_WEIGHT_CAST")
    return nbytes <= ONE_CAST_LIMIT if forced is None else forced


# buffer kinds that nothing touches before the op of their first step (the schedule
# runs no op on them between steps): a boundary buffer may share their place
FIRST_TOUCHED_BY_ITS_STEP = ("diff", "workspace")


def _aligned(n):
    return (int(n) + ALIGN - 1) // ALIGN * ALIGN


def _fusion(net, i):
    """(fused pair, role) of layer i in ``net`` (layers/fused.py), or (None, None)."""
    fusion_of = getattr(net, "fusion_of", None)
    return fusion_of(i) if fusion_of is not None else (None, None)


def workspace_need(layer, direction):
    """Bytes of cuDNN workspace ``layer``'s ``direction`` ("forward", "backward") takes:
    ``layer.workspace_need(direction)`` where it says, else its ``workspace_bytes``
    (both directions), else 0."""
    f = getattr(layer, "workspace_need", None)
    if callable(f):
        return int(f(direction) or 0)
    return int(getattr(layer, "workspace_bytes", 0) or 0)


class WorkspaceMemory:
    """The device memory of one layer's cuDNN workspace for one direction, as the plan
    sees a buffer (``size``, ``dtype``, ``bind_device``): binding it points the layer at
    its place in the arena (``layer.planned_workspace[direction]``)."""

    def __init__(self, layer, direction, nbytes):
        self.layer, self.direction = layer, direction
        self.size = int(nbytes)
        self.dtype = np.dtype(np.uint8)
        self.device_array = None

    def bind_device(self, view):
        self.device_array = view
        places = getattr(self.layer, "planned_workspace", None)
        if places is None:
            places = self.layer.planned_workspace = {}
        places[self.direction] = view

    def unbind_device(self, keep=False):
        self.device_array = None
        places = getattr(self.layer, "planned_workspace", None)
        if places is not None:
            places.pop(self.direction, None)


class Buffer:
    __slots__ = ("mem", "nbytes", "start", "end", "kind", "names", "offset", "pinned",
                 "writes", "reads", "bwd_reads", "part", "view", "storage", "layout",
                 "boundary")

    def __init__(self, mem, kind, name):
        self.mem = mem
        self.nbytes = _aligned(mem.size * mem.dtype.itemsize)
        self.start, self.end = None, None
        self.kind = kind
        self.names = [name]
        self.offset = None
        self.pinned = False   # alive for the whole iteration
        # data: the forward steps that write it (producer, in-place layers) and read it,
        # the backward steps that read it (``Layer.retain_inputs``/``retain_outputs``)
        self.writes, self.reads, self.bwd_reads = [], [], []
        # None, or which life of a split buffer this is ("forward", "backward": offload);
        # a part's device side is pointed at ``view`` by whoever split it, not by apply()
        self.part = None
        self.view = None
        self.storage = None   # FLOAT16/BFLOAT16: held in 2-byte words (reduced_storage)
        self.layout = None    # (N, C, H, W): held channels-last (layout_plan)
        # live only right before step ``start``'s op, after step ``start - 1``'s (an
        # offload recompute's workspace and the maps it makes on the way): it shares
        # memory with what step ``start``'s op alone first writes (``overlaps``)
        self.boundary = False

    def touch(self, step):
        self.start = step if self.start is None else min(self.start, step)
        self.end = step if self.end is None else max(self.end, step)

    def overlaps(self, other):
        if self.end < other.start or other.end < self.start:
            return False
        for a, b in ((self, other), (other, self)):
            # a buffer alive only before step s's op and a diff or workspace that step
            # s's op is the first to touch are never alive at once
            if a.boundary and not b.boundary and b.start == a.start and \
                    b.part is None and b.kind in FIRST_TOUCHED_BY_ITS_STEP:
                return False
        return True


def memory_pass(schedule, net, train=True, history_sets=1, share_data=False,
                reduced_storage=False):
    """The memory plan of ``net`` read from ``schedule``'s ops (see the module docstring);
    offload (engine/offload.py) splits and re-places its buffers."""
    return MemoryPlan(net, train, history_sets, share_data, schedule=schedule,
                      reduced_storage=reduced_storage)


class MemoryPlan:
    """The plan of ``net`` for a training iteration (``train=True``) or a forward pass,
    from ``schedule`` (None: the net's one-pass schedule with its fusions).

    With ``share_data`` false (what the GPU step uses) only diffs share memory: every
    blob's data keeps its own place, so what pycaffe code reads from ``net.blobs`` after
    an iteration is what Caffe would show; activation diffs, alive only during backward,
    share a region about the size of the largest few.  ``share_data`` lets data buffers
    that backward does not read share too (a forward-only pass, ``minicaffe memory``'s
    second figure)."""

    def __init__(self, net, train=True, history_sets=1, share_data=False, schedule=None,
                 reduced_storage=False):
        from .precision import layout_plan, storage_casts, storage_plan
        self.net = net
        self.train = train
        L = len(net.layers)
        self.steps = 2 * L if train else L
        end = self.steps
        bufs = {}

        def buf(mem, kind, name):
            b = bufs.get(id(mem))
            if b is None:
                b = bufs[id(mem)] = Buffer(mem, kind, name)
            elif name not in b.names:
                b.names.append(name)
            return b

        n_prologue = 0
        while n_prologue < L and net.layers[n_prologue].graph_prologue:
            n_prologue += 1
        outputs = set(net.output_blob_indices)
        if schedule is None:
            schedule = fusion_pass(compile_iteration(net), net)
        self.schedule = schedule
        seen = set()
        for op in schedule:
            for acc in accesses(net, op):
                # one pass of the iteration (iter_size repeats the same steps); a
                # forward-only plan stops at the backward
                if acc.step in seen or (acc.backward and not train):
                    continue
                seen.add(acc.step)
                i, layer = acc.layer, net.layers[acc.layer]

                def mem(u):
                    blob = (net.top_vecs if u.side == "top" else net.bottom_vecs)[i][u.j]
                    return blob.data_mem if u.kind == "data" else blob.diff_mem

                if not acc.backward:
                    for u in acc.writes:
                        b = buf(mem(u), "data", net.blob_names[u.blob])
                        b.touch(i)
                        b.writes.append(i)
                        if i < n_prologue or u.blob in outputs or layer.loss(u.j):
                            b.pinned = True
                    for u in acc.reads:
                        b = buf(mem(u), "data", net.blob_names[u.blob])
                        b.touch(i)
                        b.reads.append(i)
                    continue
                step = acc.step
                read = [mem(u) for u in acc.reads if u.kind == "data"]
                for b in {id(m): bufs[id(m)] for m in read}.values():
                    b.touch(step)
                    b.bwd_reads.append(step)
                for u in acc.reads:
                    if u.kind == "diff" and not layer.loss(u.j):
                        # (the loss weight lives in a loss top's diff: not planned)
                        buf(mem(u), "diff", net.blob_names[u.blob]).touch(step)
                for u in acc.writes:
                    buf(mem(u), "diff", net.blob_names[u.blob]).touch(step)
        # each layer's cuDNN workspace, live during the op that runs it (a fused pair's
        # op runs both layers' steps: the workspace spans them)
        self.workspaces = []
        for op in schedule:
            if op.kind not in ("forward", "backward") or (op.kind == "backward" and
                                                           not train):
                continue
            steps = op_steps(net, op)
            if not steps:
                continue
            direction = op.kind
            for i in op.layers:
                need = workspace_need(net.layers[i], direction)
                if need <= 0:
                    continue
                w = WorkspaceMemory(net.layers[i], direction, need)
                b = bufs[id(w)] = Buffer(w, "workspace",
                                         f"{net.layer_names[i]} ({direction} workspace)")
                b.start, b.end = min(steps), max(steps)
                self.workspaces.append(b)
        # real 16-bit storage: 2-byte buffers, and the cast ops' scratch at their op
        self.storage = storage_plan(net) if reduced_storage else {}
        self.layouts = layout_plan(net, self.storage)
        for b in bufs.values():
            s = self.storage.get(id(b.mem)) if b.kind in ("data", "diff") else None
            if s is not None:
                b.storage = s
                b.layout = self.layouts.get(id(b.mem))
                b.nbytes = _aligned(b.mem.size * P.ITEMSIZE[s])
        self.cast_groups = [g for g in storage_casts(net, schedule, self.storage, self.layouts)
                            if train or g.kind == "forward"]
        self.casts = []
        for g in self.cast_groups:
            for c in g.casts:
                b = bufs[id(c)] = Buffer(c, "cast", f"{c.name} ({c.kind} {c.want} scratch)")
                b.start, b.end = c.start, c.end
                self.casts.append(b)
        self.share_data = share_data
        self.weight_copies = self._weight_copies(net, schedule, train, bufs)
        loss_diffs = {id(t.diff_mem) for i, l in enumerate(net.layers)
                      for j, t in enumerate(net.top_vecs[i]) if l.loss(j)}
        self.buffers = []
        for b in bufs.values():
            if id(b.mem) in loss_diffs or b.mem.size == 0:
                continue
            if b.kind in ("workspace", "cast", "weights"):
                self.buffers.append(b)
                continue
            if b.pinned or (b.kind == "data" and not share_data):
                b.start, b.end = 0, end
            self.buffers.append(b)
        self.place()
        self._side(history_sets)

    def _weight_copies(self, net, schedule, train, bufs):
        """The buffers of the weights a layer's 2-byte body casts to its reduced type
        (``layer.reduced_weights(storage, nhwc)``: bytes, and whether the copy is kept from
        the forward to the backward), for the layers whose maps this plan holds in 2-byte
        words: a kept copy lives from the layer's forward op to its backward op, one cast
        at each call lives at that op only (a buffer per op, like a workspace).  Bound
        like a workspace (``planned_workspace["weights"]``, ``["forward weights"]``,
        ``["backward weights"]``), they share the arena with the maps of other steps
        instead of holding memory of their own for the whole run.  The layers that run
        on 2-byte buffers (``native_storage``) only."""
        from .precision import native_storage
        self.one_cast = []
        if not self.storage:
            return []
        steps = {}
        for op in schedule:
            if op.kind in ("forward", "backward") and (train or op.kind == "forward"):
                for i in op.layers:
                    steps.setdefault((op.kind, i), []).extend(op_steps(net, op))
        found = []
        for i, layer in enumerate(net.layers):
            f = getattr(layer, "reduced_weights", None)
            bot, top = net.bottom_vecs[i], net.top_vecs[i]
            if not callable(f) or not bot or not top or ("forward", i) not in steps:
                continue
            s = native_storage(net, i)       # it runs on 2-byte buffers of type s
            if s is None:
                continue
            nhwc = id(bot[0].data_mem) in self.layouts or id(top[0].data_mem) in self.layouts
            nbytes, kept = f(s, nhwc)
            if nbytes:
                found.append((i, layer, s, nbytes, kept))
        # small nets: every copy cast by one launch at the start of the step, each live
        # from there to its layer's last call (``one_cast``; engine/step.py launches it);
        # one launch casts to one type (a net mixing bf16 and fp16 layers casts per layer)
        one = train and found and len({f[2] for f in found}) == 1 and \
            one_weight_cast(sum(f[3] for f in found))
        first = min(min(st) for st in steps.values()) if steps else 0
        out = []
        for i, layer, s, nbytes, kept in found:
            fwd, bwd = steps[("forward", i)], steps.get(("backward", i), [])
            if one:
                spans = [(CAST_WEIGHTS, first, max(fwd + bwd))]
            elif kept:
                spans = [("weights", min(fwd), max(fwd + bwd))]
            else:
                spans = [(f"{k} weights", min(st), max(st))
                         for k, st in (("forward", fwd), ("backward", bwd)) if st]
            for direction, start, end in spans:
                w = WorkspaceMemory(layer, direction, nbytes)
                b = bufs[id(w)] = Buffer(w, "weights", f"{net.layer_names[i]} ({direction})")
                b.start, b.end = start, end
                out.append(b)
                if one:
                    self.one_cast.append((layer, s, w))
        return out

    def split(self, buf, parts):
        """Replace ``buf`` by one buffer per ``(part, start, end)``: the same
        SyncedMemory at its own place in the arena for each stretch of the iteration
        (offload: a forward life and a backward life).  ``place()`` after the splits."""
        self.buffers.remove(buf)
        out = []
        for part, start, end in parts:
            b = Buffer(buf.mem, buf.kind, buf.names[0])
            b.names = list(buf.names)
            b.writes, b.reads, b.bwd_reads = buf.writes, buf.reads, buf.bwd_reads
            b.part, b.start, b.end = part, start, end
            out.append(b)
        self.buffers.extend(out)
        return out

    def place(self):
        """Greedy placement (largest first, lowest free offset); sets ``arena_bytes`` and,
        once the side figures are known, ``peak``."""
        placed = []
        for b in sorted(self.buffers, key=lambda b: (-b.nbytes, b.start)):
            live = sorted((p.offset, p.offset + p.nbytes) for p in placed if p.overlaps(b))
            off = 0
            for lo, hi in live:
                if off + b.nbytes <= lo:
                    break
                off = max(off, hi)
            b.offset = off
            placed.append(b)
        self.arena_bytes = max((b.offset + b.nbytes for b in placed), default=0)
        self.unshared_bytes = sum(b.nbytes for b in self.buffers if b.part in (None, "forward"))
        if hasattr(self, "side_bytes"):
            self.peak = self.arena_bytes + self.side_bytes

    def lower_bound(self):
        """(bytes, step): the most bytes of the arena's buffers live at any one step, and
        the first such step.  No placement of these buffers makes the arena smaller than
        that; ``arena_bytes`` less it is what the greedy placement loses.  (An offload
        plan's buffers live only between two steps are left out: still a bound.)"""
        live = [0] * (self.steps + 2)
        for b in self.buffers:
            if not b.boundary:
                live[b.start] += b.nbytes
                live[b.end + 1] -= b.nbytes
        best, step, run = 0, 0, 0
        for s in range(self.steps + 1):
            run += live[s]
            if run > best:
                best, step = run, s
        return best, step

    def step_name(self, step):
        """"forward of 'conv1'", "backward of 'conv1'" for a plan's step number."""
        L = len(self.net.layers)
        if step >= 2 * L:
            return "the end of the iteration"
        i, d = (step, "forward") if step < L else (2 * L - 1 - step, "backward")
        return f"{d} of '{self.net.layer_names[i]}'"

    def unread_data(self):
        """(bytes, [first blob name of each buffer]) of the blob data this plan keeps the whole iteration although
        no backward reads it: what pycaffe reads from ``net.blobs[...].data`` after a step
        costs (``share_data`` lets it share; PyTorch frees such tensors).  The inputs,
        outputs and losses (kept anyway) are not counted."""
        if self.share_data or not self.train:
            return 0, []
        kept = [b for b in self.buffers if b.kind == "data" and b.part is None and
                not b.pinned and not b.bwd_reads and b.start == 0 and b.end == self.steps]
        return sum(b.nbytes for b in kept), [b.names[0] for b in kept]

    def _side(self, history_sets):
        net = self.net
        self.params_bytes = sum(_aligned(b.count() * b.dtype.itemsize)
                                for b in net.learnable_params)
        self.param_bytes_total = self.params_bytes * ((2 + history_sets) if self.train else 1)
        # the cuDNN workspaces are in the arena, each at its step (see the module docstring)
        self.workspace_bytes = max((b.nbytes for b in self.workspaces), default=0)
        ws = {}
        for b in self.workspaces:
            i = net.layers.index(b.mem.layer)
            ws.setdefault(i, {})[b.mem.direction] = b.nbytes
        self.rows = []
        self.state_bytes = 0
        for i, layer in enumerate(net.layers):
            bot, top = net.bottom_vecs[i], net.top_vecs[i]
            f, role = _fusion(net, i)
            kept = self.train and not (role and not f.second_backward_runs)
            st = int(layer.state_bytes(bot, top)) if kept else 0
            self.state_bytes += st
            data = sum(t.data_mem.size * P.ITEMSIZE[self.storage.get(id(t.data_mem), P.FLOAT)]
                       for t in top)
            params = sum(b.count() * b.dtype.itemsize for b in layer.blobs)
            # a fused pair shows its type on its first layer, its second marked "fused"
            kind = layer.type if f is None else f.type if role == 0 else f"{layer.type} (fused)"
            self.rows.append({"layer": net.layer_names[i], "type": kind, "top_data": data,
                              "state": st, "params": params,
                              "workspace_fwd": ws.get(i, {}).get("forward", 0),
                              "workspace_bwd": ws.get(i, {}).get("backward", 0)})
        self.scratch_bytes = max((int(getattr(l, "scratch_bytes", lambda b, t: 0)(
            net.bottom_vecs[i], net.top_vecs[i])) for i, l in enumerate(net.layers)), default=0)
        self.fixed_bytes = CUBLAS_WORKSPACE
        # everything beside the arena (a constant of the net: offload leaves it alone)
        self.side_bytes = (self.param_bytes_total + self.state_bytes +
                           self.scratch_bytes + self.fixed_bytes)
        self.peak = self.arena_bytes + self.side_bytes

    # -- applying it ---------------------------------------------------------------------
    def apply(self):
        """Allocate the arena on the current device and point every planned buffer at its
        place (contents that must survive are copied there: inputs written on the host,
        say)."""
        free, total = backend.device_memory()
        if self.peak > total:
            raise self.does_not_fit(total, "has")
        self.arena = backend.alloc_arena(max(self.arena_bytes, 1))
        if self.arena is None:
            raise self.does_not_fit(free, "has free")
        for b in self.buffers:
            m = b.mem
            dt = P.buffer_dtype(b.storage) if b.storage else m.dtype
            view = self.arena[b.offset:b.offset + m.size * dt.itemsize].view(dt)
            if b.part is not None:
                b.view = view      # the offload schedule points the memory here and back
                continue
            if b.storage:
                m.bind_device(view, storage=b.storage, layout=b.layout)
            else:
                m.bind_device(view)
            if self.share_data and b.kind == "data" and not (b.start == 0 and
                                                              b.end == self.steps):
                m.shared = b.names[0]    # a host read after a step warns (synced_memory)
        for blob in self.net._blobs:
            blob.drop_views()
        if self.cast_groups or getattr(self.net, "_storage_casts", None) is not None:
            from .precision import StorageCasts
            sc = getattr(self.net, "_storage_casts", None)
            if sc is None:
                sc = self.net._storage_casts = StorageCasts(self.net, [])
            sc.set_groups(self.cast_groups)
            sc.active = bool(self.storage)

    def release(self):
        """Give the arena back (before another plan of the same net is applied): what
        lives the whole iteration (inputs written on the host, say) is brought to the
        host first, so that the next ``apply()`` puts it in its new place."""
        if getattr(self, "arena", None) is None:
            return
        for b in self.buffers:
            b.view = None
            if b.part is None:     # what lives the whole iteration is kept; diffs are not
                b.mem.unbind_device(keep=b.start == 0 and b.end == self.steps)
        for blob in self.net._blobs:
            blob.drop_views()
        sc = getattr(self.net, "_storage_casts", None)
        if sc is not None:
            sc.active = False
        self.arena = None

    def does_not_fit(self, available, words):
        from ..core.errors import MinicaffeError
        mib = 1 << 20
        big = max(self.rows, key=lambda r: r["top_data"] + r["state"])
        return MinicaffeError(
            f"net {self.net.name}: training needs {self.peak / mib:.0f} MiB of GPU memory "
            f"(planned peak) but the GPU {words} {available / mib:.0f} MiB; the largest layer "
            f"is '{big['layer']}' ({(big['top_data'] + big['state']) / mib:.0f} MiB of "
            f"activations); use a smaller batch")

    # -- reporting -------------------------------------------------------------------------
    def report(self):
        """Lines of text: per layer bytes, then the totals and the planned peak."""
        mib = 1 << 20
        out = [f"{'layer':28s} {'type':18s} {'top data MiB':>12s} {'state MiB':>10s} "
               f"{'params MiB':>10s} {'workspace MiB fwd/bwd':>22s}"]
        for r in self.rows:
            out.append(f"{r['layer'][:28]:28s} {r['type'][:18]:18s} {r['top_data'] / mib:12.2f} "
                       f"{r['state'] / mib:10.2f} {r['params'] / mib:10.2f} "
                       f"{r['workspace_fwd'] / mib:10.2f} / {r['workspace_bwd'] / mib:9.2f}")
        out.append("")
        if self.storage:
            n16 = sum(1 for b in self.buffers if b.storage)
            nl = sum(1 for b in self.buffers if b.layout is not None)
            out.append(f"16-bit storage: {n16} of {sum(b.kind in ('data', 'diff') for b in self.buffers)}"
                       f" activation buffers in 2-byte words ({nl} channels-last); "
                       f"{len(self.casts)} cast ops' scratch "
                       f"({sum(b.nbytes for b in self.casts) / mib:.1f} MiB unshared); "
                       f"{len(self.weight_copies)} weight copies in the reduced type "
                       f"({sum(b.nbytes for b in self.weight_copies) / mib:.1f} MiB "
                       f"unshared{', cast in one launch' if self.one_cast else ''})")
        out.append(f"activations and their diffs: {self.unshared_bytes / mib:.1f} MiB unshared, "
                   f"{self.arena_bytes / mib:.1f} MiB in the planned arena "
                   f"({len(self.buffers)} buffers)")
        lb, at = self.lower_bound()
        out.append(f"the arena's lower bound (the most bytes live at one step, the "
                   f"{self.step_name(at)}): {lb / mib:.1f} MiB")
        unread, names = self.unread_data()
        if names:
            out.append(f"blob data kept the whole iteration that no backward reads (what "
                       f"pycaffe's net.blobs show after a step): {unread / mib:.1f} MiB in "
                       f"{len(names)} buffers")
        out.append(f"parameters{', diffs and solver history' if self.train else ''}: "
                   f"{self.param_bytes_total / mib:.1f} MiB")
        out.append(f"kept from forward to backward by layers: {self.state_bytes / mib:.1f} MiB")
        out.append(f"largest cuDNN workspace (in the arena, live at its layer's step only): "
                   f"{self.workspace_bytes / mib:.1f} MiB; shared "
                   f"scratch: {self.scratch_bytes / mib:.1f} MiB; cuBLAS workspace: "
                   f"{self.fixed_bytes / mib:.1f} MiB")
        out.append(f"planned peak: {self.peak / mib:.1f} MiB ({self.peak / (1 << 30):.2f} GiB)")
        return out
