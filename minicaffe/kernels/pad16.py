"""Channels-last 2-byte maps widened with zero channels (issue 20): a first convolution's
3 input channels padded to 8 (``pad_channels``), so that cuDNN's channels-last
tensor-core kernels, which want C a multiple of 8, can take it (layers/cudnn_layers.py).

Arrays hold ``M`` rows of ``c`` (in) and ``p`` (out) 2-byte words (a BFLOAT16 buffer's
uint16 words or a FLOAT16 one's float16); numpy arrays run a numpy body, CuPy ones one
element-wise kernel.
"""
import numpy as np

from ._backend import elementwise_kernel, is_cupy_array


def pad_channels(x, out, c, p):
    """``out`` (M, p) = ``x`` (M, c) followed by p - c zero channels per row; returns
    ``out``."""
    if not 0 < c <= p:
        raise ValueError(f"{c} channels do not pad to {p}")
    if x.size % c or out.size != x.size // c * p:
        raise ValueError(f"{x.size} values of {c} channels do not fill {out.size} of {p}")
    xw, ow = x.reshape(-1).view(np.uint16), out.reshape(-1).view(np.uint16)
    if not is_cupy_array(x):
        o = ow.reshape(-1, p)
        o[:, :c] = xw.reshape(-1, c)
        o[:, c:] = 0
        return out
    elementwise_kernel(
        "raw uint16 x, int32 c, int32 p", "uint16 y",
        "const long long r = i / p; const int k = (int)(i - r * p);\n"
        "y = k < c ? x[r * c + k] : (unsigned short)0;", "mc_pad_channels16")(
        xw, np.int32(c), np.int32(p), ow)
    return out
