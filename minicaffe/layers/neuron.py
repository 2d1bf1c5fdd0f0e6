"""Neuron layers: elementwise, one bottom, one top of the same shape.

Every layer here may run in place (top is the bottom blob) except AbsVal.  A
layer whose backward needs the input ``x`` and runs in place keeps a copy of
``x`` during forward (Caffe's PReLU and Scale do the same), so in-place and
out-of-place give the same gradients.

Bias and Scale (broadcast a parameter or a second bottom over ``bottom[0]``)
live here too: both are elementwise on ``bottom[0]``.
"""
import math

import numpy as np

from ..core import context
from ..core import threads
from ..core.backend import gpu_module as backend_xp
from ..core.blob import Blob
from ..core.filler import fill
from .layer import Layer, NeuronLayer
from ..proto import caffe_pb2
from .registry import register_layer


def _quiet(xp):
    """numpy's floating-point warnings off (Caffe's math is silent: a log of a
    negative gives NaN, not an exception)."""
    return np.errstate(all="ignore")


class _SavesInput(NeuronLayer):
    """A neuron layer whose backward reads ``x``: in place, forward keeps a copy."""
    capturable = True
    _x_copy = None

    def _input_for_forward(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        self._x_copy = x.copy() if bottom[0] is top[0] else None
        return x

    def _input_for_backward(self, xp, bottom):
        if self._x_copy is not None:
            return xp.asarray(self._x_copy)
        return bottom[0].data_for(xp)


def _in_pool(fn, *arrays):
    """``fn(inputs, out)`` on flat ranges of the arrays (the last is ``out``, the rest the
    inputs) in the CPU kernel pool (core/threads.py, ``--threads N``); False when the
    pool is not used (one thread, small or non-contiguous arrays)."""
    if not all(a.flags.c_contiguous for a in arrays):
        return False
    *ins, out = [a.reshape(-1) for a in arrays]
    return threads.split_flat(out.size, lambda a, b: fn([i[a:b] for i in ins], out[a:b]))


def _sigmoid(xp, x):
    return 0.5 * xp.tanh(0.5 * x) + 0.5


@register_layer("ReLU")
class ReLULayer(_SavesInput):
    """y = max(x, 0) + negative_slope * min(x, 0);  dx = dy * (x > 0 ? 1 : negative_slope)."""

    retain_inputs, retain_outputs = (0,), ()

    @property
    def reduced_body(self):
        """A plain ReLU runs on 2-byte buffers (engine/precision.py; kernels/reduced.py)."""
        return self.layer_param.relu_param.negative_slope == 0

    def forward_gpu(self, bottom, top):
        from ..kernels import reduced
        s = reduced.storage(bottom[0])
        if s is None:
            return super().forward_gpu(bottom, top)
        reduced.relu_forward(bottom[0].gpu_data(), top[0].mutable_gpu_data(), s)

    def backward_gpu(self, top, propagate_down, bottom):
        from ..kernels import reduced
        s = reduced.storage(bottom[0])
        if s is None:
            return super().backward_gpu(top, propagate_down, bottom)
        if propagate_down[0]:
            reduced.relu_backward(bottom[0].gpu_data(), top[0].gpu_diff(),
                                  bottom[0].mutable_gpu_diff(), s)

    def state_bytes(self, bottom, top):
        if self.layer_param.relu_param.negative_slope < 0 and bottom[0] is top[0]:
            return bottom[0].count() * bottom[0].dtype.itemsize
        return 0

    def forward_xp(self, xp, bottom, top):
        slope = self.layer_param.relu_param.negative_slope
        # in place with a negative slope, y's sign no longer tells x's
        x = self._input_for_forward(xp, bottom, top) if slope < 0 else bottom[0].data_for(xp)
        y = top[0].mutable_data_for(xp)
        if slope:
            y[...] = xp.where(x > 0, x, x * x.dtype.type(slope))
        elif xp is not np or not _in_pool(lambda a, b: np.maximum(a[0], 0, out=b), x, y):
            xp.maximum(x, 0, out=y)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        slope = self.layer_param.relu_param.negative_slope
        # In place (slope >= 0), bottom data is the top data; the sign is the same.
        x = self._input_for_backward(xp, bottom) if slope < 0 else bottom[0].data_for(xp)
        dy = top[0].diff_for(xp)
        dx = bottom[0].mutable_diff_for(xp)
        if slope:
            dx[...] = dy * xp.where(x > 0, x.dtype.type(1), x.dtype.type(slope))
        elif dx.dtype.kind != "f":    # e.g. ml_dtypes' bfloat16: numpy's casting rules
            dx[...] = dy * (x > 0)
        elif xp is not np or not _in_pool(lambda a, b: np.multiply(a[1], a[0] > 0, out=b),
                                          x, dy, dx):
            xp.multiply(dy, x > 0, out=dx)   # no float temporary (NaN dy stays NaN)


@register_layer("PReLU")
class PReLULayer(_SavesInput):
    """y = max(x, 0) + a_c * min(x, 0) with a learned slope per channel (axis 1), or
    one slope for all (``channel_shared``, a 0-axis blob).  Slopes start at 0.25
    unless ``filler`` says otherwise.
    da_c += sum over n, spatial of dy * x * (x <= 0);  dx = dy * (x > 0 ? 1 : a_c)."""

    def layer_setup(self, bottom, top):
        if bottom[0].num_axes < 2:
            raise self.error(f"bottom must have at least 2 axes (N, C, ...), got shape "
                             f"{bottom[0].shape}")
        p = self.layer_param.prelu_param
        self.channel_shared = p.channel_shared
        channels = bottom[0].shape[1]
        want = () if self.channel_shared else (channels,)
        if self.blobs:
            if len(self.blobs) != 1 or self.blobs[0].count() != (1 if self.channel_shared else channels):
                raise self.error(f"slope blob {self.blobs[0].shape if self.blobs else None} does not "
                                 f"match {'channel_shared' if self.channel_shared else 'channels'} "
                                 f"{want} for bottom {bottom[0].shape}")
            return
        self.blobs = [Blob(want, bottom[0].dtype)]
        filler = p.filler if p.HasField("filler") else \
            caffe_pb2.FillerParameter(type="constant", value=0.25)
        fill(self.blobs[0], filler)

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 2:
            raise self.error(f"bottom must have at least 2 axes (N, C, ...), got shape "
                             f"{bottom[0].shape}")
        if not self.channel_shared and bottom[0].shape[1] != self.blobs[0].count():
            raise self.error(f"bottom {bottom[0].shape} has {bottom[0].shape[1]} channels, the "
                             f"slope blob has {self.blobs[0].count()}")
        super().reshape(bottom, top)

    def _slope(self, xp, x):
        a = self.blobs[0].data_for(xp)
        if self.channel_shared:
            return a.reshape(())
        return a.reshape((1, a.size) + (1,) * (x.ndim - 2))

    def forward_xp(self, xp, bottom, top):
        x = self._input_for_forward(xp, bottom, top)
        a = self._slope(xp, x)
        top[0].mutable_data_for(xp)[...] = xp.where(x > 0, x, x * a)

    def backward_xp(self, xp, top, propagate_down, bottom):
        x = self._input_for_backward(xp, bottom)
        dy = top[0].diff_for(xp)
        # the slope gradient first: in place, the bottom diff overwrites dy
        if self.get_param_propagate_down(0):
            g = dy * x * (x <= 0)
            da = self.blobs[0].mutable_diff_for(xp)
            if self.channel_shared:
                da += g.sum()
            else:
                axes = (0,) + tuple(range(2, x.ndim))
                da += g.sum(axis=axes)
        if propagate_down[0]:
            a = self._slope(xp, x)
            bottom[0].mutable_diff_for(xp)[...] = dy * xp.where(x > 0, x.dtype.type(1), a)


@register_layer("ELU")
class ELULayer(NeuronLayer):
    """y = x if x > 0 else alpha * (exp(x) - 1);  dx = dy * (x > 0 ? 1 : y + alpha)."""
    capturable = True

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        alpha = self.layer_param.elu_param.alpha
        top[0].mutable_data_for(xp)[...] = xp.where(x > 0, x, alpha * xp.expm1(xp.minimum(x, 0)))

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        # in place, x is y: y > 0 exactly where x > 0
        x = bottom[0].data_for(xp)
        y = top[0].data_for(xp)
        dy = top[0].diff_for(xp)
        alpha = self.layer_param.elu_param.alpha
        bottom[0].mutable_diff_for(xp)[...] = dy * xp.where(x > 0, x.dtype.type(1), y + alpha)


@register_layer("Sigmoid")
class SigmoidLayer(NeuronLayer):
    """y = 1 / (1 + exp(-x)) (as 0.5 tanh(x/2) + 0.5);  dx = dy * y * (1 - y)."""
    capturable = True

    retain_inputs, retain_outputs = (), (0,)

    def forward_xp(self, xp, bottom, top):
        top[0].mutable_data_for(xp)[...] = _sigmoid(xp, bottom[0].data_for(xp))

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data_for(xp)
        bottom[0].mutable_diff_for(xp)[...] = top[0].diff_for(xp) * y * (1 - y)


@register_layer("TanH")
class TanHLayer(NeuronLayer):
    """y = tanh(x);  dx = dy * (1 - y^2)."""
    capturable = True

    retain_inputs, retain_outputs = (), (0,)

    def forward_xp(self, xp, bottom, top):
        xp.tanh(bottom[0].data_for(xp), out=top[0].mutable_data_for(xp))

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data_for(xp)
        bottom[0].mutable_diff_for(xp)[...] = top[0].diff_for(xp) * (1 - y * y)


@register_layer("AbsVal")
class AbsValLayer(NeuronLayer):
    """y = |x|;  dx = dy * sign(x).  Not in place (backward needs the sign of x)."""
    capturable = True

    def layer_setup(self, bottom, top):
        if top[0] is bottom[0]:
            raise self.error("does not allow in-place computation")

    def forward_xp(self, xp, bottom, top):
        xp.abs(bottom[0].data_for(xp), out=top[0].mutable_data_for(xp))

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data_for(xp)
        bottom[0].mutable_diff_for(xp)[...] = top[0].diff_for(xp) * xp.sign(x)


@register_layer("BNLL")
class BNLLLayer(_SavesInput):
    """Binomial normal log likelihood: y = log(1 + exp(x)) (computed without overflow);
    dx = dy * sigmoid(x)."""

    def forward_xp(self, xp, bottom, top):
        x = self._input_for_forward(xp, bottom, top)
        top[0].mutable_data_for(xp)[...] = xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = self._input_for_backward(xp, bottom)
        bottom[0].mutable_diff_for(xp)[...] = top[0].diff_for(xp) * _sigmoid(xp, x)


@register_layer("Power")
class PowerLayer(_SavesInput):
    """y = (shift + scale * x) ^ power;  dx = dy * power * scale * (shift + scale * x)^(power - 1).
    With power * scale == 0 the output is the constant shift^power (1 for power 0)."""

    def layer_setup(self, bottom, top):
        p = self.layer_param.power_param
        self.power, self.scale, self.shift = float(p.power), float(p.scale), float(p.shift)
        self.diff_scale = self.power * self.scale

    def forward_xp(self, xp, bottom, top):
        x = self._input_for_forward(xp, bottom, top)
        y = top[0].mutable_data_for(xp)
        if self.diff_scale == 0:
            with _quiet(xp):
                y[...] = 1.0 if self.power == 0 else np.power(self.shift, self.power)
            return
        with _quiet(xp):
            base = x * x.dtype.type(self.scale) + x.dtype.type(self.shift)
            y[...] = base if self.power == 1 else base ** x.dtype.type(self.power)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].mutable_diff_for(xp)
        if self.diff_scale == 0:
            dx[...] = 0
            return
        dy = top[0].diff_for(xp)
        if self.power == 1:
            dx[...] = dy * dy.dtype.type(self.diff_scale)
            return
        x = self._input_for_backward(xp, bottom)
        t = x.dtype.type
        with _quiet(xp):
            base = x * t(self.scale) + t(self.shift)
            if self.power == 2:
                d = base * t(self.diff_scale)
            else:
                d = base ** t(self.power - 1) * t(self.diff_scale)
            dx[...] = dy * d


