"""Page-locked host memory: the one host allocator of the GPU runtime.

``HostMemory(nbytes, mapped=False)``: one ``cudaHostAlloc`` (portable to every device); with
``mapped=True`` it is also mapped into the device's address space, so kernels read and write
it through the host pointer (unified virtual addressing).  ``array`` is the allocation as
bytes and ``view(offset, count, dtype)`` a typed window of it; every numpy view's base
holds the allocation, so no view outlives the memory.  Freed when the last reference goes.

``HostRing(n, dtype)``: a mapped, zero-filled array of ``n`` values (``host``) with its
device-visible ``ptr``: the GPU step's rings (learning rates in, losses and norms out).
The offload engine parks feature maps in slots of one unmapped ``HostMemory``.
"""
import numpy as np

from ..core import backend


class HostMemory:
    """One page-locked host allocation (see the module docstring)."""

    def __init__(self, nbytes, mapped=False):
        rt = backend.cp.cuda.runtime
        self.nbytes = max(1, int(nbytes))
        flags = rt.hostAllocPortable | (rt.hostAllocMapped if mapped else 0)
        self.ptr = rt.hostAlloc(self.nbytes, flags)
        self._free = rt.freeHost
        self.array = np.asarray(_Buffer(self))

    def view(self, offset, count, dtype):
        dtype = np.dtype(dtype)
        return self.array[offset:offset + count * dtype.itemsize].view(dtype)

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                self._free(ptr)
            except Exception:
                pass


class _Buffer:
    """The allocation as a numpy buffer whose base references the HostMemory."""

    def __init__(self, mem):
        self.mem = mem
        self.__array_interface__ = {"data": (mem.ptr, False), "shape": (mem.nbytes,),
                                    "typestr": "|u1", "version": 3}


class HostRing(HostMemory):
    """``n`` zero-filled values of ``dtype`` in mapped host memory: ``host`` (numpy) on the
    host side, ``ptr`` for kernels."""

    def __init__(self, n, dtype):
        self.dtype = np.dtype(dtype)
        n = max(1, int(n))
        super().__init__(n * self.dtype.itemsize, mapped=True)
        self.host = self.view(0, n, self.dtype)
        self.host[...] = 0
