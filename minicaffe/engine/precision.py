"""Reduced precision in the engine: the precision pass over a schedule and loss scaling
(NVIDIA Caffe 0.17's ``global_grad_scale``; PyTorch's ``GradScaler`` for the dynamic
scale).

- Real 16-bit storage on the GPU (the memory plan's, engine/plan.py): ``storage_plan
  (net)`` says which device buffers (a blob's data or diff, one SyncedMemory however
  many blobs share it) are held in 2-byte words of their reduced type: those whose
  every blob is typed so (core/precision.py), except the data layers' tops, the net's
  outputs and the loss tops (fp32: the host reads them).  ``native_storage(net, i)``
  says whether layer i has a body that reads and writes such buffers (a layer's
  ``reduced_body``: the cuDNN convolution and pooling, ReLU, Split, Flatten, Reshape...;
  on the CPU, which runs every layer in fp32, what the GPU's engine would do:
  ``NATIVE``).  ``storage_casts(net, schedule, storage)`` gives, per forward or backward
  op, the buffers whose planned type is not the one the op's layers take (fp32 for a
  layer without a reduced body): the ``cast`` ops that point such a buffer at a scratch
  of the wanted type for the span of the op (cast in where the op reads it, cast back,
  rounding, where it writes it).  ``StorageCasts`` runs them from the Net's hooks; the
  plan places their scratch buffers in its arena, live at their op only.
- Channels-last (NHWC): ``layout_plan(net, storage)`` says which of those 2-byte buffers
  the plan holds N, H, W, C in memory: every one whose blobs are all 4-D of one shape with
  more than one pixel, when the run's ``channels_last`` is on (``RunConfig``; unset:
  MINICAFFE_CHANNELS_LAST, off by default until the GPU failures docs/precision.md names
  are fixed).  The layers that take such buffers
  (``NHWC_TYPES``: cuDNN's convolution, pooling and batch norm through channels-last
  descriptors, the element-wise ones) read the layout from the buffer; an op whose
  layers are all such and native wants its 4-D buffers channels-last, every other op
  NCHW, and ``storage_casts`` places the casts that transpose (and convert the type)
  where the wanted and the stored layout differ -- the data layer's fp32 NCHW input
  into the first convolution's 16-bit NHWC scratch, VGG's pool5 back to NCHW for fc6.
  A pycaffe read of an NHWC buffer transposes on the host (``SyncedMemory.layout``).
- ``precision_pass(schedule, net)``: those cast ops, and where a blob stays an fp32
  buffer holding a reduced type's values (the emulation: the CPU, a net run outside the
  GPU step), a ``cast`` op after each forward op for every top its layer stores in a
  reduced type, after each backward op one for every bottom diff (the Net's rounding
  hooks, ``Net._round_to_storage``), so that ``minicaffe memory --schedule`` shows where
  the values change type.
- ``LossScaler(net, scale)``: multiplies the gradient of every loss by ``scale`` before
  the backward (the loss layers' top diffs, which hold their loss weights, scaled and
  put back after), so that small gradients survive a FLOAT16 diff; ``unscale()`` divides
  the parameter diffs by it before the update and says whether they are all finite.  A
  fixed scale (the net's ``global_grad_scale``) never changes.  The dynamic one starts at
  2^16, halves on every step whose gradients overflow (that step's update is skipped
  and counted in ``skipped``) and doubles after 2000 steps in a row without one.  Its
  state (``scale``, ``good``, ``skipped``) goes into a snapshot's ResumeState, so that a
  resume continues with the same scale.
- ``DeviceLossScale``: the same scaling held in device arrays, for the GPU step
  (engine/step.py), as PyTorch's GradScaler does it (``_amp_foreach_non_finite_check_and_
  unscale_`` + ``_amp_update_scale_``): the loss layers' gradient multiplied by the
  device-resident scale, ``unscale(diff)`` divides the flat parameter diffs by it and
  writes "some value is not finite" into a device flag that the fused update kernel reads
  (it skips the step: no host branch), ``update_state()`` halves the scale on overflow,
  doubles it after 2000 clean steps, counts the skipped steps -- all of it array
  operations on one-element arrays, so that it is captured into the replayed CUDA graph
  and the host waits for nothing per iteration.  The host reads the state only when it
  asks for it (``LossScaler.scale``/``good``/``skipped``: at display and snapshot).  The
  same code runs with numpy arrays (the CPU test holds it against ``LossScaler.unscale``).
"""
import dataclasses