def _log_base(layer, base):
    """ln(base) for Exp/Log (1 for base -1, meaning e); base must be > 0 otherwise."""
    if base == -1:
        return 1.0
    if not base > 0:
        raise layer.error(f"base must be strictly positive (or -1 for e), got {base}")
    return math.log(base)


@register_layer("Exp")
class ExpLayer(NeuronLayer):
    """y = base ^ (shift + scale * x) (base -1 means e);  dx = dy * y * ln(base) * scale."""
    capturable = True

    def layer_setup(self, bottom, top):
        p = self.layer_param.exp_param
        log_base = _log_base(self, p.base)
        self.inner_scale = log_base * p.scale
        self.outer_scale = 1.0 if p.shift == 0 else math.exp(log_base * p.shift)

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        t = x.dtype.type
        with _quiet(xp):
            y = xp.exp(x * t(self.inner_scale))
            if self.outer_scale != 1:
                y *= t(self.outer_scale)
        top[0].mutable_data_for(xp)[...] = y

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data_for(xp)
        bottom[0].mutable_diff_for(xp)[...] = top[0].diff_for(xp) * y * y.dtype.type(self.inner_scale)


@register_layer("Log")
class LogLayer(_SavesInput):
    """y = log_base(shift + scale * x) (base -1 means e);
    dx = dy * scale / (ln(base) * (shift + scale * x))."""

    def layer_setup(self, bottom, top):
        p = self.layer_param.log_param
        self.base_scale = 1.0 / _log_base(self, p.base)
        self.scale, self.shift = float(p.scale), float(p.shift)

    def _inner(self, x):
        t = x.dtype.type
        return x * t(self.scale) + t(self.shift)

    def forward_xp(self, xp, bottom, top):
        x = self._input_for_forward(xp, bottom, top)
        with _quiet(xp):
            y = xp.log(self._inner(x))
            if self.base_scale != 1:
                y *= x.dtype.type(self.base_scale)
        top[0].mutable_data_for(xp)[...] = y

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = self._input_for_backward(xp, bottom)
        with _quiet(xp):
            d = x.dtype.type(self.scale * self.base_scale) / self._inner(x)
            bottom[0].mutable_diff_for(xp)[...] = top[0].diff_for(xp) * d


