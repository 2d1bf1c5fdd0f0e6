"""Reduced precision in the engine: the precision pass over a schedule and loss scaling
(NVIDIA Caffe 0.17's ``global_grad_scale``; PyTorch's ``GradScaler`` for the dynamic
scale).

- ``precision_pass(schedule, net)``: after each forward op, a ``cast`` op for every top
  its layer stores in a reduced type, after each backward op one for every bottom diff
  (the Net's types, core/precision.py).  As the offload pass, it prints what the Net's
  hooks do at those points (``Net._round_to_storage``), so that ``minicaffe memory
  --schedule`` shows where the values change type.
- ``LossScaler(net, scale)``: multiplies the gradient of every loss by ``scale`` before
  the backward (the loss layers' top diffs, which hold their loss weights, scaled and
  put back after), so that small gradients survive a FLOAT16 diff; ``unscale()`` divides
  the parameter diffs by it before the update and says whether they are all finite.  A
  fixed scale (the net's ``global_grad_scale``) never changes.  The dynamic one starts at
  2^16, halves on every step whose gradients overflow (that step's update is skipped
  and counted in ``skipped``) and doubles after 2000 steps in a row without one.  Its
  state (``scale``, ``good``, ``skipped``) goes into a snapshot's ResumeState, so that a
  resume continues with the same scale.
"""
import numpy as np

from ..core import context
from ..core import precision as P
from .schedule import Op, Schedule

INIT_SCALE = 2.0 ** 16
GROWTH, BACKOFF, INTERVAL = 2.0, 0.5, 2000


def precision_pass(schedule, net):
    """``cast`` ops where the Net's hooks round a blob to its reduced storage type
    (``Net.rounding``: not after a layer that writes only values it read; on the GPU a
    cuDNN convolution in a reduced type, and a fused pair, round in their own kernels)."""
    t = getattr(net, "types", None)
    rounding = getattr(net, "rounding", None)
    if t is None or not t.reduced or rounding is None:
        return schedule
    out = []
    for op in schedule.ops:
        out.append(op)
        if op.kind in ("prologue", "forward"):
            for i in op.layers:
                for name, s in rounding[0][i]:
                    out.append(Op("cast", i, name, f"data to {s}"))
        elif op.kind == "backward" and "hooks only" not in op.detail:
            for i in reversed(op.layers):
                for name, s in rounding[1][i]:
                    out.append(Op("cast", i, name, f"diff to {s}"))
    return Schedule(out, schedule.passes + ["precision"])


class LossScaler:
    """Loss scaling of a training net (see the module docstring)."""

    def __init__(self, net, scale):
        self.net = net
        self.dynamic = scale == P.DYNAMIC
        self.scale = INIT_SCALE if self.dynamic else float(scale)
        self.good = 0          # steps in a row without an overflow
        self.skipped = 0       # steps skipped for overflowing gradients
        self._loss_tops = {i: [net.top_vecs[i][j] for j in range(len(net.top_vecs[i]))
                               if layer.loss(j)]
                           for i, layer in enumerate(net.layers)}
        self._loss_tops = {i: tops for i, tops in self._loss_tops.items() if tops}
        self._saved = {}
        net.add_hook("before_backward", self._before_backward)
        net.add_hook("after_backward", self._after_backward)

    def _before_backward(self, i):
        tops = self._loss_tops.get(i)
        if tops and self.scale != 1.0:
            xp = context.xp()
            saved = []
            for top in tops:
                d = top.mutable_diff_for(xp)
                saved.append(d.copy())
                d *= d.dtype.type(self.scale)
            self._saved[i] = saved

    def _after_backward(self, i):
        saved = self._saved.pop(i, None)
        if saved is not None:
            xp = context.xp()
            for top, d in zip(self._loss_tops[i], saved):
                top.mutable_diff_for(xp)[...] = d

    def unscale(self):
        """Divide the learnable parameters' diffs by the scale; True when they are all
        finite (the update may run), else the step is skipped and the scale backs off."""
        xp = context.xp()
        inv = np.float32(1.0 / self.scale)
        finite = True
        for b in self.net.learnable_params:
            g = b.mutable_diff_for(xp)
            if self.scale != 1.0:
                g *= inv
            finite = finite and bool(xp.isfinite(g).all())
        if not self.dynamic:
            return finite
        if finite:
            self.good += 1
            if self.good >= INTERVAL:
                self.scale *= GROWTH
                self.good = 0
        else:
            self.skipped += 1
            self.scale *= BACKOFF
            self.good = 0
        return finite

    def describe(self):
        kind = "dynamic" if self.dynamic else "fixed"
        return (f"loss scale {self.scale:g} ({kind}), {self.skipped} steps skipped for "
                "overflowing gradients")

    def state(self):
        return self.scale, self.good, self.skipped

    def set_state(self, scale, good, skipped):
        if self.dynamic:
            self.scale, self.good, self.skipped = float(scale), int(good), int(skipped)
