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

Real 16-bit storage (issue 20; engine/precision.py): a memory plan may bind the device
side to a buffer of 2-byte words (``bind_device(view, storage=BFLOAT16|FLOAT16)``): the
host side stays ``dtype`` (float32, what pycaffe reads), and the copies between the
sides convert (round to nearest even host->device, exact device->host).  ``storage``
names the type of the device array now (None: ``dtype``'s), ``reduced`` the planned one
(kept while the engine's cast ops point the device side at an fp32 scratch for a layer
without a reduced-type body: ``swap_device``).  ``layout`` (N, C, H, W) says that the
device side is held channels-last (N, H, W, C in memory, the engine's NHWC buffers): the
host side stays Caffe's NCHW, the copies between the sides transpose.
"""
import numpy as np

from . import backend, context

UNINITIALIZED = "UNINITIALIZED"
HEAD_AT_CPU = "HEAD_AT_CPU"
HEAD_AT_GPU = "HEAD_AT_GPU"
SYNCED = "SYNCED"


class SyncedMemory:
    __slots__ = ("size", "dtype", "_cpu", "_gpu", "_own_cpu", "_own_gpu", "head",
                 "_pinned", "device", "planned", "storage", "reduced", "layout", "shared")

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
        # the blob's name where a plan with share_data lets other buffers use this place
        # after its last reader (a host read then warns once); None otherwise
        self.shared = None
        self.storage = None    # the device array's type when not ``dtype`` (2-byte words)
        self.reduced = None    # the planned reduced storage (kept while swapped)
        self.layout = None     # (N, C, H, W): the device side is held channels-last

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
            if self.shared:
                from . import log
                log.warning("blob '%s': its data was read after a training step whose memory "
                            "plan shares it (share_data): it holds another buffer's values, "
                            "not the layer's output (--noshare_data or MINICAFFE_SHARE_DATA=0 "
                            "keeps every blob's data, as Caffe)", self.shared)
                self.shared = ""          # once
            if self._cpu is None:
                self._alloc_cpu()
            if self.storage is not None:
                self._widen_to_host()
            else:
                backend.copy_to_host(self._cpu, self._gpu)
            self.head = SYNCED

    def to_gpu(self):
        if self.head == UNINITIALIZED:
            self._alloc_gpu()
            self.head = HEAD_AT_GPU
        elif self.head == HEAD_AT_CPU:
            if self._gpu is None:
                self._alloc_gpu()
            if self.storage is not None:
                backend.copy_to_gpu(self._gpu, self._narrowed_host())
            else:
                backend.copy_to_gpu(self._gpu, self._cpu)
            self.head = SYNCED

    def _widen_to_host(self):
        from .precision import buffer_dtype, widen
        tmp = np.empty(self.size, dtype=buffer_dtype(self.storage))
        backend.copy_to_host(tmp, self._gpu[:self.size])
        if self.layout is not None:
            tmp = from_nhwc(tmp, self.layout)
        widen(np, tmp, self._cpu[:self.size], self.storage)

    def _narrowed_host(self):
        from .precision import buffer_dtype, narrow
        tmp = np.empty(self.size, dtype=buffer_dtype(self.storage))
        src = self._cpu[:self.size]
        if self.layout is not None:
            src = to_nhwc(src, self.layout)
        return narrow(np, src, tmp, self.storage)

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
        self.storage = self.reduced = self.layout = None
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
        src = self._narrowed_host() if self.storage is not None else self._cpu
        backend.copy_to_gpu(self._gpu, src, stream=stream)
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
        self.storage = self.reduced = self.layout = None

    # -- the engine's transitions (memory plan, offload, graphs) --------------------------
    def bind_device(self, view, keep_contents=True, storage=None, layout=None):
        """Make ``view`` (a device array of at least ``size`` elements: a place in a memory
        plan's arena, not owned) the device side; ``keep_contents``: the newest contents
        (host or device) are copied there first.  Ends HEAD_AT_GPU and ``planned``.
        ``storage`` (FLOAT16, BFLOAT16): ``view`` holds that type's 2-byte words (see the
        module docstring); the contents are rounded into it.  ``layout`` (N, C, H, W), with
        a ``storage``: ``view`` holds them channels-last."""
        from .precision import FLOAT, narrow, widen
        storage = None if storage == FLOAT else storage
        layout = tuple(layout) if layout is not None and storage is not None else None
        if keep_contents:
            if self.head == HEAD_AT_CPU:
                if storage is None:
                    backend.copy_to_gpu(view, self._cpu[:self.size])
                else:
                    tmp = np.empty(self.size, dtype=view.dtype)
                    src = self._cpu[:self.size]
                    if layout is not None:
                        src = to_nhwc(src, layout)
                    backend.copy_to_gpu(view, narrow(np, src, tmp, storage))
            elif self.head in (HEAD_AT_GPU, SYNCED) and self._gpu is not None and \
                    (layout is not None or self.layout is not None) and \
                    (layout != self.layout or storage != self.storage):
                xp = backend.gpu_module()       # through fp32 NCHW: a change of layout
                old = self._gpu[:self.size]
                if self.layout is not None:
                    old = from_nhwc(old, self.layout)
                if self.storage is not None:
                    old = widen(xp, old, xp.empty(self.size, np.float32), self.storage)
                if layout is not None:
                    old = to_nhwc(old, layout)
                if storage is None:
                    view[:self.size] = old
                else:
                    narrow(xp, old, view[:self.size], storage)
            elif self.head in (HEAD_AT_GPU, SYNCED) and self._gpu is not None:
                old = self._gpu[:self.size]
                if storage == self.storage:
                    view[...] = old
                elif storage is None:
                    widen(backend.gpu_module(), old, view[:self.size], self.storage)
                else:
                    if self.storage is not None:
                        old = widen(backend.gpu_module(), old,
                                    backend.gpu_module().empty(self.size, np.float32),
                                    self.storage)
                    narrow(backend.gpu_module(), old, view[:self.size], storage)
        if storage is None:
            self.set_gpu_data(view)
        else:
            if view.ndim != 1:
                view = view.reshape(-1)
            self._gpu, self._own_gpu = view, False
            self.head = HEAD_AT_GPU
            self.storage = self.reduced = storage
            self.layout = layout
        self.planned = True

    def swap_device(self, array, layout=None):
        """Point the device side at ``array`` (float32, or 2-byte words of the planned
        type; channels-last when ``layout`` (N, C, H, W) is given) for the span of one
        layer's step, and return the array it had: the engine's cast ops
        (engine/precision.StorageCasts) around a layer that has no body for the planned
        type or layout.  The head and ``planned`` are left as they are."""
        from .precision import FLOAT, storage_of
        old = self._gpu
        self._gpu = array
        s = storage_of(array)
        self.storage = None if s == FLOAT else s
        self.layout = tuple(layout) if layout is not None else None
        return old

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
        self.storage = self.reduced = self.layout = None
        self.shared = None

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


def to_nhwc(a, shape):
    """The flat NCHW array ``a`` of ``shape`` (N, C, H, W) as a flat channels-last one
    (numpy or CuPy; a new contiguous array)."""
    n, c, h, w = shape
    xp = np if isinstance(a, np.ndarray) else backend.gpu_module()
    return xp.ascontiguousarray(a.reshape(n, c, h, w).transpose(0, 2, 3, 1)).reshape(-1)


def from_nhwc(a, shape):
    """The flat channels-last array ``a`` of ``shape`` (N, C, H, W) as a flat NCHW one."""
    n, c, h, w = shape
    xp = np if isinstance(a, np.ndarray) else backend.gpu_module()
    return xp.ascontiguousarray(a.reshape(n, h, w, c).transpose(0, 3, 1, 2)).reshape(-1)