@register_layer("Threshold")
class ThresholdLayer(NeuronLayer):
    """y = 1 if x > threshold else 0.  The gradient is zero wherever it exists, so
    backward writes zeros (Caffe leaves backward unimplemented)."""
    capturable = True

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        t = self.layer_param.threshold_param.threshold
        top[0].mutable_data_for(xp)[...] = x > x.dtype.type(t)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].mutable_diff_for(xp)[...] = 0


@register_layer("Clip")
class ClipLayer(_SavesInput):
    """y = min(max(x, min), max);  dx = dy where min <= x <= max, else 0."""

    def layer_setup(self, bottom, top):
        p = self.layer_param.clip_param
        if not self.layer_param.HasField("clip_param") or not (p.HasField("min") and p.HasField("max")):
            raise self.error("clip_param { min: ... max: ... } is required")
        if p.min > p.max:
            raise self.error(f"clip_param min ({p.min}) must not exceed max ({p.max})")
        self.lo, self.hi = float(p.min), float(p.max)

    def forward_xp(self, xp, bottom, top):
        x = self._input_for_forward(xp, bottom, top)
        t = x.dtype.type
        xp.clip(x, t(self.lo), t(self.hi), out=top[0].mutable_data_for(xp))

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = self._input_for_backward(xp, bottom)
        t = x.dtype.type
        inside = (x >= t(self.lo)) & (x <= t(self.hi))
        bottom[0].mutable_diff_for(xp)[...] = top[0].diff_for(xp) * inside


