"""GEMM for layer bodies written once for numpy and CuPy.

numpy: ``np.matmul``.  CuPy: cuBLAS called through ctypes (``gpu/cublas.py``), because
CuPy's own cuBLAS calls cannot be captured in a CUDA graph.  ``out`` is always given
(the layers own their outputs), and ``beta=1`` accumulates into it, as parameter
gradients need.  ``tf32`` (GPU): the calling layer's run setting (``Layer.config.tf32``);
None keeps the process default (``gpu.options.tf32``).

numpy with a CPU kernel pool (core/threads.py: ``--threads N``, N > 1; the BLAS then runs
on one thread): a 2-D ``gemm`` of at least ``PARALLEL_MIN_PART`` multiply-adds per part is
split by rows (or columns, the longer of the two) of ``out``, one part per pool thread,
where the BLAS's kernel gives a part the bits it gives the same rows or columns of the
whole product: each output element is one dot product over the whole inner dimension,
but the order of its multiply-adds depends on where the element sits in the kernel's
register blocks, so parts must be whole blocks.  Which cuts keep the bits was measured
per OpenBLAS kernel (``SPLITS``: numpy 2.4's OpenBLAS 0.3.31 on a Zen 4 core, every cut
of 8 shapes, ``benchmarks/gemm_split_bits.py``); a BLAS or kernel not listed there is not
split (tests/layers/test_conv_threads.py checks the bits for the InnerProduct shapes;
OpenBLAS's small-matrix kernels, which sum in another order, are kept out by the part
size).
"""
import numpy as np

from ..core import threads as _threads

# Split GEMMs in the kernel pool: parts of at least 2^22 multiply-adds (well above the
# small-matrix kernels' 64^3, and about 50-100 us of BLAS work: with 2^20 LeNet's ip1
# backward took 15 parts on the GPU machine's 16 threads and ran slower than on one,
# 1.62 -> 2.05 ms; on two threads LeNet's three ip1 products still split in two), cut
# where the kernel keeps the bits: OpenBLAS's kernel (threadpoolctl's "architecture",
# lower case) -> (rows per block, columns per block or None: no column split).  Haswell's
# sgemm (also what OPENBLAS_CORETYPE=Haswell forces on newer cores) keeps them for rows
# cut at multiples of 24 and for no column cut at all; SkylakeX's for rows at multiples
# of 64 and columns at multiples of 128 (32-row and 64-column cuts change bits on both).
SPLITS = {"haswell": (24, None), "zen": (24, None),
          "skylakex": (64, 128), "cooperlake": (64, 128)}
PARALLEL_MIN_PART = 1 << 22


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


def _gemm_numpy(aa, bb, out, alpha, beta):
    if beta == 0 and alpha == 1:
        return np.matmul(aa, bb, out=out)
    return _blend(aa @ bb, out, alpha, beta)


def _parts(M, K, N):
    """With a CPU kernel pool, and not inside one of its threads: the pool, the axis of
    ``out`` to split (0: rows, 1: columns) and its ranges for an (M, K) x (K, N)
    product, else (None, None, None).  The larger of M and N is split, so that each
    thread packs its own part of the larger operand, not all of it."""
    pool = _threads.kernel_pool()
    if pool is None or _threads.in_kernel_pool():
        return None, None, None
    rows, columns = SPLITS.get(_threads.blas_kernel(), (None, None))
    if rows is None:
        return None, None, None
    axis, length, other = (0, M, N) if M >= N or columns is None else (1, N, M)
    align = rows if axis == 0 else columns
    rows = max(align, -(-PARALLEL_MIN_PART // max(K * other, 1)))
    rows = -(-rows // align) * align
    t = min(_threads.kernel_threads(), length // rows)
    if t < 2:
        return None, None, None
    cuts = [(length * i // t) // align * align for i in range(t)] + [length]
    return pool, axis, list(zip(cuts[:-1], cuts[1:]))


def gemm(xp, a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, tf32=None):
    """out = alpha op(a) op(b) + beta out for 2-D arrays (op: transpose if asked)."""
    if xp is np:
        aa = a.T if trans_a else a
        bb = b.T if trans_b else b
        pool, axis, parts = _parts(aa.shape[0], aa.shape[1], bb.shape[1])
        if pool is None:
            return _gemm_numpy(aa, bb, out, alpha, beta)
        if axis == 0:
            jobs = [(aa[r0:r1], bb, out[r0:r1]) for r0, r1 in parts]
        else:
            jobs = [(aa, bb[:, c0:c1], out[:, c0:c1]) for c0, c1 in parts]
        with _threads.single_blas():
            _threads.run_parts(len(jobs), lambda slot, i: _gemm_numpy(*jobs[i], alpha, beta))
        return out
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