import numpy as np

from ..core import config, context
from ..core import precision as P
from .schedule import Op, Schedule, accesses, op_steps

INIT_SCALE = 2.0 ** 16
GROWTH, BACKOFF, INTERVAL = 2.0, 0.5, 2000


# -- real 16-bit storage ----------------------------------------------------------------
def _pool_native(lp):
    from ..layers.registry import engine_name
    p = lp.pooling_param
    return p.pool in (0, 1) and len(lp.top) == 1 and engine_name(lp) != "CAFFE"


def _conv_native(lp):
    from ..layers.registry import engine_name
    return engine_name(lp) != "CAFFE"


# what the GPU engine's layers can run on 2-byte buffers (their ``reduced_body``), by
# type and parameters: what ``native_storage`` answers on the CPU
NATIVE = {
    "Convolution": _conv_native,
    "ReLU": lambda lp: lp.relu_param.negative_slope == 0,
    "Pooling": _pool_native,
    "Split": lambda lp: len(lp.top) <= 2,
    "InnerProduct": lambda lp: True,
    "Dropout": lambda lp: lp.phase == 0,
    "BatchNorm": lambda lp: not (lp.batch_norm_param.use_global_stats
                                 if lp.batch_norm_param.HasField("use_global_stats")
                                 else lp.phase == 1),
    "Eltwise": lambda lp: (lp.eltwise_param.operation == 1 and len(lp.bottom) == 2 and
                           all(c == 1 for c in lp.eltwise_param.coeff) and
                           not set(lp.top) & set(lp.bottom)),
    "Flatten": lambda lp: True,
    "Reshape": lambda lp: True,
}


# layers whose native body takes channels-last buffers (the layout read from the buffer)
NHWC_TYPES = frozenset({"Convolution", "Pooling", "BatchNorm", "Scale", "ReLU", "Eltwise",
                        "Split", "Dropout"})


def channels_last(net):
    """True when ``net``'s run holds its 2-byte 4-D feature maps channels-last."""
    cfg = getattr(net, "config", None)
    return cfg.nhwc if cfg is not None else bool(config.env("MINICAFFE_CHANNELS_LAST"))


def _mem_shapes(net):
    shapes = {}
    for b in net._blobs:
        for m in (b.data_mem, b.diff_mem):
            shapes.setdefault(id(m), set()).add(tuple(b.shape))
    return shapes


def _nhwc_shape(shapes):
    """The (N, C, H, W) of a buffer whose blobs ``shapes`` can be held channels-last (all
    4-D, one shape, more than one pixel), else None."""
    if shapes is None or len(shapes) != 1:
        return None
    s = next(iter(shapes))
    return s if len(s) == 4 and s[2] * s[3] > 1 else None


def layout_plan(net, storage):
    """{id(SyncedMemory): (N, C, H, W)} of the 2-byte buffers of ``storage``
    (storage_plan) held channels-last (see the module docstring); {} when off."""
    if not storage or not channels_last(net):
        return {}
    shapes = _mem_shapes(net)
    out = {}
    for k in storage:
        s = _nhwc_shape(shapes.get(k))
        if s is not None:
            out[k] = s
    return out


def native_storage(net, i):
    """The reduced type layer i of ``net`` runs in on 2-byte buffers (FLOAT16,
    BFLOAT16), or None: its types store data and diffs in one reduced type and its
    body takes them (``layer.reduced_body`` on the GPU; ``NATIVE`` on the CPU)."""
    t = getattr(net, "types", None)
    if t is None or not t.reduced:
        return None
    lt = t.layers[i]
    s = lt.forward_type
    if s == P.FLOAT or lt.backward_type != s:
        return None
    # every buffer it touches typed so: a layer reading an fp32-typed gradient (the loss's,
    # into the last InnerProduct) keeps its fp32 body, as the type rules say
    names = net.blob_names
    for j, b in enumerate(net.bottom_id_vecs[i]):
        if t.data.get(names[b]) != s or (net.bottom_need_backward[i][j] and
                                         t.diff.get(names[b]) != s):
            return None
    for b in net.top_id_vecs[i]:
        if t.data.get(names[b]) != s or (net.layer_need_backward[i] and
                                         t.diff.get(names[b]) != s):
            return None
    if context.is_gpu():
        ok = bool(getattr(net.layers[i], "reduced_body", False))
        fusion_of = getattr(net, "fusion_of", None)
        if not ok and fusion_of is not None:    # the second layer of a pair with a body
            f, role = fusion_of(i)                 # of its own (BatchNorm+Scale)
            ok = bool(role) and bool(getattr(f, "reduced_body", False))
    else:
        rule = NATIVE.get(lt.type)
        ok = rule is not None and rule(net.net_param.layer[i])
        if lt.type == "Scale" and i > 0:     # fused on the GPU with the BatchNorm before it
            prev, lp = net.net_param.layer[i - 1], net.net_param.layer[i]
            ok = prev.type == "BatchNorm" and list(lp.bottom) == list(prev.top) and \
                native_storage(net, i - 1) == s and len(lp.bottom) == 1
    return s if ok else None


