"""Test helpers shared by minicaffe's tests: building a layer from prototxt text,
blobs of random values, and Caffe's finite-difference gradient checker.

The checker follows Caffe's GradientChecker (step 1e-2, threshold 1e-3, kinks
skipped): for every element of every checked bottom and param it compares the
analytic gradient of an objective with a centred finite difference.  The
objective is ``sum_i <top_i, R_i>`` for fixed random ``R_i`` (one backward gives
the analytic gradient of every input at once).
"""
import numpy as np

from ..core import context
from ..core.blob import Blob
from ..proto import caffe_pb2
from ..core.protoio import parse_text
from ..layers.registry import create_layer


def layer_param(text, phase=caffe_pb2.TRAIN):
    p = parse_text(text, caffe_pb2.LayerParameter())
    if not p.name:
        p.name = "test_" + (p.type or "layer").lower()
    if not p.HasField("phase"):
        p.phase = phase
    return p


def make_layer(text, phase=caffe_pb2.TRAIN):
    """A layer from LayerParameter prototxt text, e.g. ``'type: "ReLU"'``."""
    return create_layer(layer_param(text, phase))


def make_blob(shape, dtype=np.float64, low=-1.0, high=1.0, rng=None, values=None):
    b = Blob(shape, dtype)
    if values is not None:
        b.data[...] = values
    else:
        rng = rng or context.rng()
        b.data[...] = rng.uniform(low, high, size=shape)
    return b


def _to_xp(xp, a):
    return a if xp is np else xp.asarray(a)


class GradientChecker:
    def __init__(self, stepsize=1e-2, threshold=1e-3, seed=1701, kink=0.0, kink_range=-1.0):
        self.stepsize = stepsize
        self.threshold = threshold
        self.seed = seed
        self.kink = kink
        self.kink_range = kink_range

    def _objective(self, layer, bottom, top, weights):
        """sum_i <top_i, R_i + loss_weight_i>: the same function whose gradient the
        top diffs (R_i + loss_weight_i) define."""
        layer.forward(bottom, top)
        obj = 0.0
        for i, (t, w) in enumerate(zip(top, weights)):
            d = (0.0 if w is None else w) + layer.loss(i)
            obj += float((t.cpu_data() * d).sum())
        return obj

    def check(self, layer, bottom, top, check_bottom=None, check_params=True, setup=True,
              top_ids=None):
        """Assert the analytic gradients of ``layer`` match finite differences.

        ``check_bottom``: indices of bottoms to check (default all);
        ``top_ids``: tops that enter the objective (default all).
        Returns the number of elements checked."""
        if setup:
            layer.setup(bottom, top)
        rng = np.random.RandomState(self.seed)
        layer.forward(bottom, top)
        top_ids = range(len(top)) if top_ids is None else top_ids
        weights = [rng.uniform(-1, 1, size=t.shape) if i in top_ids else None
                   for i, t in enumerate(top)]
        if check_bottom is None:
            check_bottom = list(range(len(bottom)))
        blobs = [(bottom[i], f"bottom {i}") for i in check_bottom]
        if check_params:
            blobs += [(b, f"param {j}") for j, b in enumerate(layer.blobs)]
        # analytic: set top diffs to the weights (loss tops keep their loss weight)
        for b in layer.blobs:
            b.diff[...] = 0
        for b in bottom:
            b.diff[...] = 0
        layer.forward(bottom, top)
        for i, t in enumerate(top):
            d = np.zeros(t.shape) if weights[i] is None else weights[i].copy()
            if layer.loss(i):
                d = d + layer.loss(i)
            t.diff[...] = d
        propagate = [i in check_bottom for i in range(len(bottom))]
        layer.backward(top, propagate, bottom)
        analytic = [b.cpu_diff().copy() for b, _ in blobs]
        checked = 0
        for (blob, what), grad in zip(blobs, analytic):
            flat = blob.data.reshape(-1)
            for k in range(flat.size):
                x0 = float(flat[k])
                if self.kink_range > 0 and abs(x0 - self.kink) < self.kink_range:
                    continue
                flat[k] = x0 + self.stepsize
                plus = self._objective(layer, bottom, top, weights)
                flat[k] = x0 - self.stepsize
                minus = self._objective(layer, bottom, top, weights)
                flat[k] = x0
                estimated = (plus - minus) / (2 * self.stepsize)
                computed = float(grad.reshape(-1)[k])
                scale = max(abs(computed), abs(estimated), 1.0)
                if abs(computed - estimated) > self.threshold * scale:
                    raise AssertionError(
                        f"{layer.type} {what} element {k}: analytic {computed:.6g} vs numeric "
                        f"{estimated:.6g} (threshold {self.threshold} x {scale:.3g})")
                checked += 1
        return checked


def check_gradient(layer, bottom, top, **kw):
    init = {k: kw.pop(k) for k in ("stepsize", "threshold", "seed", "kink", "kink_range") if k in kw}
    return GradientChecker(**init).check(layer, bottom, top, **kw)
