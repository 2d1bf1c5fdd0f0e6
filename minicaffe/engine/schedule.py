"""The training iteration as an explicit, printable list of ops, with passes over it
(tinygrad's schedule: ``tinygrad/engine/schedule.py``; no Caffe counterpart, where
Solver::Step calls Net::ForwardBackward and the update directly).

``compile_iteration(net, iter_size)`` gives the base list of one training iteration:

    prologue i        a data layer's forward (host work and a copy into its tops)
    forward i         layer i's forward
    backward i        layer i's backward (the layers that need one)
    loss              the iteration's loss read out (the GPU: from its ring, at log points)
    update            the solver's update of every learnable parameter

repeated ``iter_size`` times up to the backward (each pass adds into the same diffs).
Passes rewrite the list, each a plain function of a schedule and what it reads:

- ``fusion_pass(s, net)``: a fused pair (layers/fused.py) becomes one op
  ``forward i+j <type>`` (and one ``backward`` where the pair fuses its backward);
- ``offload_pass(s, net, oplan)``: an offload plan's copies (offload.py, its ``tables``:
  what the offloader does from the Net's hooks at each step) as ``copy_out``, ``wait``
  and ``copy_in`` ops beside the forward and backward ops they follow or precede, and
  its recomputes (a dropped map made again by its producers' forward right before its
  first backward reader) as ``recompute`` ops;
- ``allreduce_pass(s, net, buckets)``: with several ranks, ``allreduce k`` once the
  backward op that completes bucket k has run (parallel.make_bucket_plan), in the last
  pass of iter_size;
- ``engine/precision.precision_pass(s, net)``: a ``cast`` op wherever the Net's hooks
  round a blob to its reduced storage type (docs/precision.md); ``minicaffe memory
  --schedule`` prints it (the executors run the hooks, not these ops);

- the memory plan (engine/plan.py ``memory_pass``): every buffer's lifetime from the
  ops' reads and writes (``accesses``: what each layer step reads and writes, the
  backward's reads from the layers' ``retain_inputs``/``retain_outputs``), placed in one
  arena; offload and precision rewrite the plan it makes.

``schedule_for(net, iter_size, oplan, buckets)`` runs the passes; ``str(schedule)`` prints
it one op per line (``minicaffe memory --schedule``).  One executor runs it
(engine/executor.py ``run_ops``): eagerly with numpy on the CPU, eagerly with CuPy, or
captured once as a CUDA graph and replayed (the GPU step's body, engine/step.py); its
copies and all-reduces are made from the Net's hooks by the same plans the passes print.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Op:
    """One op: ``kind`` (prologue, forward, backward, copy_out, wait, copy_in, recompute,
    allreduce, loss, update), the layer index it concerns (or the bucket index), the names it
    concerns, and a detail (a fused type, the bytes copied...)."""
    kind: str
    index: int = -1
    name: str = ""
    detail: str = ""
    last: int = -1          # the last layer a fused op covers (-1: only ``index``)

    def __str__(self):
        where = "" if self.index < 0 else (f" {self.index}" if self.last < 0 else
                                            f" {self.index}-{self.last}")
        text = f"{self.kind}{where}"
        if self.name:
            text += f" {self.name}"
        if self.detail:
            text += f" ({self.detail})"
        return text

    @property
    def layers(self):
        """The layer indices this op runs (forward, backward, prologue)."""
        if self.index < 0:
            return ()
        return tuple(range(self.index, (self.last if self.last >= 0 else self.index) + 1))


class Schedule:
    """A list of ops and the passes applied to it (in order)."""

    def __init__(self, ops, passes=()):
        self.ops = list(ops)
        self.passes = list(passes)

    def kinds(self):
        return [op.kind for op in self.ops]

    def lines(self):
        head = "schedule of one training iteration" + (
            f" (passes: {', '.join(self.passes)})" if self.passes else "")
        return [head] + [f"{k:4d}  {op}" for k, op in enumerate(self.ops)]

    def __str__(self):
        return "\n".join(self.lines())

    def __iter__(self):
        return iter(self.ops)

    def __len__(self):
        return len(self.ops)


def _n_prologue(net):
    n = 0
    while n < len(net.layers) and net.layers[n].graph_prologue:
        n += 1
    return n


def compile_iteration(net, iter_size=1):
    """The base schedule of a training iteration of ``net`` (see the module docstring)."""
    ops = []
    first = _n_prologue(net)
    names = net.layer_names
    for _ in range(max(1, int(iter_size))):
        for i in range(len(net.layers)):
            ops.append(Op("prologue" if i < first else "forward", i, names[i]))
        for i in range(len(net.layers) - 1, -1, -1):
            # every layer: the Net's hooks run for each (the all-reduce's among them)
            ops.append(Op("backward", i, names[i], "" if net.layer_need_backward[i] else
                          "hooks only: nothing to compute"))
    ops.append(Op("loss"))
    ops.append(Op("update"))
    return Schedule(ops)


def fusion_pass(schedule, net):
    """Each fused group of ``net`` (``Net.fusions``: a pair, or BatchNorm+Scale+ReLU) as
    one forward op and, where the group fuses its backward, one backward op."""
    fusions = {f.index: f for f in getattr(net, "fusions", ())}
    if not fusions:
        return schedule
    ends = {f.index + f.size - 1: f for f in fusions.values()}
    out = []
    ops = schedule.ops
    k = 0
    while k < len(ops):
        op = ops[k]
        f = fusions.get(op.index)
        if op.kind == "forward" and f is not None and \
                _runs(ops[k:k + f.size], "forward", range(op.index, op.index + f.size)):
            out.append(Op("forward", op.index, "+".join(f.names), f.type,
                          op.index + f.size - 1))
            k += f.size
            continue
        f = ends.get(op.index)
        if op.kind == "backward" and f is not None and f.fuses_backward and \
                _runs(ops[k:k + f.size], "backward", range(op.index, f.index - 1, -1)):
            out.append(Op("backward", f.index, "+".join(f.names), f.type, op.index))
            k += f.size
            continue
        out.append(op)
        k += 1
    return Schedule(out, schedule.passes + ["fusion"])


def _runs(ops, kind, indices):
    """True when ``ops`` are ops of ``kind`` on exactly the layers ``indices``, in order."""
    indices = list(indices)
    return len(ops) == len(indices) and all(
        o.kind == kind and o.index == i and o.last < 0 for o, i in zip(ops, indices))


def op_steps(net, op):
    """The plan's step numbers (forward i = i, backward i = 2L-1-i: engine/plan.py) this
    op runs, in order."""
    L = len(net.layers)
    if op.kind in ("prologue", "forward"):
        return list(op.layers)
    if op.kind == "backward":
        return [2 * L - 1 - i for i in reversed(op.layers)]
    return []



@dataclasses.dataclass(frozen=True)
class Use:
    """One buffer an op reads or writes: a ``data`` or ``diff`` of a layer's ``top`` or
    ``bottom`` ``j`` (``blob``: the Net's blob index)."""
    kind: str
    side: str
    j: int
    blob: int


@dataclasses.dataclass(frozen=True)
class Access:
    """What one layer's step of an op reads and writes (``reads``, ``writes``: Uses)."""
    step: int
    layer: int
    backward: bool
    reads: tuple
    writes: tuple


def retained(layer, bottom, top):
    """(bottom indices, top indices) whose data ``layer``'s backward reads: its
    declarations ``retain_inputs``/``retain_outputs`` (None: all)."""
    rb, rt = layer.retain_inputs, layer.retain_outputs
    return (range(len(bottom)) if rb is None else rb), (range(len(top)) if rt is None else rt)


def _backward_reads(net, i):
    """The data the backward of layer i reads: its declarations, as its fused pair (if
    any) changes them (the pair's own reads added to its first layer's; nothing for a
    second layer whose backward the pair does)."""
    layer, bot, top = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
    fusion_of = getattr(net, "fusion_of", None)
    f, role = fusion_of(i) if fusion_of is not None else (None, None)
    if role and not f.second_backward_runs:
        return (), ()
    rb, rt = retained(layer, bot, top)
    if role == 0 and f.retain_outputs:
        rt = sorted(set(rt) | set(f.retain_outputs))
    return rb, rt


def accesses(net, op):
    """[Access] of ``op`` on ``net``, one per layer step it runs, in order: a forward
    writes its tops' data and reads its bottoms'; a backward (of a layer that needs one)
    reads the data it retains (``Layer.retain_inputs``/``retain_outputs``, as its fused
    pair changes them) and its tops' diffs, and writes the diffs of the bottoms it
    propagates to.  Other ops (copies, loss, update) touch no planned buffer."""
    out = []
    for step in op_steps(net, op):
        L = len(net.layers)
        backward = step >= L
        i = 2 * L - 1 - step if backward else step
        tops, bots = net.top_id_vecs[i], net.bottom_id_vecs[i]
        if not backward:
            writes = tuple(Use("data", "top", j, b) for j, b in enumerate(tops))
            reads = tuple(Use("data", "bottom", j, b) for j, b in enumerate(bots))
        elif not net.layer_need_backward[i]:
            reads = writes = ()
        else:
            rb, rt = _backward_reads(net, i)
            reads = tuple([Use("data", "bottom", j, bots[j]) for j in rb] +
                          [Use("data", "top", j, tops[j]) for j in rt] +
                          [Use("diff", "top", j, b) for j, b in enumerate(tops)])
            writes = tuple(Use("diff", "bottom", j, b) for j, b in enumerate(bots)
                           if net.bottom_need_backward[i][j])
        out.append(Access(step, i, backward, reads, writes))
    return out


def offload_pass(schedule, net, oplan):
    """The copies of offload plan ``oplan`` (offload.OffloadPlan) around the ops at whose
    steps the offloader acts: before a step, ``wait`` for a copy out whose place is reused
    and ``copy_in`` (prefetch) then ``wait`` for a copy in that this step reads, then
    ``recompute`` of the dropped maps it reads first; after a step, ``copy_out`` of the
    buffers its forward wrote last.  In each pass of iter_size."""
    if oplan is None or not oplan.entries:
        return schedule
    table = oplan.tables()
    out = []
    for op in schedule.ops:
        steps = op_steps(net, op)
        for s in steps:
            acts = table.get(s, {})
            for e in acts.get("wait_out", ()):
                out.append(Op("wait", -1, e.name, "copy out done: its place is reused"))
            for e in acts.get("fetch", ()):
                out.append(Op("copy_in", -1, e.name, f"{e.copy_bytes} bytes host->device"))
            for e in acts.get("need", ()):
                out.append(Op("wait", -1, e.name, "copy in done"))
            for e in acts.get("recompute", ()):
                out.append(Op("recompute", -1, e.name, "forward of " + "+".join(
                    net.layer_names[i] for i in e.recompute) + f" again, {e.copy_bytes} "
                    "bytes, no copy"))
        out.append(op)
        for s in steps:
            for e in table.get(s, {}).get("out", ()):
                out.append(Op("copy_out", -1, e.name, f"{e.copy_bytes} bytes device->host"))
    return Schedule(out, schedule.passes + [f"offload {oplan.policy}"])


def allreduce_pass(schedule, net, buckets):
    """With several ranks: ``allreduce k`` right after the backward op of the layer that
    completes bucket k (``Bucket.ready_layer``: the lowest layer owning one of its
    parameters), in the last pass of iter_size; a bucket of no layer that runs backward
    goes before the update."""
    if not buckets:
        return schedule
    by_layer = {}
    for b in buckets:
        by_layer.setdefault(b.ready_layer, []).append(b)
    last_pass = max(k for k, op in enumerate(schedule.ops) if op.kind in ("prologue", "forward"))
    out, done = [], set()
    for k, op in enumerate(schedule.ops):
        if op.kind == "update":
            for b in buckets:
                if b.index not in done:
                    out.append(Op("allreduce", b.index, "", f"{b.stop - b.start} floats"))
                    done.add(b.index)
        out.append(op)
        if op.kind == "backward" and k > last_pass:
            for i in op.layers:
                for b in by_layer.get(i, ()):
                    if b.index not in done:
                        out.append(Op("allreduce", b.index, "",
                                      f"{b.stop - b.start} floats"))
                        done.add(b.index)
    return Schedule(out, schedule.passes + ["allreduce"])


def schedule_for(net, iter_size=1, oplan=None, buckets=None):
    """The schedule of a training iteration of ``net``: the base list, then the fusion,
    offload and all-reduce passes (each a no-op where it has nothing to do)."""
    s = compile_iteration(net, iter_size)
    s = fusion_pass(s, net)
    s = offload_pass(s, net, oplan)
    return allreduce_pass(s, net, buckets)