def storage_plan(net):
    """{id(SyncedMemory): FLOAT16 or BFLOAT16} of the device buffers the GPU's memory plan
    holds in 2-byte words (see the module docstring); {} for an fp32 net."""
    t = getattr(net, "types", None)
    if t is None or not t.reduced:
        return {}
    keep = set()        # fp32 always: what the data layers write, outputs, losses
    n = 0
    while n < len(net.layers) and net.layers[n].graph_prologue:
        n += 1
    for i in range(len(net.layers)):
        for j, b in enumerate(net.top_vecs[i]):
            if i < n or net.layers[i].loss(j):
                keep.update((id(b.data_mem), id(b.diff_mem)))
    for k in net.output_blob_indices:
        b = net._blobs[k]
        keep.update((id(b.data_mem), id(b.diff_mem)))
    votes = {}
    for name, b in zip(net.blob_names, net._blobs):
        for mem, s in ((b.data_mem, t.data.get(name, P.FLOAT)),
                       (b.diff_mem, t.diff.get(name, P.FLOAT))):
            votes.setdefault(id(mem), set()).add(s)
    return {k: next(iter(v)) for k, v in votes.items()
            if len(v) == 1 and next(iter(v)) != P.FLOAT and k not in keep}


@dataclasses.dataclass
class Cast:
    """One buffer an op's layers want in another type than it is stored in: ``mem``
    (the SyncedMemory), ``name`` (its first blob's), ``kind`` (data, diff), ``stored``
    and ``want`` (FLOAT, FLOAT16, BFLOAT16), whether the op reads it (cast in before)
    and writes it (cast back after), the plan's steps it lives at; ``view``: its scratch
    in the arena once the plan is applied."""
    mem: object
    name: str
    kind: str
    stored: str
    want: str
    read: bool
    write: bool
    start: int
    end: int
    view: object = None
    saved: object = None
    stored_layout: object = None    # (N, C, H, W) when held channels-last
    want_layout: object = None      # (N, C, H, W) when the op wants it channels-last

    def describe(self, which):
        t, l = (self.stored, self.stored_layout) if which == "stored" else \
            (self.want, self.want_layout)
        return t + (" NHWC" if l is not None else "")

    @property
    def size(self):
        return self.mem.size

    @property
    def dtype(self):
        return P.buffer_dtype(self.want)

    def bind_device(self, view):
        self.view = view

    def unbind_device(self, keep=False):
        self.view = None


@dataclasses.dataclass
class CastGroup:
    """The casts of one forward or backward op: ``first`` and ``last`` are the layers
    whose hooks open and close it (a fused op spans two layers), ``native`` the reduced
    type its layers run in (None: fp32)."""
    kind: str
    first: int
    last: int
    native: object
    casts: list


