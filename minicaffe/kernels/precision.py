"""Casts between fp32 blobs and reduced-type buffers on the GPU (issue 20), and the
rounding of a blob to its storage type on either device.

- ``round_storage(xp, a, storage)``: ``a`` (float32) rounded in place to the values of
  ``storage`` (FLOAT16, BFLOAT16): one fused kernel on the GPU, core/precision.round_to
  on the CPU (the same numbers);
- ``to_reduced(x, out, storage)``: fp32 -> a reduced buffer (float16, or bfloat16 as
  uint16 words: CuPy has no bfloat16 dtype), round to nearest even;
- ``from_reduced(h, out, storage, bias, relu, accumulate)``: a reduced buffer -> fp32
  ``out`` (N, C, ...), with a per-channel bias added, a ReLU, or added into ``out``,
  rounded to the storage type's values in the same pass where asked;
- ``to_reduced_t(x, out, storage)`` / ``from_reduced_t(h, out, storage, accumulate)``:
  the same casts of a batch of transposed matrices, (B, P, Q) -> (B, Q, P) (a
  channels-last convolution's KCRS <-> KRSC weights, NCHW <-> NHWC maps).

On C-contiguous arrays the casts run kernels/vec16.py's vector bodies (the same bits as
the generic ElementwiseKernels here, which serve strided views).

The cuDNN convolution in a reduced type (layers/cudnn_layers.py) casts its input, its
weights and its gradients with these around cuDNN's half/bfloat16 calls.
"""
import numpy as np

from ..core import precision as P
from . import vec16
from ._backend import elementwise_kernel

_BF16_OF = vec16.BF16_STORE.format(v="x", out="y")
_FROM = """
float v = {load};
if (mode & 1) v += b[(i / hw) % c];
if (mode & 2) v = v > 0.0f ? v : 0.0f;
if (mode & 8) {{ {round} }}
if (mode & 4) y += v; else y = v;
"""
_TAG = {P.BFLOAT16: "bf16", P.FLOAT16: "f16"}


def generic_kernel(storage, what):
    """The one-element-per-thread ElementwiseKernel of ``what`` (round, to, from): any
    strides, the bodies for strided views and the reference of vec16's."""
    if what == "round":
        return elementwise_kernel("", "float32 a", "float v = a;\n" + vec16.ROUND_V[storage] +
                                  "\na = v;", "mc_round_" + _TAG[storage])
    if what == "to":
        if storage == P.BFLOAT16:
            return elementwise_kernel("float32 x", "uint16 y", _BF16_OF, "mc_to_bf16")
        return elementwise_kernel("float32 x", "float16 y", "y = (float16)x;", "mc_to_f16")
    if storage == P.BFLOAT16:
        return elementwise_kernel("uint16 h, raw float32 b, int64 c, int64 hw, int32 mode",
                                  "float32 y",
                                  _FROM.format(load="__uint_as_float(((unsigned int)h) << 16)",
                                               round=vec16.ROUND_V[storage]),
                                  "mc_from_bf16")
    return elementwise_kernel("float16 h, raw float32 b, int64 c, int64 hw, int32 mode",
                              "float32 y", _FROM.format(load="(float)h", round=vec16.ROUND_V[storage]),
                              "mc_from_f16")


to_reduced_t, from_reduced_t = vec16.to_reduced_t, vec16.from_reduced_t


def buffer_dtype(storage):
    """The CuPy dtype a reduced buffer is held in (bfloat16: its uint16 words)."""
    return np.uint16 if storage == P.BFLOAT16 else np.float16


def round_storage(xp, a, storage):
    """Round the float32 array ``a`` in place to ``storage``'s values (see the module)."""
    if storage == P.FLOAT or a.size == 0:
        return a
    if xp is np:
        return P.round_to(np, a, storage)
    generic_kernel(storage, "round")(a)
    return a


def to_reduced(x, out, storage):
    if vec16.applies(storage, (out,), (x,)):
        vec16.to_reduced(x, out, storage)
        return out
    generic_kernel(storage, "to")(x, out)
    return out


def from_reduced(h, out, storage, bias=None, relu=False, accumulate=False, rounded=False):
    """``out`` (float32, channel axis 1) from the reduced ``h`` of its shape; ``rounded``:
    the result (after the bias and the ReLU) rounded to ``storage``'s values."""
    c = out.shape[1] if out.ndim > 1 else 1
    hw = int(np.prod(out.shape[2:])) if out.ndim > 2 else 1
    mode = (1 if bias is not None else 0) | (2 if relu else 0) | (4 if accumulate else 0) | \
        (8 if rounded else 0)
    if vec16.applies(storage, (h,), (out,), (bias,)):
        vec16.from_reduced(h, out, storage, bias, c, hw, mode)
        return out
    b = bias if bias is not None else out     # unread without mode & 1
    generic_kernel(storage, "from")(h, b, c, hw, mode, out)
    return out
