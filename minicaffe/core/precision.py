"""The type rules of reduced precision: which blobs are stored in which type (NVIDIA
Caffe 0.17's ``Net::Init`` type resolution, plus minicaffe's ``--precision`` switch).

A pure function of a net's NetParameter (filtered, splits inserted: the Net's own
``net_param``) and a run's precision, ``resolve(net_param, precision)``, gives a
``NetTypes``: for every layer its forward and backward storage types (NVIDIA Caffe's
``Ftype``/``Btype``) and math types, and for every blob the type its data and its diff
are stored in.  The rules:

- the switch (``--precision``, the solver's ``minicaffe_precision``; ``RunConfig.
  precision``): ``bf16``/``fp16`` make BFLOAT16/FLOAT16 the net's default storage types
  with FLOAT math (fp32 accumulation, as cuDNN and PyTorch's autocast do); ``fp32``/
  ``tf32`` make FLOAT the default; unset (None): the net's own NVIDIA Caffe fields
  ``default_forward_type``/``default_backward_type``/``default_forward_math``/
  ``default_backward_math`` (an unset math takes its type, as NVIDIA Caffe);
- a layer's own ``forward_type``/``backward_type``/``forward_math``/``backward_math``
  win over every default (an unset math takes the layer's type when that is set);
- loss layers, Softmax, Accuracy and ArgMax default to FLOAT (losses and probabilities
  in fp32); data movers (Split, Flatten, Reshape, Slice) default to their first bottom's
  type (so labels stay fp32 through a split); a layer without bottoms (a data layer)
  stores its first top in its forward type and its other tops (labels) in FLOAT, and
  has a FLOAT backward type (NVIDIA Caffe's rule for data layers);
- a blob's data is stored in its producer's forward type (an in-place layer keeps its
  bottom's); its diff in the backward type of the first layer that consumes it (the
  last backward to write it); a blob nobody consumes (loss tops, outputs): FLOAT;
- parameters (master weights, BatchNorm statistics), their diffs (what the update
  reads) and the solver history are FLOAT always.

The loss scale (``loss_scale``): NVIDIA Caffe's ``global_grad_scale`` when the net sets
it (fixed); else ``DYNAMIC`` when some diff is stored in FLOAT16 (fp16's 5-bit exponent
underflows small gradients: engine/precision.LossScaler); else None (bf16 keeps fp32's
exponent and needs no scaling).

``round_to(xp, array, type)`` rounds an fp32 array in place to the values a type can
hold (round to nearest even): FLOAT16 through numpy/CuPy's float16, BFLOAT16 by rounding
off the low 16 bits of each fp32 word.  It is how the CPU (and a GPU layer without a
reduced-type body) stores a blob "in" a reduced type: the values are exactly those of
the reduced storage, the arithmetic on them fp32 (the Net's hooks, network/net.py).
Caffe has no counterpart (BVLC is fp32); NVIDIA Caffe's is ``net.cpp``'s ``Init``.
"""
import dataclasses

import numpy as np

from .errors import ConfigError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
_ALIASES = {"fp32": "fp32", "float": "fp32", "float32": "fp32", "tf32": "tf32",
            "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
            "half": "fp16"}
FLOAT, FLOAT16, BFLOAT16 = "FLOAT", "FLOAT16", "BFLOAT16"
STORAGE = (FLOAT, FLOAT16, BFLOAT16)
REDUCED = {"bf16": BFLOAT16, "fp16": FLOAT16}
ITEMSIZE = {FLOAT: 4, FLOAT16: 2, BFLOAT16: 2}
DYNAMIC = "dynamic"

FP32_TYPES = ("Softmax", "Accuracy", "ArgMax")
MOVERS = ("Split", "Flatten", "Reshape", "Slice")


def parse_precision(text, where="--precision"):
    """'BF16', 'bfloat16' -> 'bf16'; one ConfigError line naming ``where`` otherwise."""
    name = _ALIASES.get(str(text).strip().lower())
    if name is None:
        raise ConfigError(f"{where} {text!r}: expected fp32, tf32, bf16 or fp16")
    return name


def _type_name(value):
    from ..proto import caffe_pb2
    return caffe_pb2.Type.Name(value)


def _checked(value, lp, field):
    name = _type_name(value)
    if name not in STORAGE:
        raise ConfigError(f"layer '{lp.name}': {field} {name} is not supported (FLOAT, "
                          "FLOAT16 or BFLOAT16)")
    return name


@dataclasses.dataclass(frozen=True)
class LayerTypes:
    """One layer's resolved types (names of ``caffe.Type``)."""
    name: str
    type: str
    forward_type: str
    backward_type: str
    forward_math: str
    backward_math: str

    @property
    def reduced(self):
        return self.forward_type != FLOAT or self.backward_type != FLOAT


