"""GEMM for layer bodies written once for numpy and CuPy.

numpy: ``np.matmul``.  CuPy: cuBLAS called through ctypes (``gpu/cublas.py``), because
CuPy's own cuBLAS calls cannot be captured in a CUDA graph.  ``out`` is always given
(the layers own their outputs), and ``beta=1`` accumulates into it, as parameter
gradients need.  ``tf32`` (GPU): the calling layer's run setting (``Layer.config.tf32``);
None keeps the process default (``gpu.options.tf32``).
"""
import numpy as np


def _blend(r, out, alpha, beta):
    """out = alpha r + beta out (numpy)."""
    if alpha != 1:
        r *= out.dtype.type(alpha)
    if beta == 0:
        out[...] = r
    else:
        if beta != 1:
            out *= out.dtype.type(beta)
        out += r
    return out


def gemm(xp, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, tf32=None):
    """out = alpha op(a) op(b) + beta out for 2-D arrays (op: transpose if asked)."""
    if xp is np:
        aa = a.T if trans_a else a
        bb = b.T if trans_b else b
        if beta == 0 and alpha == 1:
            return np.matmul(aa, bb, out=out)
        return _blend(aa @ bb, out, alpha, beta)
    from ..gpu import cublas
    return cublas.matmul(xp.ascontiguousarray(a), xp.ascontiguousarray(b), out,
                         trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta, tf32=tf32)


def gemm_batched(xp, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0,
                 tf32=None):
    """``gemm`` over the leading axis of 3-D arrays; a 2-D ``a`` or ``b`` is shared."""
    if xp is np:
        aa = a.swapaxes(-1, -2) if trans_a else a
        bb = b.swapaxes(-1, -2) if trans_b else b
        return _blend(np.matmul(aa, bb), out, alpha, beta)
    from ..gpu import cublas
    return cublas.matmul_batched(xp.ascontiguousarray(a), xp.ascontiguousarray(b), out,
                                 trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta,
                                 tf32=tf32)
