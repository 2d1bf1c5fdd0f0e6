"""Backend helpers shared by the kernels: lazy CuPy access and kernel caches.

Nothing here imports CuPy at module import time.  ``_cupy()`` imports it on
first use (and remembers a failure), and every CUDA kernel is compiled by a
memoised factory the first time a CuPy array reaches it, so the numpy (CPU)
mode never needs CuPy, a GPU or a CUDA toolchain.

Dispatch rule used by every public kernel: if the first array argument is a
``cupy.ndarray`` the CuPy body runs, otherwise the numpy body.  The check
looks at the type's module name first, so numpy calls never import CuPy.
"""
from __future__ import annotations

import functools

import numpy as np

__all__ = [
    "_cupy", "is_cupy_array", "get_array_module", "as_pair", "cuda_type",
    "kernel_code", "raw_kernel", "elementwise_kernel", "launch", "FLT_MAX", "FLT_MIN",
]

# Caffe uses the float limits for both float and double Dtype.
FLT_MAX = float(np.finfo(np.float32).max)
FLT_MIN = float(np.finfo(np.float32).tiny)

CUDA_NUM_THREADS = 256
# --fmad=false: no multiply-add contraction, so the GPU rounds like numpy
# (one rounding per operation) and parity tests can use tight tolerances.
NVRTC_OPTIONS = ("--fmad=false",)

def _cupy():
    """The ``cupy`` module, or ``None``: minicaffe.core.backend is the one place that imports it."""
    from ..core import backend
    return backend.gpu_module()


def is_cupy_array(a) -> bool:
    """True iff ``a`` is a ``cupy.ndarray`` (minicaffe.core.backend.is_gpu_array)."""
    from ..core import backend
    return backend.is_gpu_array(a)


def get_array_module(a):
    """``cupy`` for CuPy arrays, ``numpy`` for everything else (minicaffe.core.backend's)."""
    from ..core import backend
    return backend.get_array_module(a)


def as_pair(v, name="value"):
    """Normalise an int or a length-2 sequence to a tuple of two ints."""
    if isinstance(v, (int, np.integer)):
        return int(v), int(v)
    t = tuple(int(e) for e in v)
    if len(t) == 1:
        return t[0], t[0]
    if len(t) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v!r}")
    return t


def cuda_type(dtype) -> str:
    """CUDA C type name for a supported floating dtype."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return "float"
    if dtype == np.float64:
        return "double"
    raise TypeError(f"CuPy kernels support float32/float64 only, got {dtype}")


_PRELUDE = r"""
typedef {ctype} T;
#define CUDA_KERNEL_LOOP(i, n) \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; \
       i < (n); i += (long long)blockDim.x * gridDim.x)
#define MC_FLT_MAX 3.402823466e+38F
#define MC_FLT_MIN 1.175494351e-38F
"""


def kernel_code(source: str, ctype: str) -> str:
    """The CUDA C that ``raw_kernel`` compiles for ``source`` with ``T`` = ``ctype``:
    the prelude's ``T`` and macros, then ``source``."""
    return _PRELUDE.replace("{ctype}", ctype) + source


@functools.lru_cache(maxsize=None)
def raw_kernel(source: str, name: str, ctype: str):
    """Compile (once per source/name/type) an ``extern "C"`` CUDA kernel.

    ``source`` may use ``T`` for the element type and the macros of
    ``_PRELUDE`` (``CUDA_KERNEL_LOOP``, ``MC_FLT_MAX``, ``MC_FLT_MIN``).
    """
    cp = _cupy()
    if cp is None:  # pragma: no cover - only reached without CuPy
        raise RuntimeError("CuPy is not available")
    return cp.RawKernel(kernel_code(source, ctype), name, options=NVRTC_OPTIONS)


@functools.lru_cache(maxsize=None)
def elementwise_kernel(in_params: str, out_params: str, operation: str, name: str):
    """Memoised ``cupy.ElementwiseKernel`` factory."""
    cp = _cupy()
    if cp is None:  # pragma: no cover
        raise RuntimeError("CuPy is not available")
    return cp.ElementwiseKernel(in_params, out_params, operation, name,
                                options=NVRTC_OPTIONS)


def launch(kernel, n: int, args) -> None:
    """Launch a grid-stride kernel over ``n`` work items."""
    n = int(n)
    if n <= 0:
        return
    blocks = min((n + CUDA_NUM_THREADS - 1) // CUDA_NUM_THREADS, 1 << 20)
    kernel((blocks,), (CUDA_NUM_THREADS,), tuple(args))


_SPIN_SRC = r"""
extern "C" __global__ void mc_spin(const unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def gpu_spin(ms: float) -> None:
    """Keep the current stream busy for ``ms`` milliseconds (one thread reading the
    global timer): the host's launches queue behind it, so CUDA events recorded around
    work launched meanwhile time the device's work alone, not the host's launch cost."""
    k = raw_kernel(_SPIN_SRC, "mc_spin", "float")
    k((1,), (1,), (np.uint64(int(ms * 1e6)),))
