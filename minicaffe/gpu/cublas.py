"""cuBLAS through ctypes: GEMMs that capture inside CUDA graphs.

CuPy refuses its own cuBLAS calls during stream capture; libcublas called directly,
with a handle of our own, a fixed workspace (``cublasSetWorkspace_v2``, so cuBLAS
allocates nothing while capturing) and the current stream, captures and gives the same
results (DESIGN.md).  One handle per thread and device, kept in the thread's manager.

``matmul_ex(a, b, out)`` the same through ``cublasGemmEx`` for 2-byte operands
(float16, or bfloat16 held as uint16 words) with fp32 accumulation, into a 2-byte or an
fp32 ``out`` (real 16-bit storage, engine/precision.py).  ``matmul(a, b, out)`` is the row-major product of C-contiguous 2-D CuPy arrays (with
optional transposes, alpha and beta); ``matmul_batched`` the same over a leading batch
axis.  Math mode follows the caller's ``tf32`` (a layer passes its run's
``RunConfig.tf32``), else ``options.tf32``: strict fp32 unless TF32 is switched on.
"""
import ctypes

import numpy as np

from ..core import backend, context
from . import libs, options

WORKSPACE_BYTES = 32 << 20   # cuBLAS's advice for Hopper
_OP_N, _OP_T = 0, 1
_DEFAULT_MATH, _TF32_MATH = 0, 3

_lib = None
_c_void_p, _c_int, _c_longlong = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_fp = ctypes.POINTER(ctypes.c_float)
_dp = ctypes.POINTER(ctypes.c_double)


class CublasError(RuntimeError):
    pass


def lib():
    global _lib
    if _lib is None:
        l, _ = libs.load_cublas()
        l.cublasCreate_v2.argtypes = [ctypes.POINTER(_c_void_p)]
        l.cublasSetStream_v2.argtypes = [_c_void_p, _c_void_p]
        l.cublasSetWorkspace_v2.argtypes = [_c_void_p, _c_void_p, ctypes.c_size_t]
        l.cublasSetMathMode.argtypes = [_c_void_p, _c_int]
        for name, p in (("cublasSgemm_v2", _fp), ("cublasDgemm_v2", _dp)):
            getattr(l, name).argtypes = [_c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int, p,
                                         _c_void_p, _c_int, _c_void_p, _c_int, p, _c_void_p, _c_int]
        for name, p in (("cublasSgemmStridedBatched", _fp), ("cublasDgemmStridedBatched", _dp)):
            getattr(l, name).argtypes = [_c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int, p,
                                         _c_void_p, _c_int, _c_longlong, _c_void_p, _c_int,
                                         _c_longlong, p, _c_void_p, _c_int, _c_longlong, _c_int]
        l.cublasGemmEx.argtypes = [_c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int,
                                   _c_void_p, _c_void_p, _c_int, _c_int, _c_void_p, _c_int,
                                   _c_int, _c_void_p, _c_void_p, _c_int, _c_int, _c_int,
                                   _c_int]
        _lib = l
    return _lib


def _check(status, what):
    if status != 0:
        raise CublasError(f"{what} failed with cuBLAS status {status}")


