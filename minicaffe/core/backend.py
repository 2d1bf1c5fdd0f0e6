"""numpy/CuPy choice, GPU discovery, streams and allocation.

This is the only module of minicaffe that imports CuPy.  Everything else asks
here, through named functions (``backend.cp``, the module itself, is used only here and
in gpu/: tests/test_architecture.py checks it): ``gpu_module()`` is the array module of
the device (cupy, the ``xp`` of a layer's GPU body) or None, ``gpu_count()`` says how
many devices there are, ``get_array_module`` picks numpy or cupy for some arrays;
devices, streams, events and the runtime's figures below.
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
               "from the minicaffe checkout run pip install \".[cuda12]\" (or \".[cuda13]\")"
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


def alloc_arena(nbytes):
    """An uninitialised device buffer of ``nbytes`` bytes (uint8) on the current device,
    or None when the device has no room for it (the memory plan's arena).  Like
    ``alloc_kept``, on the legacy default stream: every arena of a net is allocated and
    freed on that one stream, so a re-plan's new arena may take the memory of the old
    one, freed just before, in stream order (from a pool of the stream-ordered
    allocator, memory freed on one stream is not handed to another stream's allocation
    before that free is known to have run)."""
    try:
        return alloc_kept(int(nbytes))
    except cp.cuda.memory.OutOfMemoryError:
        return None


def let_freed_go():
    """After a large device buffer was let go (a re-plan's old arena): wait for the
    device, so that the stream-ordered pool may hand the freed memory to an allocation
    on any stream, and make CuPy's caching pool (``MINICAFFE_GPU_ALLOCATOR=default``)
    give its cached free blocks back to the driver, so the freed buffer is not held
    beside the next one.  A no-op without a GPU."""
    if cp is None or not gpu_available():
        return
    cp.cuda.Device().synchronize()
    if _allocator["name"] != "async":
        _default_pool().free_all_blocks()


def alloc_kept(nbytes):
    """An uninitialised device buffer of ``nbytes`` that outlives the stream current now
    (a library workspace cached for a thread: cuBLAS's, cuDNN's, a shared scratch).

    The stream-ordered pool frees a buffer on the stream that allocated it, whoever lets it
    go and whenever: a buffer allocated while a user's stream was current, kept after that
    stream was destroyed, fails to free (``freeAsync: cudaErrorInvalidValue``).  So it is
    allocated on the legacy default stream, which is never destroyed, and the current
    stream waits for the allocation.  While the current stream captures a graph (the
    capture allocates from its own pool), it is allocated as any other array."""
    cur = cp.cuda.get_current_stream()
    if cur.ptr == 0 or cur.is_capturing():
        return cp.empty(int(nbytes), dtype=np.uint8)
    null = cp.cuda.Stream.null
    with null:
        buf = cp.empty(int(nbytes), dtype=np.uint8)
    cur.wait_event(null.record())
    return buf


# -- the GPU allocator (named API: gpu/pool.py) -------------------------------------------
# ``use_allocator("async")`` installs CuPy's ``MemoryAsyncPool`` (the seed's cudaMallocAsync)
# on the current device, with the pool's release threshold raised to "never", so memory
# freed at the end of an iteration stays reserved for the next one instead of going back to
# the driver at every synchronisation.  ``use_allocator("default")`` keeps CuPy's caching
# MemoryPool.  Memory from the async pool is freed on the stream that allocated it; a buffer
# handed to another stream needs an event wait and a reference held until that stream is
# done (the data layer's prefetch does both).
#
# ``peak_gpu_bytes()`` is the high-water mark of bytes in use since ``reset_peak_gpu_bytes()``:
# ``cudaMemPoolAttrUsedMemHigh`` for the async pool; the default pool keeps no high-water
# mark, so for it we report its ``total_bytes()`` (what it took from the driver since the
# reset freed its cached blocks: freed blocks it keeps count too).
# It lives here, in the core, because ``context.set_mode_gpu`` installs it on first use of
# a device and the core imports nothing of gpu/.
DEFAULT_ALLOCATOR = "async"
_allocator = {"name": "default", "pool": None}
_prepared = set()


def ensure_allocator():
    """Install the process's GPU allocator on first use of a device: the stream-ordered
    pool unless ``MINICAFFE_GPU_ALLOCATOR=default`` asks for CuPy's caching pool."""
    from .config import env
    kind = env("MINICAFFE_GPU_ALLOCATOR")
    dev = cp.cuda.runtime.getDevice()
    if (kind, dev) in _prepared:
        return
    _prepared.add((kind, dev))
    if kind == "async":
        use_allocator("async")
        rt, mp = _mempool()   # each device has its own pool: keep its memory reserved
        rt.memPoolSetAttribute(mp, _attr("cudaMemPoolAttrReleaseThreshold"), (1 << 63) - 1)
    else:
        use_allocator(kind)


def _mempool():
    rt = cp.cuda.runtime
    return rt, rt.deviceGetDefaultMemPool(rt.getDevice())


def _attr(name):
    return getattr(cp.cuda.runtime, name)


def allocator_name():
    return _allocator["name"]


def use_allocator(kind):
    """Install allocator ``kind`` ('async' or 'default') for CuPy on this process."""
    from . import log
    if kind not in ("async", "default"):
        raise ValueError(f"unknown GPU allocator '{kind}' (async or default)")
    if cp is None:
        raise RuntimeError("no CuPy: there is no GPU allocator to choose")
    if kind == _allocator["name"] and _allocator["pool"] is not None:
        return
    if kind == "async":
        pool = cp.cuda.MemoryAsyncPool("default")
        rt, mp = _mempool()
        rt.memPoolSetAttribute(mp, _attr("cudaMemPoolAttrReleaseThreshold"), (1 << 63) - 1)
        cp.cuda.set_allocator(pool.malloc)
    else:
        pool = cp.get_default_memory_pool()
        cp.cuda.set_allocator(pool.malloc)
    _allocator.update(name=kind, pool=pool)
    log.info("GPU allocator: %s", describe_allocator())


def describe_allocator():
    return ("stream-ordered pool (cudaMallocAsync, release threshold: never)"
            if _allocator["name"] == "async" else "CuPy's caching memory pool")


def _default_pool():
    if _allocator["pool"] is None:
        _allocator["pool"] = cp.get_default_memory_pool()
    return _allocator["pool"]


def reset_peak_gpu_bytes():
    """Start a new high-water mark of minicaffe's GPU allocator; no-op without a GPU."""
    if cp is None or not gpu_available():
        return
    if _allocator["name"] == "async":
        rt, mp = _mempool()
        rt.memPoolSetAttribute(mp, _attr("cudaMemPoolAttrUsedMemHigh"), 0)
        rt.memPoolSetAttribute(mp, _attr("cudaMemPoolAttrReservedMemHigh"), 0)
    else:
        _default_pool().free_all_blocks()


def peak_gpu_bytes():
    """Most bytes minicaffe's GPU allocator has had in use since reset_peak_gpu_bytes():
    the stream-ordered pool's high-water mark, or the caching pool's total_bytes (0 without
    a GPU).  A GPU step's graphs keep their temporaries in pools of their own, counted by
    ``GpuStep.private_bytes()``."""
    if cp is None or not gpu_available():
        return 0
    if _allocator["name"] == "async":
        rt, mp = _mempool()
        return int(rt.memPoolGetAttribute(mp, _attr("cudaMemPoolAttrUsedMemHigh")))
    return _default_pool().total_bytes()


def used_gpu_bytes():
    if cp is None or not gpu_available():
        return 0
    if _allocator["name"] == "async":
        rt, mp = _mempool()
        return int(rt.memPoolGetAttribute(mp, _attr("cudaMemPoolAttrUsedMemCurrent")))
    return _default_pool().used_bytes()


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


def new_stream(non_blocking=True, priority=None):
    """A new stream; ``priority``: 'highest' for the device's greatest priority (where the
    runtime tells it), else the default."""
    if priority == "highest":
        try:
            _, greatest = cp.cuda.runtime.deviceGetStreamPriorityRange()
            return cp.cuda.Stream(non_blocking=non_blocking, priority=greatest)
        except Exception:   # pragma: no cover - depends on the runtime
            pass
    return cp.cuda.Stream(non_blocking=non_blocking)


def current_stream():
    return cp.cuda.get_current_stream()


# -- the device, its runtime, events (named calls, so nothing else reaches cupy.cuda) -------
def gpu_module():
    """The array module of the device (cupy: a layer's ``xp`` in GPU mode), or None."""
    return cp


def null_stream():
    """The device's legacy default stream."""
    return cp.cuda.Stream.null


def new_event(timing=True, block=False):
    """A CUDA event (``timing``: it can time, ``block``: a wait on it blocks the thread)."""
    return cp.cuda.Event(block=block, disable_timing=not timing)


def elapsed_ms(start, end):
    """Milliseconds between two recorded events."""
    return cp.cuda.get_elapsed_time(start, end)


def current_device():
    """The id of this thread's current device."""
    return cp.cuda.runtime.getDevice()


def use_device(device_id):
    """Make ``device_id`` this thread's current device."""
    cp.cuda.Device(device_id).use()


def on_device(device_id):
    """A context manager: ``device_id`` current inside it."""
    return cp.cuda.Device(device_id)


def device_properties(device_id):
    """The runtime's property dictionary of a device."""
    return cp.cuda.runtime.getDeviceProperties(device_id)


def device_memory():
    """(free bytes, total bytes) of the current device."""
    free, total = cp.cuda.runtime.memGetInfo()
    return int(free), int(total)


def runtime_version():
    return cp.cuda.runtime.runtimeGetVersion()


def cupy_version():
    """CuPy's version, or None without CuPy."""
    return cp.__version__ if cp is not None else None


def gpu_random_state(seed):
    """A CuPy generator seeded with ``seed`` on the current device."""
    return cp.random.RandomState(seed)


def memcpy_async(dst, src, nbytes, kind, stream):
    """cudaMemcpyAsync of ``nbytes`` between raw pointers (``kind``: cudaMemcpyKind, 1
    host to device, 2 device to host) on ``stream``."""
    cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)


def synchronize():
    if cp is not None and gpu_available():
        cp.cuda.Device().synchronize()