@register_layer("Swish")
class SwishLayer(NeuronLayer):
    """y = x * sigmoid(beta * x);  dx = dy * (beta * y + sigmoid(beta x) * (1 - beta * y))."""
    capturable = True

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        beta = self.layer_param.swish_param.beta
        self._sig = _sigmoid(xp, x * x.dtype.type(beta))
        top[0].mutable_data_for(xp)[...] = x * self._sig

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data_for(xp)
        beta = y.dtype.type(self.layer_param.swish_param.beta)
        sig = xp.asarray(self._sig)
        by = beta * y
        bottom[0].mutable_diff_for(xp)[...] = top[0].diff_for(xp) * (by + sig * (1 - by))


@register_layer("Dropout")
class DropoutLayer(NeuronLayer):
    """TRAIN: y = x * m * s, with m ~ Bernoulli(1 - dropout_ratio) and s = 1 / (1 - ratio)
    (``scale_train``, the default) or 1.  TEST: y = x, or y = x * (1 - ratio) when
    ``scale_train`` is false.  dx = dy times the same factor.

    The CPU draws the mask from this thread's generator and keeps it for backward.  The
    GPU draws it from a counter-based generator (Philox, kernels/dropout.py) keyed by a
    seed taken from this thread's generator at setup: nothing is stored, backward redraws
    the same mask, and the draw captures in a CUDA graph (a new mask every replay)."""
    capturable = True

    def layer_setup(self, bottom, top):
        p = self.layer_param.dropout_param
        self.ratio = float(p.dropout_ratio)
        if not 0.0 <= self.ratio < 1.0:
            raise self.error(f"dropout_ratio must be in [0, 1), got {self.ratio}")
        self.scale_train = p.scale_train
        self.scale = 1.0 / (1.0 - self.ratio)
        self._mask = None
        self._seed = None
        self._pass = None

    def _uniform(self, xp, shape):
        return context.rng().random_sample(shape)

    retain_inputs, retain_outputs = (), ()      # the GPU redraws the mask (the plan is GPU-only)

    def _gpu_state(self, xp):
        if self._pass is None:
            self._seed = int(context.rng().randint(0, 2 ** 31)) << 31 | \
                int(context.rng().randint(0, 2 ** 31))
            self._pass = xp.zeros(1, dtype=np.int64)
        return self._seed, self._pass

    # on 2-byte buffers (real 16-bit storage, engine/precision.py): training's masks
    @property
    def reduced_body(self):
        return self.phase == caffe_pb2.TRAIN

    def forward_gpu(self, bottom, top):
        from ..kernels import reduced
        s = reduced.storage(bottom[0])
        if s is None or self.phase != caffe_pb2.TRAIN:
            return super().forward_gpu(bottom, top)
        from ..kernels.dropout import dropout16
        seed, counter = self._gpu_state(backend_xp())
        dropout16(bottom[0].gpu_data(), top[0].mutable_gpu_data(), seed, counter, self.ratio,
                  self.scale if self.scale_train else 1.0, s)

    def backward_gpu(self, top, propagate_down, bottom):
        from ..kernels import reduced
        s = reduced.storage(top[0], diff=True)
        if s is None or self.phase != caffe_pb2.TRAIN:
            return super().backward_gpu(top, propagate_down, bottom)
        if not propagate_down[0]:
            return
        from ..kernels.dropout import dropout16
        seed, counter = self._gpu_state(backend_xp())
        dropout16(top[0].gpu_diff(), bottom[0].mutable_gpu_diff(), seed, counter, self.ratio,
                  self.scale if self.scale_train else 1.0, s, backward=True)

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        y = top[0].mutable_data_for(xp)
        t = x.dtype.type
        if self.phase == caffe_pb2.TRAIN:
            s = self.scale if self.scale_train else 1.0
            if xp is np:
                keep = self._uniform(xp, x.shape) >= self.ratio
                self._mask = keep * t(s)
                y[...] = x * self._mask
            else:
                from ..kernels.dropout import dropout
                seed, counter = self._gpu_state(xp)
                dropout(x, y, seed, counter, self.ratio, s)
        elif self.scale_train:
            if top[0] is not bottom[0]:
                y[...] = x
        else:
            y[...] = x * t(1.0 - self.ratio)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff_for(xp)
        dx = bottom[0].mutable_diff_for(xp)
        t = dy.dtype.type
        if self.phase == caffe_pb2.TRAIN:
            if xp is np:
                dx[...] = dy * xp.asarray(self._mask)
            else:
                from ..kernels.dropout import dropout
                seed, counter = self._gpu_state(xp)
                dropout(dy, dx, seed, counter, self.ratio,
                        self.scale if self.scale_train else 1.0, backward=True)
        elif self.scale_train:
            if top[0] is not bottom[0]:
                dx[...] = dy
        else:
            dx[...] = dy * t(1.0 - self.ratio)