def storage_casts(net, schedule, storage, layouts=None):
    """[CastGroup] of ``schedule``'s forward and backward ops under ``storage`` (what
    ``storage_plan`` gives) and ``layouts`` (``layout_plan``'s; None: computed); see the
    module docstring."""
    if not storage:
        return []
    if layouts is None:
        layouts = layout_plan(net, storage)
    shapes = _mem_shapes(net) if layouts else {}
    groups = []
    for op in schedule.ops:
        if op.kind not in ("forward", "backward") or "hooks only" in op.detail:
            continue
        natives = {native_storage(net, i) for i in op.layers}
        if len(op.layers) > 1:      # a fused pair may have a body of its own (BN+Scale)
            f = net.fusion_of(op.layers[0])[0]
            rule = getattr(f, "reduced_body", None)
            if rule is not None:
                lt = net.types.layers[op.layers[0]]
                natives = {lt.forward_type if rule and lt.forward_type == lt.backward_type
                           and lt.forward_type != P.FLOAT else None}
        native = natives.pop() if len(natives) == 1 else None
        want = native or P.FLOAT
        steps = op_steps(net, op)
        uses = []
        for acc in accesses(net, op):
            i = acc.layer
            for us, how in ((acc.reads, "read"), (acc.writes, "write")):
                for u in us:
                    blob = (net.top_vecs if u.side == "top" else net.bottom_vecs)[i][u.j]
                    mem = blob.data_mem if u.kind == "data" else blob.diff_mem
                    uses.append((mem, u, how))
        # channels-last: a native op of NHWC_TYPES layers whose every 4-D map can be
        # held so (one shape per buffer) wants its maps NHWC; every other op NCHW
        nhwc = bool(layouts) and native is not None and \
            all(net.layers[i].type in NHWC_TYPES and
                (not context.is_gpu() or getattr(net.layers[i], "nhwc_body", True))
                for i in op.layers)
        if nhwc:
            for mem, u, how in uses:
                sh = shapes.get(id(mem), ())
                if any(len(x) == 4 and x[2] * x[3] > 1 for x in sh) and \
                        _nhwc_shape(sh) is None:
                    nhwc = False
        found = {}
        for mem, u, how in uses:
            stored = storage.get(id(mem), P.FLOAT)
            s_lay = layouts.get(id(mem))
            w_lay = _nhwc_shape(shapes.get(id(mem))) if nhwc else None
            if (stored == want and s_lay == w_lay) or mem.size == 0:
                continue
            c = found.get(id(mem))
            if c is None:
                c = found[id(mem)] = Cast(mem, net.blob_names[u.blob], u.kind, stored,
                                          want, False, False, min(steps), max(steps),
                                          stored_layout=s_lay, want_layout=w_lay)
            setattr(c, how, True)
        layers = op.layers if op.kind == "forward" else tuple(reversed(op.layers))
        groups.append(CastGroup(op.kind, layers[0], layers[-1], native, list(found.values())))
    return groups


def _convert(src, dst, src_type, dst_type, src_layout=None, dst_layout=None):
    """``dst`` = ``src`` in ``dst_type`` (one of them FLOAT, or both the same), on the
    device of both; ``src_layout``/``dst_layout`` (N, C, H, W): that side is held
    channels-last (the other NCHW): transposed on the way."""
    from ..core import backend
    xp = np if isinstance(src, np.ndarray) else backend.gpu_module()
    if src_layout != dst_layout and xp is not np and src_type != dst_type and \
            src.flags.c_contiguous and dst.flags.c_contiguous:
        from ..kernels.precision import from_reduced_t, to_reduced_t
        n, c, h, w = src_layout or dst_layout        # (N, P, Q) -> (N, Q, P), one pass
        p, q = (h * w, c) if src_layout is not None else (c, h * w)
        src, dst = src.reshape(n, p, q), dst.reshape(n, q, p)
        if dst_type == P.FLOAT:
            from_reduced_t(src, dst, src_type)
        else:
            to_reduced_t(src, dst, dst_type)
        return
    if src_layout != dst_layout:
        n, c, h, w = src_layout or dst_layout
        if src_layout is not None:      # NHWC -> NCHW
            src, dst = src.reshape(n, h, w, c).transpose(0, 3, 1, 2), dst.reshape(n, c, h, w)
        else:                           # NCHW -> NHWC
            src, dst = src.reshape(n, c, h, w).transpose(0, 2, 3, 1), dst.reshape(n, h, w, c)
        if src_type == dst_type:
            dst[...] = src
            return
        if xp is np:
            src = np.ascontiguousarray(src)
    if xp is np:
        if dst_type == P.FLOAT:
            P.widen(np, src, dst, src_type)
        else:
            P.narrow(np, src, dst, dst_type)
        return
    from ..kernels.precision import from_reduced, to_reduced
    if dst_type == P.FLOAT:
        from_reduced(src, dst, src_type)
    else:
        to_reduced(src, dst, dst_type)


