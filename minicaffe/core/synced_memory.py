"""SyncedMemory: one buffer with a host side and a device side (Caffe's syncedmem).

The four-state automaton:

    UNINITIALIZED --to_cpu--> HEAD_AT_CPU     UNINITIALIZED --to_gpu--> HEAD_AT_GPU
    HEAD_AT_CPU   --to_gpu--> SYNCED (copy)   HEAD_AT_GPU   --to_cpu--> SYNCED (copy)
    SYNCED        --to_*-->   SYNCED (no-op)
    mutable_cpu_data -> HEAD_AT_CPU           mutable_gpu_data -> HEAD_AT_GPU

A side is allocated zero-filled on first touch.  ``set_cpu_data``/``set_gpu_data``
share memory the object does not own (and so never frees).  ``async_gpu_data``
copies on a given stream from HEAD_AT_CPU and ends SYNCED.  ``release_gpu``
drops the device side once the host holds the newest copy (for offload).

The engine's transitions (a memory plan's arena, offload, CUDA graphs), the only ways
code outside this module changes the state: ``bind_device(view)`` (the device side
becomes a place in an arena: ``planned``), ``unbind_device(keep)`` (back out of it),
``park(host)`` (a host slot becomes the newest side, no device side), ``drop_host()``
(forget an adopted host side), ``device_written()`` (a replayed graph wrote the device
side).
"""
import numpy as np

from . import backend, context

UNINITIALIZED = "UNINITIALIZED"
HEAD_AT_CPU = "HEAD_AT_CPU"
HEAD_AT_GPU = "HEAD_AT_GPU"
SYNCED = "SYNCED"


class SyncedMemory:
    __slots__ = ("size", "dtype", "_cpu", "_gpu", "_own_cpu", "_own_gpu", "head",
                 "_pinned", "device", "planned")

    def __init__(self, size=0, dtype=np.float32):
        self.size = int(size)
        self.dtype = np.dtype(dtype)
        self._cpu = None
        self._gpu = None
        self._own_cpu = False
        self._own_gpu = False
        self._pinned = False
        self.head = UNINITIALIZED
        self.device = None
        self.planned = False   # the device side is a place in a memory plan's arena

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize

    # -- read-only views of the state (never move the head, never allocate) ----------
    @property
    def pinned(self):
        """True when the host side is page-locked (allocated in GPU mode), so host<->device
        copies of it are truly asynchronous."""
        return self._pinned

    @property
    def owns_cpu_data(self):
        """False when the host side was adopted through ``set_cpu_data`` (never freed here)."""
        return self._own_cpu

    @property
    def owns_gpu_data(self):
        """False when the device side was adopted through ``set_gpu_data``."""
        return self._own_gpu

    @property
    def host_array(self):
        """The host side as it is now, or None (never allocated): inspects, never moves."""
        return self._cpu

    @property
    def device_array(self):
        """The device side as it is now, or None when there is none (never allocated, or
        released by ``release_gpu``).  Unlike ``gpu_data`` it neither copies nor moves the
        head: what a memory plan or an offload engine inspects."""
        return self._gpu

    # -- moving the head -------------------------------------------------
    def _alloc_cpu(self):
        pinned = context.is_gpu()
        self._cpu = backend.alloc_host(self.size, self.dtype, pinned=pinned)
        self._pinned = pinned
        self._own_cpu = True

    def _alloc_gpu(self):
        self._check_device()
        self._gpu = backend.alloc_gpu(self.size, self.dtype)
        self._own_gpu = True

    def _check_device(self):
        if not backend.cupy_available():
            backend.check_device(0)
        if self.device is None:
            self.device = backend.current_device()

    def to_cpu(self):
        if self.head == UNINITIALIZED:
            self._alloc_cpu()
            self.head = HEAD_AT_CPU
        elif self.head == HEAD_AT_GPU:
            if self._cpu is None:
                self._alloc_cpu()
            backend.copy_to_host(self._cpu, self._gpu)
            self.head = SYNCED

    def to_gpu(self):
        if self.head == UNINITIALIZED:
            self._alloc_gpu()
            self.head = HEAD_AT_GPU
        elif self.head == HEAD_AT_CPU:
            if self._gpu is None:
                self._alloc_gpu()
            backend.copy_to_gpu(self._gpu, self._cpu)
            self.head = SYNCED

    # -- access ------------------------------------------------------------
    def cpu_data(self):
        self.to_cpu()
        return self._cpu

    def mutable_cpu_data(self):
        self.to_cpu()
        self.head = HEAD_AT_CPU
        return self._cpu

    def gpu_data(self):
        self.to_gpu()
        return self._gpu

    def mutable_gpu_data(self):
        self.to_gpu()
        self.head = HEAD_AT_GPU
        return self._gpu

    def set_cpu_data(self, array):
        """Use ``array`` (not owned, never freed here) as the host side."""
        array = self._check_shared(array, np)
        self._cpu = array
        self._own_cpu = False
        self.head = HEAD_AT_CPU

    def set_gpu_data(self, array):
        """Use device ``array`` (not owned, never freed here) as the device side."""
        array = self._check_shared(array, backend.gpu_module())
        self._gpu = array
        self._own_gpu = False
        self.planned = False
        self.head = HEAD_AT_GPU

    def _check_shared(self, array, xp):
        if array.dtype != self.dtype or array.size < self.size:
            raise ValueError(f"shared buffer of {array.size} x {array.dtype} cannot back "
                             f"{self.size} x {self.dtype}")
        if array.ndim != 1:
            array = array.reshape(-1)
        return array

    def async_gpu_data(self, stream):
        """Copy host->device on ``stream`` (requires HEAD_AT_CPU); ends SYNCED."""
        if self.head != HEAD_AT_CPU:
            raise RuntimeError(f"async_gpu_data needs HEAD_AT_CPU, head is {self.head}")
        if self._gpu is None:
            self._alloc_gpu()
        backend.copy_to_gpu(self._gpu, self._cpu, stream=stream)
        self.head = SYNCED
        return self._gpu

    def release_gpu(self):
        """Free the device side once the host side is current (for offload)."""
        if self.head == HEAD_AT_GPU:
            raise RuntimeError("release_gpu would lose data: the head is at the GPU")
        if self.head == SYNCED:
            self.head = HEAD_AT_CPU
        self._gpu = None
        self._own_gpu = False

    # -- the engine's transitions (memory plan, offload, graphs) --------------------------
    def bind_device(self, view, keep_contents=True):
        """Make ``view`` (a device array of at least ``size`` elements: a place in a memory
        plan's arena, not owned) the device side; ``keep_contents``: the newest contents
        (host or device) are copied there first.  Ends HEAD_AT_GPU and ``planned``."""
        if keep_contents:
            if self.head == HEAD_AT_CPU:
                backend.copy_to_gpu(view, self._cpu[:self.size])
            elif self.head in (HEAD_AT_GPU, SYNCED) and self._gpu is not None:
                view[...] = self._gpu[:self.size]
        self.set_gpu_data(view)
        self.planned = True

    def unbind_device(self, keep):
        """Leave the arena place ``bind_device`` gave (a no-op when none): ``keep`` brings
        device-only contents to the host first (ends HEAD_AT_CPU, the host copy newest);
        otherwise device-only contents are transient and dropped (ends UNINITIALIZED)."""
        if self._gpu is None or not self.planned:
            return
        if self.head == HEAD_AT_GPU and keep:
            self.to_cpu()                # SYNCED now
        if self.head == SYNCED:
            self.release_gpu()           # HEAD_AT_CPU: the host copy is the newest
        else:
            self._gpu, self._own_gpu = None, False
            if self.head == HEAD_AT_GPU:
                self.head = UNINITIALIZED
        self.planned = False

    def park(self, host):
        """Make host array ``host`` (not owned: an offload slot holding the newest
        contents) the host side and drop the device side: HEAD_AT_CPU, not planned."""
        if self._gpu is None and self._cpu is host:
            return
        self.set_cpu_data(host)
        self.release_gpu()
        self.planned = False

    def drop_host(self):
        """Forget a host side this memory does not own (it points into a buffer about to
        be freed); an owned one stays."""
        if not self._own_cpu:
            self._cpu = None

    def device_written(self):
        """The device side was written behind this object's back (a replayed CUDA graph
        ran the kernels that write it): the head moves to the GPU."""
        self.head = HEAD_AT_GPU

    def __repr__(self):
        return f"SyncedMemory({self.size}, {self.dtype}, {self.head})"


