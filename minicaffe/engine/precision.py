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
        g *= self.inv
        self.found[...] = xp.logical_not(xp.isfinite(g).all()).astype(np.int32)

    def update_state(self):
        """After the (possibly skipped) update: the dynamic scale's rule on the device."""
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