class StorageCasts:
    """Runs ``groups`` (storage_casts) from ``net``'s hooks: before the first layer of
    an op each cast points its buffer at its scratch (converted in where the op reads
    it), after the last one points it back (converted back, rounded, where the op wrote
    it).  Active while a plan is applied (``active``)."""

    def __init__(self, net, groups):
        self.net = net
        self.active = False
        self.set_groups(groups)
        net.add_hook("before_forward", lambda i: self._in(("forward", i)))
        net.add_hook("after_forward", lambda i: self._out(("forward", i)))
        net.add_hook("before_backward", lambda i: self._in(("backward", i)))
        net.add_hook("after_backward", lambda i: self._out(("backward", i)))

    def set_groups(self, groups):
        self.open, self.close = {}, {}
        for g in groups:
            if g.casts:
                self.open[(g.kind, g.first)] = g
                self.close[(g.kind, g.last)] = g

    def _in(self, key):
        g = self.open.get(key) if self.active else None
        if g is None:
            return
        for c in g.casts:
            m = c.mem
            if c.view is None or (m.reduced or P.FLOAT) != c.stored or \
                    m.layout != c.stored_layout:
                continue          # not bound as planned (no plan applied)
            old = m.gpu_data()    # the newest contents on the device
            c.saved = m.swap_device(c.view, c.want_layout)
            if c.read:
                _convert(old[:m.size], c.view[:m.size], c.stored, c.want, c.stored_layout,
                         c.want_layout)

    def _out(self, key):
        g = self.close.get(key) if self.active else None
        if g is None:
            return
        for c in g.casts:
            if c.saved is None:
                continue
            cur = c.mem.swap_device(c.saved, c.stored_layout)
            if c.write:
                _convert(cur[:c.mem.size], c.saved[:c.mem.size], c.want, c.stored,
                         c.want_layout, c.stored_layout)
            c.saved = None


def precision_pass(schedule, net, storage=None):
    """The cast ops of ``schedule`` (see the module docstring): with ``storage`` (a
    ``storage_plan``: the GPU step's, the default) those of real 16-bit storage around
    the ops whose layers want another type, and the rounding where a blob is an fp32
    buffer holding a reduced type's values (``Net.rounding``: not after a layer that
    writes only values it read; on the GPU a cuDNN convolution in a reduced type, and a
    fused pair, round in their own kernels)."""
    t = getattr(net, "types", None)
    rounding = getattr(net, "rounding", None)
    if t is None or not t.reduced or rounding is None:
        return schedule
    if storage is None:
        storage = storage_plan(net)
    real = {n for b, n in zip(net._blobs, net.blob_names) if id(b.data_mem) in storage}
    real_diff = {n for b, n in zip(net._blobs, net.blob_names) if id(b.diff_mem) in storage}
    groups = {(g.kind, g.first): g for g in storage_casts(net, schedule, storage)}
    out = []
    for op in schedule.ops:
        g = groups.get((op.kind, (op.layers[0] if op.kind == "forward" else
                                  op.layers[-1]) if op.layers else -1))
        for c in (g.casts if g else ()):
            if c.read:
                out.append(Op("cast", -1, c.name, f"{c.kind} {c.describe('stored')} -> "
                                                  f"{c.describe('want')} scratch"))
        out.append(op)
        for c in (g.casts if g else ()):
            if c.write:
                out.append(Op("cast", -1, c.name, f"{c.kind} {c.describe('want')} scratch -> "
                                                  f"{c.describe('stored')}"))
        if op.kind in ("prologue", "forward"):
            for i in op.layers:
                for name, s in rounding[0][i]:
                    if name not in real:
                        out.append(Op("cast", i, name, f"data to {s}"))
        elif op.kind == "backward" and "hooks only" not in op.detail:
            for i in reversed(op.layers):
                for name, s in rounding[1][i]:
                    if name not in real_diff:
                        out.append(Op("cast", i, name, f"diff to {s}"))
    return Schedule(out, schedule.passes + ["precision"])