# -- Bias and Scale: broadcast over bottom[0] viewed as (outer, dim, inner) ---------

def _param_shape(layer, bottom, axis_param, num_axes):
    """The learned blob's shape: bottom[0]'s axes [axis, axis + num_axes)."""
    axis = _canonical(layer, bottom[0], axis_param)
    if num_axes < -1:
        raise layer.error(f"num_axes must be non-negative, or -1 to extend to the end of "
                          f"bottom[0]; got {num_axes}")
    if num_axes >= 0 and bottom[0].num_axes < axis + num_axes:
        raise layer.error(f"parameter shape extends past bottom[0] {bottom[0].shape} when "
                          f"applied from axis {axis} with num_axes {num_axes}")
    end = bottom[0].num_axes if num_axes == -1 else axis + num_axes
    return bottom[0].shape[axis:end]


def _canonical(layer, blob, axis):
    try:
        return blob.canonical_axis_index(axis)
    except IndexError:
        raise layer.error(f"axis {axis} is out of range for bottom shape {blob.shape}") from None


def _broadcast_dims(layer, bottom0, operand, axis_param, what):
    """(outer, dim, inner) for applying ``operand`` to bottom0 from ``axis``; a
    0-axis operand (a scalar) applies at axis 0."""
    axis = 0 if operand.num_axes == 0 else _canonical(layer, bottom0, axis_param)
    n = operand.num_axes
    if bottom0.num_axes < axis + n or bottom0.shape[axis:axis + n] != operand.shape:
        raise layer.error(f"{what} shape {operand.shape} does not match bottom[0] shape "
                          f"{bottom0.shape} from axis {axis}")
    return bottom0.count(0, axis), operand.count(), bottom0.count(axis + n)


