"""Fillers: initial values for parameter blobs (Caffe's filler.hpp).

Each filler draws from this thread's generator (``context.rng()``), so a fixed
``set_random_seed`` gives the same weights every run.
"""
import math

import numpy as np

from . import context
from .errors import ConfigError

# FillerParameter.VarianceNorm values (caffe.proto)
FAN_IN, FAN_OUT, AVERAGE = 0, 1, 2


def _fans(blob):
    count = blob.count()
    fan_in = count // blob.shape[0] if blob.num_axes > 0 and blob.shape[0] else count
    fan_out = count // blob.shape[1] if blob.num_axes > 1 and blob.shape[1] else count
    return fan_in, fan_out


def _norm_n(param, blob):
    fan_in, fan_out = _fans(blob)
    if param.variance_norm == AVERAGE:
        return (fan_in + fan_out) / 2.0
    if param.variance_norm == FAN_OUT:
        return fan_out
    return fan_in


def _constant(param, blob, rng):
    return np.full(blob.shape, param.value)


def _uniform(param, blob, rng):
    return rng.uniform(param.min, param.max, size=blob.shape)


def _gaussian(param, blob, rng):
    data = rng.normal(param.mean, param.std, size=blob.shape)
    if param.sparse >= 0:
        if blob.num_axes < 1:
            raise ConfigError("sparse gaussian filler needs a blob with at least one axis")
        num_outputs = blob.shape[0]
        p = param.sparse / float(num_outputs)
        data *= rng.binomial(1, min(p, 1.0), size=blob.shape)
    return data


def _positive_unitball(param, blob, rng):
    data = rng.uniform(0, 1, size=blob.count()).reshape(blob.shape[0], -1)
    data /= data.sum(axis=1, keepdims=True)
    return data.reshape(blob.shape)


def _xavier(param, blob, rng):
    scale = math.sqrt(3.0 / _norm_n(param, blob))
    return rng.uniform(-scale, scale, size=blob.shape)


def _msra(param, blob, rng):
    std = math.sqrt(2.0 / _norm_n(param, blob))
    return rng.normal(0.0, std, size=blob.shape)


def _bilinear(param, blob, rng):
    if blob.num_axes != 4 or blob.shape[2] != blob.shape[3]:
        raise ConfigError(f"bilinear filler needs a 4-D blob with square kernels, got {blob.shape}")
    w = blob.shape[3]
    f = math.ceil(w / 2.0)
    c = (2 * f - 1 - f % 2) / (2.0 * f)
    i = np.arange(blob.count())
    x = i % w
    y = (i // w) % blob.shape[2]
    data = (1 - np.abs(x / f - c)) * (1 - np.abs(y / f - c))
    return data.reshape(blob.shape)


FILLERS = {
    "constant": _constant,
    "uniform": _uniform,
    "gaussian": _gaussian,
    "positive_unitball": _positive_unitball,
    "xavier": _xavier,
    "msra": _msra,
    "bilinear": _bilinear,
}


def fill(blob, param):
    """Fill ``blob`` as FillerParameter ``param`` says."""
    ftype = param.type or "constant"
    fn = FILLERS.get(ftype)
    if fn is None:
        raise ConfigError(f"unknown filler type '{ftype}' (known: {', '.join(sorted(FILLERS))})")
    if blob.count() == 0:
        return
    values = fn(param, blob, context.rng())
    blob.mutable_cpu_data()[...] = values


def get_filler(param):
    """A callable ``f(blob)`` for pycaffe-style use."""
    return lambda blob: fill(blob, param)