class DeviceLossScale:
    """Loss scaling state in arrays of ``xp`` (cupy on the GPU step; numpy stands in for
    it in the CPU test), updated without a host read (see the module docstring).

    ``scale``/``inv`` float32[1], ``good``/``skipped`` int64[1], ``found`` int32[1] (1:
    this step's unscaled diffs hold a non-finite value; the fused update skips)."""

    def __init__(self, xp, dynamic, scale, good, skipped):
        self.xp = xp
        self.dynamic = dynamic
        self.scale = xp.zeros(1, dtype=np.float32)
        self.inv = xp.zeros(1, dtype=np.float32)
        self.good = xp.zeros(1, dtype=np.int64)
        self.skipped = xp.zeros(1, dtype=np.int64)
        self.found = xp.zeros(1, dtype=np.int32)
        self.load(scale, good, skipped)

    def load(self, scale, good, skipped):
        """Write the state from the host (at creation, on restore, or a user's setting)."""
        xp = self.xp
        self.scale[...] = xp.asarray(np.array([scale], dtype=np.float32))
        # the eager path's reciprocal (1/scale in double, rounded once to float32)
        self.inv[...] = xp.asarray(np.array([np.float32(1.0 / float(scale))]))
        self.good[...] = xp.asarray(np.array([good], dtype=np.int64))
        self.skipped[...] = xp.asarray(np.array([skipped], dtype=np.int64))

    def read(self):
        """(scale, good, skipped) on the host (the caller has synchronized the device)."""
        xp = self.xp
        get = (lambda a: a) if xp is np else xp.asnumpy
        return (float(get(self.scale)[0]), int(get(self.good)[0]),
                int(get(self.skipped)[0]))

    def scale_loss_diff(self, d):
        """A loss top's diff (its loss weight) times the scale, in place."""
        d *= self.scale.reshape(())     # a view: no host read; any shape of d

    def unscale(self, g):
        """The flat parameter diffs ``g`` divided by the scale (times its float32
        reciprocal, as ``LossScaler.unscale``); ``found`` = some value is not finite."""
        xp = self.xp
        if xp is not np:        # one kernel (kernels/step.py) for the ~6 of the generic code
            from ..kernels import step as step_kernels
            step_kernels.loss_scale_unscale(g, self.inv, self.found)
            return
        g *= self.inv
        self.found[...] = xp.logical_not(xp.isfinite(g).all()).astype(np.int32)

    def update_state(self):
        """After the (possibly skipped) update: the dynamic scale's rule on the device."""
        if self.xp is not np:   # one thread for the ~12 kernels below; ``found`` cleared
            from ..kernels import step as step_kernels
            step_kernels.loss_scale_update(self.scale, self.inv, self.good, self.skipped,
                                           self.found, self.dynamic, INTERVAL, BACKOFF,
                                           GROWTH)
            return
        if not self.dynamic:
            return                # a fixed scale never changes; its skips are not counted
        bad = self.found.astype(np.int64)                 # 1: this step was skipped
        good = (self.good + 1) * (1 - bad)
        grow = (good >= INTERVAL).astype(np.int64)
        self.good[...] = good * (1 - grow)
        self.skipped += bad
        # x0.5 on overflow, x2 after INTERVAL clean steps (powers of two: exact)
        factor = (1.0 - (1.0 - BACKOFF) * bad) * (1.0 + (GROWTH - 1.0) * grow)
        self.scale *= factor.astype(np.float32)
        self.inv[...] = 1.0 / self.scale
def storage_lines(net, storage=None):
    """Lines for ``minicaffe memory``: per layer, whether it runs on its 2-byte buffers
    (native) or in fp32 between cast ops, and the bytes of the planned storage."""
    t = getattr(net, "types", None)
    if t is None or not t.reduced:
        return []
    if storage is None:
        storage = storage_plan(net)
    where = "on this GPU" if context.is_gpu() else "on a GPU (the CPU emulates it in fp32)"
    out = [f"16-bit storage {where}: layer bodies on 2-byte buffers (native) or in fp32 "
           "(with cast ops around them):"]
    nhwc = bool(layout_plan(net, storage)) if storage else channels_last(net)
    for i, name in enumerate(net.layer_names):
        s = native_storage(net, i)
        lay = " channels-last" if s and nhwc and t.layers[i].type in NHWC_TYPES else ""
        out.append(f"  {name} ({t.layers[i].type}): " + (f"native {s}{lay}" if s else "fp32"))
    return out


