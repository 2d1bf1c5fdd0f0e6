"""NCCL bindings: CuPy's ``cupy.cuda.nccl`` communicator, and ``ncclCommAbort`` of the
libnccl CuPy loaded, called through ctypes so that it runs without the GIL.

Thin and named after NCCL's calls; the protocol (who reduces what, when, and what an
abort means for the other ranks) lives one level up, in ``comm.py`` and ``parallel.py``.
Every rank must issue collectives in the same order; ``all_reduce``/``bcast`` take raw
device pointers and a stream pointer.
"""
import ctypes
import functools
import os

import numpy as np

from ..core import backend


def module():
    """``cupy.cuda.nccl``, or None when CuPy or its NCCL is missing."""
    if backend.cp is None:
        return None
    try:
        from cupy.cuda import nccl
    except Exception:
        return None
    if not getattr(nccl, "available", True):
        return None
    return nccl


def why_missing():
    if backend.cp is None:
        return backend.why_no_gpu()
    return "this CuPy has no NCCL (cupy.cuda.nccl did not import; pip install nvidia-nccl-cu12 " \
           "or nvidia-nccl-cu13 to match CuPy)"


def keep_multicast_off():
    """NVLink SHARP/multicast (NVLS) stays off: set NCCL_NVLS_ENABLE=0 unless the user
    chose a value.  Must run before the first communicator is made."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def unique_id():
    """ncclGetUniqueId: the ``bytes`` one rank makes and hands to every rank."""
    return module().get_unique_id()


def dtype_code(nccl, dtype):
    table = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
             np.dtype(np.float16): nccl.NCCL_FLOAT16}
    return table[np.dtype(dtype)]


class Communicator:
    """ncclCommInitRank for this thread's device; ``all_reduce`` (sum, in place) and
    ``bcast`` of a device array on a stream; ``abort_in_thread``."""

    def __init__(self, size, uid, rank):
        self.nccl = module()
        self.rank = int(rank)
        self.comm = self.nccl.NcclCommunicator(int(size), uid, self.rank)

    def all_reduce(self, array, stream):
        n = self.nccl
        self.comm.allReduce(array.data.ptr, array.data.ptr, array.size,
                            dtype_code(n, array.dtype), n.NCCL_SUM, stream.ptr)

    def bcast(self, array, root, stream):
        self.comm.bcast(array.data.ptr, array.size, dtype_code(self.nccl, array.dtype), root,
                        stream.ptr)

    def abort_in_thread(self, start_thread):
        """ncclCommAbort, through ``start_thread(fn, args)`` (the caller makes and keeps the
        thread): pending kernels of the communicator end; NCCL then waits until every CUDA
        graph holding its collectives is destroyed, so the call must not hold the GIL.
        Without the library's handle, CuPy's own abort runs here.  CuPy's object is kept
        for ever: it must never destroy the communicator after an abort."""
        _kept.append(self.comm)
        lib = library()
        if lib is None:            # pragma: no cover - NCCL loaded through CuPy only
            try:
                self.comm.abort()
            except Exception:
                pass
            return None
        return start_thread(lib.ncclCommAbort, (ctypes.c_void_p(self.comm.comm),))


_kept = []


@functools.lru_cache(maxsize=None)
def library():
    """The libnccl this process loaded (through CuPy), called by ctypes (no GIL held)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libnccl" in line and "/" in line}
        for path in sorted(paths):
            lib = ctypes.CDLL(path)
            if hasattr(lib, "ncclCommAbort"):
                lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
                lib.ncclCommAbort.restype = ctypes.c_int
                return lib
    except OSError:
        pass
    return None
