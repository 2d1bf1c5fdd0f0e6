"""The GPU allocator: CuPy's default pool or the stream-ordered pool (cudaMallocAsync).

``use("async")`` installs CuPy's ``MemoryAsyncPool`` (the seed's cudaMallocAsync) on the
current device, with the pool's release threshold raised to "never", so memory freed at
the end of an iteration stays reserved for the next one instead of going back to the
driver at every synchronisation.  ``use("default")`` keeps CuPy's caching MemoryPool.
Memory from the async pool is freed on the stream that allocated it; a buffer handed to
another stream needs an event wait and a reference held until that stream is done
(the data layer's prefetch does both).

``peak_bytes()`` is the high-water mark of bytes in use since ``reset_peak()``:
``cudaMemPoolAttrUsedMemHigh`` for the async pool; the default pool keeps no high-water
mark, so for it we report its ``total_bytes()`` (what it took from the driver since
``reset_peak`` freed its cached blocks: freed blocks it keeps count too), as the issue's
baseline table did.
"""
from .. import backend, log

_current = {"name": "default", "pool": None}
_prepared = set()
DEFAULT = "async"


def ensure():
    """Install the process's GPU allocator on first use of a device: the stream-ordered
    pool unless ``MINICAFFE_GPU_ALLOCATOR=default`` asks for CuPy's caching pool."""
    import os
    kind = os.environ.get("MINICAFFE_GPU_ALLOCATOR", DEFAULT).strip().lower() or DEFAULT
    dev = backend.cp.cuda.runtime.getDevice()
    if (kind, dev) in _prepared:
        return
    _prepared.add((kind, dev))
    if kind == "async":
        use("async")
        rt, mp = _mempool()   # each device has its own pool: keep its memory reserved
        rt.memPoolSetAttribute(mp, _attr("cudaMemPoolAttrReleaseThreshold"), (1 << 63) - 1)
    else:
        use(kind)


def _mempool():
    rt = backend.cp.cuda.runtime
    return rt, rt.deviceGetDefaultMemPool(rt.getDevice())


def _attr(name):
    return getattr(backend.cp.cuda.runtime, name)


def name():
    return _current["name"]


def use(kind):
    """Install allocator ``kind`` ('async' or 'default') for CuPy on this process."""
    cp = backend.cp
    if kind not in ("async", "default"):
        raise ValueError(f"unknown GPU allocator '{kind}' (async or default)")
    if cp is None:
        raise RuntimeError("no CuPy: there is no GPU allocator to choose")
    if kind == _current["name"] and _current["pool"] is not None:
        return
    if kind == "async":
        pool = cp.cuda.MemoryAsyncPool("default")
        rt, mp = _mempool()
        rt.memPoolSetAttribute(mp, _attr("cudaMemPoolAttrReleaseThreshold"), (1 << 63) - 1)
        cp.cuda.set_allocator(pool.malloc)
    else:
        pool = cp.get_default_memory_pool()
        cp.cuda.set_allocator(pool.malloc)
    _current.update(name=kind, pool=pool)
    log.info("GPU allocator: %s", describe())


def describe():
    return ("stream-ordered pool (cudaMallocAsync, release threshold: never)"
            if _current["name"] == "async" else "CuPy's caching memory pool")


def _pool():
    if _current["pool"] is None:
        _current["pool"] = backend.cp.get_default_memory_pool()
    return _current["pool"]


def reset_peak():
    cp = backend.cp
    if cp is None or not backend.gpu_available():
        return
    if _current["name"] == "async":
        rt, mp = _mempool()
        rt.memPoolSetAttribute(mp, _attr("cudaMemPoolAttrUsedMemHigh"), 0)
        rt.memPoolSetAttribute(mp, _attr("cudaMemPoolAttrReservedMemHigh"), 0)
    else:
        _pool().free_all_blocks()


def peak_bytes():
    """GPU bytes at the high-water mark since ``reset_peak`` (see the module docstring)."""
    cp = backend.cp
    if cp is None or not backend.gpu_available():
        return 0
    if _current["name"] == "async":
        rt, mp = _mempool()
        return int(rt.memPoolGetAttribute(mp, _attr("cudaMemPoolAttrUsedMemHigh")))
    return _pool().total_bytes()


def used_bytes():
    cp = backend.cp
    if cp is None or not backend.gpu_available():
        return 0
    if _current["name"] == "async":
        rt, mp = _mempool()
        return int(rt.memPoolGetAttribute(mp, _attr("cudaMemPoolAttrUsedMemCurrent")))
    return _pool().used_bytes()
