"""One flat buffer for a set of blobs: the net's parameters, their diffs, the solver history.

``FlatBuffer(blobs)`` lays the blobs end to end, each starting at a multiple of
``ALIGN`` elements (1 KiB for float32: aligned loads for kernels and cuDNN, and
bucket boundaries for NCCL), copies their current values in, and makes each blob's
data (and diff) a :class:`~minicaffe.core.synced_memory.SyncedMemorySlice` of it.  Gaps
between blobs hold zeros, which every update rule maps to zero.

What it buys:
- the solver's update is one kernel over the whole buffer (``solvers/fused.py``);
- clearing all parameter diffs is one memset;
- multi-GPU reduces contiguous ranges of the diff buffer with no packing;
- the addresses never change, which a replayed CUDA graph needs.

A blob reshaped past its slice gets memory of its own again (Blob.reshape), which
:meth:`FlatBuffer.intact` detects so that the owner can lay the buffer out anew.
"""
import numpy as np

from .synced_memory import SyncedMemory, SyncedMemorySlice, HEAD_AT_GPU, SYNCED

ALIGN = 256


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


class FlatLayout:
    """Offsets of ``counts`` laid end to end at ``ALIGN``-element boundaries."""

    def __init__(self, counts):
        self.counts = [int(c) for c in counts]
        self.offsets = []
        off = 0
        for c in self.counts:
            self.offsets.append(off)
            off += _aligned(c)
        self.total = off

    def __len__(self):
        return len(self.counts)

    def chunk_table(self, chunk):
        """For each ``chunk``-element piece of the buffer, the index of the blob it belongs to
        (pieces in a gap get the previous blob's index; gaps hold zeros).  ``chunk`` must
        divide ALIGN so that no piece straddles two blobs."""
        if ALIGN % chunk:
            raise ValueError(f"chunk {chunk} must divide {ALIGN}")
        table = np.zeros(self.total // chunk, dtype=np.int32)
        for i, off in enumerate(self.offsets):
            table[off // chunk:] = i
        return table


class FlatBuffer:
    """Blobs' data (and diffs, if ``with_diff``) moved into one SyncedMemory each."""

    def __init__(self, blobs, with_diff=True, dtype=None):
        self.blobs = list(blobs)
        dtypes = {b.dtype for b in self.blobs}
        if dtype is None:
            if len(dtypes) > 1:
                raise ValueError(f"blobs of several dtypes ({sorted(map(str, dtypes))}) "
                                 "cannot share one flat buffer")
            dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
        self.dtype = np.dtype(dtype)
        self.layout = FlatLayout([b.count() for b in self.blobs])
        self.data = SyncedMemory(self.layout.total, self.dtype)
        self.diff = SyncedMemory(self.layout.total, self.dtype) if with_diff else None
        self._adopt("_data", self.data)
        if with_diff:
            self._adopt("_diff", self.diff)
        self._slices = [(b._data, b._diff) for b in self.blobs]

    @property
    def offsets(self):
        return self.layout.offsets

    @property
    def counts(self):
        return self.layout.counts

    @property
    def total(self):
        return self.layout.total

    def _adopt(self, attr, mem):
        """Copy each blob's current contents into ``mem`` (on the side that holds the newest
        copy when every blob agrees it is the GPU, else on the host) and point the blob at
        its slice."""
        olds = [getattr(b, attr) for b in self.blobs]
        on_gpu = bool(olds) and all(m.head in (HEAD_AT_GPU, SYNCED) for m in olds) and \
            any(m.head == HEAD_AT_GPU for m in olds)
        dst = mem.mutable_gpu_data() if on_gpu else mem.mutable_cpu_data()
        for b, old, off, n in zip(self.blobs, olds, self.layout.offsets, self.layout.counts):
            if n:
                src = old.gpu_data() if on_gpu else old.cpu_data()
                dst[off:off + n] = src[:n]
            setattr(b, attr, SyncedMemorySlice(mem, off, n))
            b._capacity = n
            b.drop_views()

    def intact(self):
        """True while every blob still uses its slice (no reshape or share detached one)."""
        return all(b._data is d and b._diff is g for b, (d, g) in zip(self.blobs, self._slices))

    def like(self, blobs):
        """Point ``blobs`` (same counts as this buffer's, e.g. the solver's history) at a new
        buffer of the same layout; returns it."""
        other = FlatBuffer.__new__(FlatBuffer)
        other.blobs = list(blobs)
        if [b.count() for b in other.blobs] != self.layout.counts:
            raise ValueError("blobs do not match the layout")
        other.dtype = self.dtype
        other.layout = self.layout
        other.data = SyncedMemory(self.layout.total, self.dtype)
        other.diff = None
        other._adopt("_data", other.data)
        other._slices = [(b._data, b._diff) for b in other.blobs]
        return other