@dataclasses.dataclass(frozen=True)
class NetTypes:
    """What ``resolve`` gives: ``layers`` (LayerTypes, in the net's order), ``data`` and
    ``diff`` (blob name -> storage type), ``loss_scale`` (a float, DYNAMIC or None) and
    the ``precision`` it was resolved for (None: the net's fields)."""
    layers: tuple
    data: dict
    diff: dict
    loss_scale: object
    precision: str = None

    @property
    def reduced(self):
        """True when some blob is stored in a reduced type."""
        return any(t != FLOAT for t in self.data.values()) or \
            any(t != FLOAT for t in self.diff.values())

    def layer(self, name):
        for lt in self.layers:
            if lt.name == name:
                return lt
        raise KeyError(name)

    def bytes_of(self, blob, count, diff=False):
        """Bytes of ``count`` values of ``blob``'s data (or diff) in its storage type."""
        return count * ITEMSIZE[(self.diff if diff else self.data).get(blob, FLOAT)]

    def describe(self):
        """One line for the log: the storage of feature maps and the loss scaling."""
        kinds = sorted(set(self.data.values()) | set(self.diff.values()))
        scale = ("dynamic loss scaling" if self.loss_scale == DYNAMIC else
                 f"loss scale {self.loss_scale:g}" if self.loss_scale else "no loss scaling")
        n = sum(lt.reduced for lt in self.layers)
        return (f"storage types {', '.join(kinds)}; {n} of {len(self.layers)} layers in a "
                f"reduced type; parameters, their diffs and solver history FLOAT; {scale}")

    def lines(self):
        """One line per layer: its four types (``minicaffe memory`` prints them)."""
        return [f"{lt.name} ({lt.type}): forward {lt.forward_type} (math {lt.forward_math}), "
                f"backward {lt.backward_type} (math {lt.backward_math})" for lt in self.layers]


def _defaults(net_param, precision):
    """(forward type, backward type, forward math, backward math) of the net's layers."""
    if precision is not None:
        t = REDUCED.get(precision, FLOAT)
        return t, t, FLOAT, FLOAT
    p = net_param
    ft, bt = _type_name(p.default_forward_type), _type_name(p.default_backward_type)
    fm = _type_name(p.default_forward_math) if p.HasField("default_forward_math") else ft
    bm = _type_name(p.default_backward_math) if p.HasField("default_backward_math") else bt
    for field, name in (("default_forward_type", ft), ("default_backward_type", bt),
                        ("default_forward_math", fm), ("default_backward_math", bm)):
        if name not in STORAGE:
            raise ConfigError(f"net '{p.name}': {field} {name} is not supported (FLOAT, "
                              "FLOAT16 or BFLOAT16)")
    return ft, bt, fm, bm


def preserves(lp, backward=False):
    """True when layer ``lp``'s forward (or backward) writes only values it read: its
    output needs no rounding when its inputs are stored in the output's type (ReLU
    without a slope, MAX pooling's forward, the data movers; Eltwise SUM's backward with
    unit coefficients)."""
    t = lp.type
    if t == "ReLU":
        return lp.relu_param.negative_slope == 0
    if t in ("Flatten", "Reshape", "Slice", "Concat"):
        return True
    if backward:
        return t == "Eltwise" and lp.eltwise_param.operation == 1 and \
            all(c == 1 for c in lp.eltwise_param.coeff)
    if t == "Split":
        return True
    return t == "Pooling" and lp.pooling_param.pool == 0


def is_loss_type(layer_type):
    return layer_type.endswith("Loss")