class _Handle:
    """A cuBLAS handle with its workspace, the stream and math mode it was last given."""

    def __init__(self):
        l = lib()
        h = _c_void_p()
        _check(l.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.ptr = h
        self.workspace = backend.alloc_kept(WORKSPACE_BYTES)
        _check(l.cublasSetWorkspace_v2(h, self.workspace.data.ptr, WORKSPACE_BYTES),
               "cublasSetWorkspace")
        self.stream = None
        self.math = None

    def ready(self, tf32=None):
        """The handle, set to the current stream and math mode (``tf32``; None: the
        process default ``options.tf32``)."""
        s = backend.cp.cuda.get_current_stream().ptr
        if s != self.stream:
            _check(lib().cublasSetStream_v2(self.ptr, s), "cublasSetStream")
            self.stream = s
        m = _TF32_MATH if (options.tf32 if tf32 is None else tf32) else _DEFAULT_MATH
        if m != self.math:
            _check(lib().cublasSetMathMode(self.ptr, m), "cublasSetMathMode")
            self.math = m
        return self.ptr


def handle(tf32=None):
    handles = context.get().handles
    h = handles.get("cublas")
    if h is None:
        h = handles["cublas"] = _Handle()
    return h.ready(tf32)


def _scalar(dtype, v):
    return ctypes.byref(ctypes.c_float(v) if dtype == np.float32 else ctypes.c_double(v))


def _fn(dtype, batched=False):
    if dtype == np.float32:
        return lib().cublasSgemmStridedBatched if batched else lib().cublasSgemm_v2
    if dtype == np.float64:
        return lib().cublasDgemmStridedBatched if batched else lib().cublasDgemm_v2
    raise TypeError(f"cuBLAS GEMM supports float32/float64, not {dtype}")


def _dims(a, b, trans_a, trans_b):
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    Kb, N = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if K != Kb:
        raise ValueError(f"matmul: inner dimensions differ ({a.shape}{'^T' if trans_a else ''} "
                         f"x {b.shape}{'^T' if trans_b else ''})")
    return M, N, K


def _plain(a, b, out, trans_a, trans_b, what):
    """(M, N, K) of a 2-D product, its arrays checked (C-contiguous 2-D, out's shape)."""
    for x in (a, b, out):
        if x.ndim != 2 or not x.flags.c_contiguous:
            raise ValueError(f"{what} wants C-contiguous 2-D arrays")
    M, N, K = _dims(a, b, trans_a, trans_b)
    if out.shape != (M, N):
        raise ValueError(f"{what}: out has shape {out.shape}, the product is ({M}, {N})")
    return M, N, K


def matmul(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, tf32=None):
    """out = alpha op(a) op(b) + beta out, row-major 2-D C-contiguous arrays.

    Row-major C = A B is column-major C^T = B^T A^T, so cuBLAS gets the operands swapped."""
    M, N, K = _plain(a, b, out, trans_a, trans_b, "matmul")
    if M == 0 or N == 0:
        return out
    dt = out.dtype
    _check(_fn(dt)(handle(tf32), _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N,
                   N, M, K, _scalar(dt, alpha), b.data.ptr, b.shape[1], a.data.ptr, a.shape[1],
                   _scalar(dt, beta), out.data.ptr, N), "cublasSgemm")
    return out


def _batched(a, b, out, trans_a, trans_b, what):
    """(batch, stride of a, stride of b, a's and b's first matrices, M, N, K) of a
    strided-batched product; a 2-D ``a`` or ``b`` has stride 0 (shared)."""
    nb = out.shape[0]
    sa = 0 if a.ndim == 2 else a.shape[1] * a.shape[2]
    sb = 0 if b.ndim == 2 else b.shape[1] * b.shape[2]
    a2 = a if a.ndim == 2 else a[0]
    b2 = b if b.ndim == 2 else b[0]
    M, N, K = _dims(a2, b2, trans_a, trans_b)
    if out.shape[1:] != (M, N):
        raise ValueError(f"{what}: out has shape {out.shape}, the product is ({M}, {N})")
    for x in (a, b, out):
        if not x.flags.c_contiguous:
            raise ValueError(f"{what} wants C-contiguous arrays")
    return nb, sa, sb, a2, b2, M, N, K


def matmul_batched(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, tf32=None):
    """``matmul`` over the leading axis of 3-D arrays (stride 0 allowed for a or b by
    passing a 2-D array, which is then shared by every batch entry)."""
    nb, sa, sb, a2, b2, M, N, K = _batched(a, b, out, trans_a, trans_b, "matmul_batched")
    if nb == 0 or M == 0 or N == 0:
        return out
    dt = out.dtype
    _check(_fn(dt, True)(handle(tf32), _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N,
                         N, M, K, _scalar(dt, alpha), b.data.ptr, b2.shape[1], sb,
                         a.data.ptr, a2.shape[1], sa, _scalar(dt, beta), out.data.ptr, N, M * N,
                         nb), "cublasSgemmStridedBatched")
    return out


# cudaDataType of an operand by its array dtype (uint16 words: bfloat16)
_CUDA_R = {np.dtype(np.float32): 0, np.dtype(np.float16): 2, np.dtype(np.uint16): 14}
_COMPUTE_32F, _GEMM_DEFAULT = 68, -1


def matmul_ex(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """``matmul`` with 2-byte ``a`` and ``b`` (float16, or bfloat16 as uint16 words) and
    fp32 accumulation (tensor cores); ``out`` 2-byte (rounded) or float32."""
    M, N, K = _plain(a, b, out, trans_a, trans_b, "matmul_ex")
    if M == 0 or N == 0:
        return out
    fa = ctypes.c_float(alpha)
    fb = ctypes.c_float(beta)
    _check(lib().cublasGemmEx(
        handle(), _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N, N, M, K,
        ctypes.addressof(fa), b.data.ptr, _CUDA_R[b.dtype], b.shape[1], a.data.ptr,
        _CUDA_R[a.dtype], a.shape[1], ctypes.addressof(fb), out.data.ptr, _CUDA_R[out.dtype], N,
        _COMPUTE_32F, _GEMM_DEFAULT), "cublasGemmEx")
    return out


def matmul_ex_batched(a, b, out, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """``matmul_ex`` over the leading axis of 3-D arrays (``cublasGemmStridedBatchedEx``);
    a 2-D ``a`` or ``b`` is shared by every batch entry (stride 0)."""
    nb, sa, sb, a2, b2, M, N, K = _batched(a, b, out, trans_a, trans_b, "matmul_ex_batched")
    if nb == 0 or M == 0 or N == 0:
        return out
    l = lib()
    if not getattr(l.cublasGemmStridedBatchedEx, "argtypes", None):
        l.cublasGemmStridedBatchedEx.argtypes = [
            _c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int, _c_void_p, _c_void_p, _c_int,
            _c_int, _c_longlong, _c_void_p, _c_int, _c_int, _c_longlong, _c_void_p, _c_void_p,
            _c_int, _c_int, _c_longlong, _c_int, _c_int, _c_int]
    fa = ctypes.c_float(alpha)
    fb = ctypes.c_float(beta)
    _check(l.cublasGemmStridedBatchedEx(
        handle(), _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N, N, M, K,
        ctypes.addressof(fa), b.data.ptr, _CUDA_R[b.dtype], b2.shape[1], sb, a.data.ptr,
        _CUDA_R[a.dtype], a2.shape[1], sa, ctypes.addressof(fb), out.data.ptr,
        _CUDA_R[out.dtype], N, M * N, nb, _COMPUTE_32F, _GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx")
    return out
