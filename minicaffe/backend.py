"""numpy/CuPy choice, GPU discovery, streams and allocation.

This is the only module of minicaffe that imports CuPy.  Everything else asks
here: ``backend.cp`` is the cupy module or None, ``gpu_count()`` says how many
devices there are, ``get_array_module`` picks numpy or cupy for some arrays.
Allocation of device and pinned host memory goes through :func:`alloc_gpu`
and :func:`alloc_host`, so a stream-ordered pool can be switched in later at
one place.
"""
import numpy as np

try:  # pragma: no cover - depends on the machine
    import cupy as cp
    import cupyx
    _CUPY_ERROR = None
except Exception as e:  # ImportError, or a broken CUDA install
    cp = None
    cupyx = None
    _CUPY_ERROR = e

_GPU_COUNT = None


def cupy_available():
    return cp is not None


def gpu_count():
    """Number of CUDA devices CuPy can see (0 without CuPy or a driver)."""
    global _GPU_COUNT
    if _GPU_COUNT is None:
        if cp is None:
            _GPU_COUNT = 0
        else:
            try:
                _GPU_COUNT = cp.cuda.runtime.getDeviceCount()
            except Exception:
                _GPU_COUNT = 0
    return _GPU_COUNT


def gpu_available():
    return gpu_count() > 0


def why_no_gpu():
    if cp is None:
        return f"CuPy is not installed or failed to import ({_CUPY_ERROR}); " \
               "install minicaffe[cuda12] or minicaffe[cuda13]"
    return "CuPy found no CUDA device"


def check_device(device_id):
    """Raise a clear error unless ``device_id`` names a usable GPU."""
    from .errors import MinicaffeError
    n = gpu_count()
    if n == 0:
        raise MinicaffeError(f"GPU mode requested but no GPU is usable: {why_no_gpu()}")
    if not 0 <= device_id < n:
        raise MinicaffeError(f"GPU {device_id} requested but only {n} device(s) exist")


def gpu_name(device_id):
    """The device's name, or '?' when the driver will not say."""
    try:
        name = cp.cuda.runtime.getDeviceProperties(device_id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # pragma: no cover - depends on the driver
        return "?"


def get_array_module(*arrays):
    """numpy or cupy, whichever holds the arrays (chainer's idiom)."""
    if cp is not None:
        return cp.get_array_module(*arrays)
    return np


def is_gpu_array(a):
    return cp is not None and isinstance(a, cp.ndarray)


def to_numpy(a):
    if is_gpu_array(a):
        return cp.asnumpy(a)
    return np.asarray(a)


def alloc_host(size, dtype, pinned=False):
    """Zero-filled host buffer of ``size`` elements, page-locked if asked and possible."""
    if pinned and cupyx is not None and gpu_available():
        a = cupyx.empty_pinned((size,), dtype=dtype)
        a[...] = 0
        return a
    return np.zeros(size, dtype=dtype)


def alloc_gpu(size, dtype):
    """Zero-filled device buffer of ``size`` elements on the current device."""
    return cp.zeros(size, dtype=dtype)


# -- peak memory of the allocator ---------------------------------------------------------
def reset_peak_gpu_bytes():
    """Start a new high-water mark of minicaffe's GPU allocator (gpu/pool.py); no-op
    without a GPU."""
    if cp is None or not gpu_available():
        return
    from .gpu import pool
    pool.reset_peak()


def peak_gpu_bytes():
    """Most bytes minicaffe's GPU allocator has had in use since reset_peak_gpu_bytes():
    the stream-ordered pool's high-water mark, or the caching pool's total_bytes (0 without
    a GPU).  A GPU step's graphs keep their temporaries in pools of their own, counted by
    ``GpuStep.private_bytes()``."""
    if cp is None or not gpu_available():
        return 0
    from .gpu import pool
    return pool.peak_bytes()


def copy_to_gpu(dst, src, stream=None):
    """Copy host array ``src`` into device array ``dst`` (asynchronous if pinned)."""
    if stream is None:
        dst.set(src)
    else:
        dst.set(src, stream=stream)


def copy_to_host(dst, src, stream=None):
    src.get(out=dst, stream=stream)


def register_host(address, nbytes):
    """Page-lock host memory we did not allocate (cudaHostRegister), so copies from it are
    asynchronous DMA; False where it cannot be (no GPU, or the driver refuses)."""
    if cp is None or not gpu_available():
        return False
    try:
        cp.cuda.runtime.hostRegister(address, nbytes, 0)
        return True
    except Exception:
        return False


def unregister_host(address):
    try:
        cp.cuda.runtime.hostUnregister(address)
    except Exception:
        pass


def new_stream(non_blocking=True):
    return cp.cuda.Stream(non_blocking=non_blocking)


def current_stream():
    return cp.cuda.get_current_stream()


def synchronize():
    if cp is not None and gpu_available():
        cp.cuda.Device().synchronize()