def resolve(net_param, precision=None):
    """The NetTypes of ``net_param`` (filtered, splits inserted) under ``precision`` (one
    of PRECISIONS, or None for the net's own fields); see the module docstring."""
    if precision is not None:
        precision = parse_precision(precision)
    dft, dbt, dfm, dbm = _defaults(net_param, precision)
    data, diff, layers = {}, {}, []
    for lp in net_param.layer:
        forced = is_loss_type(lp.type) or lp.type in FP32_TYPES
        no_bottom = len(lp.bottom) == 0
        if lp.HasField("forward_type"):
            ft = _checked(lp.forward_type, lp, "forward_type")
        elif forced:
            ft = FLOAT
        elif lp.type in MOVERS and lp.bottom:
            ft = data.get(lp.bottom[0], FLOAT)
        else:
            ft = dft
        if lp.HasField("backward_type"):
            bt = _checked(lp.backward_type, lp, "backward_type")
        elif forced or no_bottom:
            bt = FLOAT
        elif lp.type in MOVERS and lp.bottom:
            bt = ft
        else:
            bt = dbt
        if lp.HasField("forward_math"):
            fm = _checked(lp.forward_math, lp, "forward_math")
        else:
            fm = ft if (lp.HasField("forward_type") or forced or lp.type in MOVERS) else dfm
        if lp.HasField("backward_math"):
            bm = _checked(lp.backward_math, lp, "backward_math")
        else:
            bm = bt if (lp.HasField("backward_type") or forced or no_bottom or
                        lp.type in MOVERS) else dbm
        layers.append(LayerTypes(lp.name, lp.type, ft, bt, fm, bm))
        for j, name in enumerate(lp.bottom):
            diff.setdefault(name, bt)          # the first consumer writes it last
        for j, name in enumerate(lp.top):
            if j < len(lp.bottom) and lp.bottom[j] == name:
                continue                       # in place: the bottom's storage
            data[name] = FLOAT if (no_bottom and j > 0) else ft
    for name in data:
        diff.setdefault(name, FLOAT)           # nobody consumes it: loss weights, outputs
    if net_param.HasField("global_grad_scale"):
        scale = float(net_param.global_grad_scale)
        if not scale > 0 or scale != scale or scale == float("inf"):
            raise ConfigError(f"net '{net_param.name}': global_grad_scale must be a "
                              f"positive number, got {net_param.global_grad_scale}")
    elif any(t == FLOAT16 for t in diff.values()):
        scale = DYNAMIC
    else:
        scale = None
    return NetTypes(tuple(layers), data, diff, scale, precision)


# -- storage emulation ---------------------------------------------------------------------
def round_to(xp, a, storage):
    """Round the float32 array ``a`` in place to the nearest value of type ``storage``
    (ties to even; beyond the range: inf, as a cast gives; NaN stays NaN)."""
    if storage == FLOAT or a.size == 0:
        return a
    if a.dtype != np.float32:
        raise TypeError(f"round_to needs a float32 array, got {a.dtype}")
    if storage == FLOAT16:
        with np.errstate(over="ignore"):       # beyond 65504: inf, as the cast
            a[...] = a.astype(xp.float16)
        return a
    if storage != BFLOAT16:
        raise ValueError(f"unknown storage type {storage!r}")
    u = a.view(xp.uint32)
    nan = xp.isnan(a)
    bias = ((u >> 16) & 1) + xp.uint32(0x7FFF)
    u += bias
    u &= xp.uint32(0xFFFF0000)
    xp.copyto(a, xp.float32(np.nan), where=nan)
    return a


def representable(xp, a, storage):
    """True when every value of the fp32 array ``a`` is one of ``storage``'s."""
    b = a.copy()
    round_to(xp, b, storage)
    return bool(((b == a) | (xp.isnan(a) & xp.isnan(b))).all())


# -- real 16-bit storage (the GPU engine's memory plan, engine/precision.py) ---------------
def buffer_dtype(storage):
    """The array dtype a buffer stored in ``storage`` is held in: float32 for FLOAT,
    float16 for FLOAT16, uint16 words for BFLOAT16 (numpy and CuPy have no bfloat16)."""
    if storage in (None, FLOAT):
        return np.dtype(np.float32)
    if storage == FLOAT16:
        return np.dtype(np.float16)
    if storage == BFLOAT16:
        return np.dtype(np.uint16)
    raise ValueError(f"unknown storage type {storage!r}")


def storage_of(a):
    """The storage type an array holds (by its dtype: see ``buffer_dtype``)."""
    k = np.dtype(a.dtype)
    if k == np.uint16:
        return BFLOAT16
    if k == np.float16:
        return FLOAT16
    return FLOAT


def narrow(xp, a, out, storage):
    """``out`` (``buffer_dtype(storage)``) = the float32 array ``a`` rounded to nearest
    even (NaN stays NaN, beyond float16's range: inf); numpy or CuPy."""
    if storage == FLOAT16:
        with np.errstate(over="ignore"):
            out[...] = a.astype(xp.float16)
        return out
    if storage != BFLOAT16:
        raise ValueError(f"unknown storage type {storage!r}")
    u = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32)
    r = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    nan = xp.isnan(a)
    if bool(nan.any()):
        r[nan] = 0x7FC0
    out[...] = r.reshape(out.shape)
    return out


def widen(xp, h, out, storage):
    """``out`` (float32) = the values of ``h`` (a buffer of ``storage``): exact."""
    if storage == FLOAT16:
        out[...] = h.astype(xp.float32)
        return out
    if storage != BFLOAT16:
        raise ValueError(f"unknown storage type {storage!r}")
    out[...] = (h.astype(xp.uint32) << 16).view(xp.float32).reshape(out.shape)
    return out