@register_layer("Bias")
class BiasLayer(Layer):
    """y = x + b, b broadcast over bottom[0] from ``axis``: b is a learned blob of
    bottom[0]'s axes [axis, axis + num_axes) (one bottom), or bottom[1].
    db = sum of dy over the other axes (accumulated for the param, written for
    bottom[1]);  dx = dy."""
    capturable = True

    retain_inputs, retain_outputs = (), ()
    min_bottom_blobs = 1
    max_bottom_blobs = 2
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.bias_param
        if len(bottom) == 1:
            shape = _param_shape(self, bottom, p.axis, p.num_axes)
            if self.blobs:
                if len(self.blobs) != 1 or self.blobs[0].shape != shape:
                    raise self.error(f"bias blob {self.blobs[0].shape} does not match {shape} "
                                     f"for bottom {bottom[0].shape}")
            else:
                self.blobs = [Blob(shape, bottom[0].dtype)]
                fill(self.blobs[0], p.filler)
        elif self.blobs:
            raise self.error("has two bottoms, so it takes no learned bias blob")

    def _bias_blob(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom, top):
        self.dims = _broadcast_dims(self, bottom[0], self._bias_blob(bottom),
                                    self.layer_param.bias_param.axis, "bias")
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward_xp(self, xp, bottom, top):
        outer, dim, inner = self.dims
        b = self._bias_blob(bottom).data_for(xp).reshape(1, dim, 1)
        x = bottom[0].data_for(xp).reshape(outer, dim, inner)
        top[0].mutable_data_for(xp).reshape(outer, dim, inner)[...] = x + b

    def backward_xp(self, xp, top, propagate_down, bottom):
        outer, dim, inner = self.dims
        dy = top[0].diff_for(xp).reshape(outer, dim, inner)
        if len(bottom) == 1 and self.get_param_propagate_down(0):
            self.blobs[0].mutable_diff_for(xp).reshape(dim)[...] += dy.sum(axis=(0, 2))
        elif len(bottom) > 1 and propagate_down[1]:
            bottom[1].mutable_diff_for(xp).reshape(dim)[...] = dy.sum(axis=(0, 2))
        if propagate_down[0] and bottom[0] is not top[0]:
            bottom[0].mutable_diff_for(xp)[...] = top[0].diff_for(xp)