class SyncedMemorySlice:
    """A window [offset, offset + size) of a parent SyncedMemory, sharing its automaton.

    The parameters of a net live in one flat buffer (``flat_params.FlatBuffer``) so that
    the solver updates them in one kernel and multi-GPU reduces them in contiguous
    buckets; each parameter Blob keeps its own shape through a slice.  The head is the
    parent's: touching one slice on the host brings the whole buffer there, exactly as
    Caffe's automaton would for one big blob, so no slice can ever disagree with the
    buffer it belongs to.
    """
    __slots__ = ("parent", "offset", "size", "_views")

    def __init__(self, parent, offset, size):
        if offset < 0 or offset + size > parent.size:
            raise ValueError(f"slice [{offset}, {offset + size}) outside a buffer of {parent.size}")
        self.parent = parent
        self.offset = int(offset)
        self.size = int(size)
        self._views = [None, None]  # (parent array, slice) for the host and device sides

    dtype = property(lambda self: self.parent.dtype)
    nbytes = property(lambda self: self.size * self.parent.dtype.itemsize)
    head = property(lambda self: self.parent.head)
    device = property(lambda self: self.parent.device)

    def _slice(self, arr, side):
        cached = self._views[side]
        if cached is not None and cached[0] is arr:
            return cached[1]
        v = arr[self.offset: self.offset + self.size]
        self._views[side] = (arr, v)
        return v

    def to_cpu(self):
        self.parent.to_cpu()

    def to_gpu(self):
        self.parent.to_gpu()

    def cpu_data(self):
        return self._slice(self.parent.cpu_data(), 0)

    def mutable_cpu_data(self):
        return self._slice(self.parent.mutable_cpu_data(), 0)

    def gpu_data(self):
        return self._slice(self.parent.gpu_data(), 1)

    def mutable_gpu_data(self):
        return self._slice(self.parent.mutable_gpu_data(), 1)

    def set_cpu_data(self, array):
        raise RuntimeError("a slice of a flat buffer cannot adopt another array; "
                           "reshape the blob to detach it first")

    set_gpu_data = set_cpu_data

    def __repr__(self):
        return f"SyncedMemorySlice({self.offset}:{self.offset + self.size} of {self.parent!r})"