class LossScaler:
    """Loss scaling of a training net (see the module docstring).  ``scale``, ``good`` and
    ``skipped`` are host values; once the GPU step holds the state (``to_device``), reading
    them waits for the device and reads its arrays, setting them writes there."""

    def __init__(self, net, scale):
        self.net = net
        self.dynamic = scale == P.DYNAMIC
        self.device = None     # the DeviceLossScale of the GPU step, when it runs one
        self._scale = INIT_SCALE if self.dynamic else float(scale)
        self._good = 0          # steps in a row without an overflow
        self._skipped = 0       # steps skipped for overflowing gradients
        self._loss_tops = {i: [net.top_vecs[i][j] for j in range(len(net.top_vecs[i]))
                               if layer.loss(j)]
                           for i, layer in enumerate(net.layers)}
        self._loss_tops = {i: tops for i, tops in self._loss_tops.items() if tops}
        self._saved = {}
        net.add_hook("before_backward", self._before_backward)
        net.add_hook("after_backward", self._after_backward)

    # -- the state, wherever it lives -----------------------------------------------------
    def _pull(self):
        # a fixed scale never moves on the device: the host's value (float64, as given)
        if self.device is not None and self.dynamic:
            if self.device.xp is not np:
                from ..core import backend
                backend.synchronize()     # the step's stream may still run iterations
            self._scale, self._good, self._skipped = self.device.read()

    def _push(self):
        if self.device is not None:
            if self.device.xp is not np:
                from ..core import backend
                backend.synchronize()
            self.device.load(self._scale, self._good, self._skipped)

    @property
    def scale(self):
        self._pull()
        return self._scale

    @scale.setter
    def scale(self, v):
        self._pull()
        self._scale = float(v)
        self._push()

    @property
    def good(self):
        self._pull()
        return self._good

    @good.setter
    def good(self, v):
        self._pull()
        self._good = int(v)
        self._push()

    @property
    def skipped(self):
        self._pull()
        return self._skipped

    @skipped.setter
    def skipped(self, v):
        self._pull()
        self._skipped = int(v)
        self._push()

    def to_device(self, xp):
        """Hand the state to arrays of ``xp`` (the GPU step, engine/step.py): from now on
        the loss gradient is scaled by the device's scale and the host reads the state
        only when asked.  Returns the DeviceLossScale."""
        self._pull()                   # a GPU step made anew takes over the old one's state
        self.device = DeviceLossScale(xp, self.dynamic, self._scale, self._good,
                                      self._skipped)
        return self.device

    # -- the eager path -------------------------------------------------------------------
    def _before_backward(self, i):
        tops = self._loss_tops.get(i)
        if not tops:
            return
        dev = self.device
        if dev is None and self._scale == 1.0:
            return
        xp = context.xp()
        saved = []
        for top in tops:
            d = top.mutable_diff_for(xp)
            saved.append(d.copy())
            if dev is not None:        # no host read: the device's scale (GPU step)
                dev.scale_loss_diff(d)
            else:
                d *= d.dtype.type(self._scale)
        self._saved[i] = saved

    def _after_backward(self, i):
        saved = self._saved.pop(i, None)
        if saved is not None:
            xp = context.xp()
            for top, d in zip(self._loss_tops[i], saved):
                top.mutable_diff_for(xp)[...] = d

    def unscale(self):
        """Divide the learnable parameters' diffs by the scale; True when they are all
        finite (the update may run), else the step is skipped and the scale backs off.
        (The eager path; the GPU step runs ``DeviceLossScale.unscale`` instead.)"""
        self._pull()
        xp = context.xp()
        inv = np.float32(1.0 / self._scale)
        finite = True
        for b in self.net.learnable_params:
            g = b.mutable_diff_for(xp)
            if self._scale != 1.0:
                g *= inv
            finite = finite and bool(xp.isfinite(g).all())
        if self.dynamic:
            if finite:
                self._good += 1
                if self._good >= INTERVAL:
                    self._scale *= GROWTH
                    self._good = 0
            else:
                self._skipped += 1
                self._scale *= BACKOFF
                self._good = 0
            self._push()
        return finite

    def describe(self):
        kind = "dynamic" if self.dynamic else "fixed"
        self._pull()
        return (f"loss scale {self._scale:g} ({kind}), {self._skipped} steps skipped for "
                "overflowing gradients")

    def state(self):
        self._pull()
        return self._scale, self._good, self._skipped

    def set_state(self, scale, good, skipped):
        if self.dynamic:
            self._pull()
            self._scale, self._good, self._skipped = float(scale), int(good), int(skipped)
            self._push()