@register_layer("Scale")
class ScaleLayer(Layer):
    """y = x * s (+ b), s broadcast over bottom[0] from ``axis``: s is a learned blob
    of bottom[0]'s axes [axis, axis + num_axes) (one bottom; starts at 1 unless
    ``filler`` is given), or bottom[1].  ``bias_term`` adds a learned b of s's shape
    (the last param blob; starts from ``bias_filler``, 0 by default).
    ds = sum of dy * x over the other axes;  db = sum of dy;  dx = dy * s."""
    capturable = True
    min_bottom_blobs = 1
    max_bottom_blobs = 2
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.scale_param
        self.bias_term = p.bias_term
        if len(bottom) == 1:
            shape = _param_shape(self, bottom, p.axis, p.num_axes)
        else:
            shape = bottom[1].shape
        want = ([shape] if len(bottom) == 1 else []) + ([shape] if self.bias_term else [])
        if self.blobs:
            got = [b.shape for b in self.blobs]
            if got != want:
                raise self.error(f"parameter blobs {got} do not match {want} for bottoms "
                                 f"{[b.shape for b in bottom]}")
        else:
            dtype = bottom[0].dtype
            if len(bottom) == 1:
                s = Blob(shape, dtype)
                fill(s, p.filler if p.HasField("filler")
                     else caffe_pb2.FillerParameter(type="constant", value=1.0))
                self.blobs.append(s)
            if self.bias_term:
                b = Blob(shape, dtype)
                fill(b, p.bias_filler)
                self.blobs.append(b)
        self._x_copy = None
        self._scale_bottom = len(bottom) > 1

    def _scale_blob(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    # backward reads x, and the scale when it is the second bottom (in place, forward
    # keeps its own copy of x)
    @property
    def retain_inputs(self):
        x = () if self.in_place else (0,)
        return x + (1,) if self._scale_bottom else x

    retain_outputs = ()

    def state_bytes(self, bottom, top):
        if bottom[0] is top[0]:
            return bottom[0].count() * bottom[0].dtype.itemsize
        return 0

    def per_channel(self, bottom):
        """True when this Scale is a learned per-channel (axis 1) scale of one bottom."""
        p = self.layer_param.scale_param
        return len(bottom) == 1 and self.blobs[0].num_axes == 1 and \
            bottom[0].canonical_axis_index(p.axis) == 1

    def reshape(self, bottom, top):
        self.dims = _broadcast_dims(self, bottom[0], self._scale_blob(bottom),
                                    self.layer_param.scale_param.axis, "scale")
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward_xp(self, xp, bottom, top):
        outer, dim, inner = self.dims
        x = bottom[0].data_for(xp).reshape(outer, dim, inner)
        self._x_copy = x.copy() if bottom[0] is top[0] else None
        y = x * self._scale_blob(bottom).data_for(xp).reshape(1, dim, 1)
        if self.bias_term:
            y += self.blobs[-1].data_for(xp).reshape(1, dim, 1)
        top[0].mutable_data_for(xp).reshape(outer, dim, inner)[...] = y

    def backward_xp(self, xp, top, propagate_down, bottom):
        outer, dim, inner = self.dims
        dy = top[0].diff_for(xp).reshape(outer, dim, inner)
        # parameter gradients first: in place, the bottom diff overwrites dy
        if self.bias_term and self.get_param_propagate_down(len(self.blobs) - 1):
            self.blobs[-1].mutable_diff_for(xp).reshape(dim)[...] += dy.sum(axis=(0, 2))
        one = len(bottom) == 1
        if (one and self.get_param_propagate_down(0)) or (not one and propagate_down[1]):
            if self._x_copy is not None:
                x = xp.asarray(self._x_copy)
            else:
                x = bottom[0].data_for(xp).reshape(outer, dim, inner)
            g = (dy * x).sum(axis=(0, 2))
            if one:
                self.blobs[0].mutable_diff_for(xp).reshape(dim)[...] += g
            else:
                bottom[1].mutable_diff_for(xp).reshape(dim)[...] = g
        if propagate_down[0]:
            s = self._scale_blob(bottom).data_for(xp).reshape(1, dim, 1)
            bottom[0].mutable_diff_for(xp).reshape(outer, dim, inner)[...] = dy * s
