"""Blob: an N-D array of data and diff, each in a SyncedMemory (Caffe's blob).

Shapes are N-D; ``num``/``channels``/``height``/``width`` give Caffe's legacy 4-D
view.  ``reshape`` keeps the buffers when the new count fits the capacity, so
a blob's memory stays at a fixed address once allocated.

Layer code reaches the arrays through ``cpu_data()``/``mutable_gpu_diff()``...
(Caffe's names) or, for one body written for both numpy and cupy, through
``data_for(xp)``/``mutable_diff_for(xp)``.  ``.data``/``.diff`` are pycaffe's:
host numpy views that write through (the head moves to the CPU).
"""
import numpy as np

from . import backend
from .synced_memory import SyncedMemory, HEAD_AT_CPU, UNINITIALIZED

MAX_BLOB_AXES = 32


def _shape_tuple(shape):
    if hasattr(shape, "dim"):  # a BlobShape message
        return tuple(int(d) for d in shape.dim)
    if np.isscalar(shape):
        return (int(shape),)
    return tuple(int(d) for d in shape)


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _packed_field(number, payload):
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def blob_proto_bytes(shape, data, diff=None):
    """Serialized BlobProto, built directly: repeated packed floats from numpy are
    far faster this way than through protobuf's Python containers.
    Fields (caffe.proto): data=5, diff=6, shape=7 (BlobShape.dim=1),
    double_data=8, double_diff=9."""
    dims = b"".join(_varint(int(d)) for d in shape)
    out = [_packed_field(7, _packed_field(1, dims) if dims else b"")]
    double = np.asarray(data).dtype == np.float64
    dt, fdata, fdiff = ("<f8", 8, 9) if double else ("<f4", 5, 6)
    if np.asarray(data).size:
        out.append(_packed_field(fdata, np.ascontiguousarray(data, dtype=dt).tobytes()))
    if diff is not None and np.asarray(diff).size:
        out.append(_packed_field(fdiff, np.ascontiguousarray(diff, dtype=dt).tobytes()))
    return b"".join(out)


class _Count(int):
    """An int (the blob's element count, as pycaffe's ``blob.count``) that can also be
    called with (start, end) as Caffe's ``Blob::count``."""

    def __new__(cls, blob):
        obj = int.__new__(cls, blob._count)
        obj._blob = blob
        return obj

    def __call__(self, start=0, end=None):
        return self._blob._count_range(start, end)


class Blob:
    def __init__(self, shape=(), dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self._shape = ()
        self._count = 0
        self._capacity = 0
        self._data = None
        self._diff = None
        self._views = [None] * 4
        if shape is not None:
            self.reshape(shape)

    # -- shape -------------------------------------------------------------
    def reshape(self, *shape):
        shape = _shape_tuple(shape[0] if len(shape) == 1 and not np.isscalar(shape[0]) else shape)
        if len(shape) > MAX_BLOB_AXES:
            raise ValueError(f"blob shape {shape} has more than {MAX_BLOB_AXES} axes")
        count = 1
        for d in shape:
            if d < 0:
                raise ValueError(f"blob shape {shape} has a negative dimension")
            count *= d
        self._shape = shape
        self._count = count
        if count > self._capacity or self._data is None:
            self._capacity = max(count, self._capacity)
            self._data = SyncedMemory(self._capacity, self.dtype)
            self._diff = SyncedMemory(self._capacity, self.dtype)

    def reshape_like(self, other):
        self.reshape(other.shape)

    @property
    def shape(self):
        return self._shape

    def shape_string(self):
        return " ".join(str(d) for d in self._shape) + f" ({self._count})"

    @property
    def num_axes(self):
        return len(self._shape)

    @property
    def count(self):
        """Caffe's ``count(start=0, end=None)`` method and pycaffe's ``count`` number, both:
        ``blob.count == blob.count()`` and ``blob.count(1)`` counts from axis 1."""
        return _Count(self)

    def _count_range(self, start=0, end=None):
        if end is None:
            end = len(self._shape)
        if start == 0 and end == len(self._shape):
            return self._count
        n = 1
        for d in self._shape[start:end]:
            n *= d
        return n

    def canonical_axis_index(self, axis):
        n = len(self._shape)
        if not -n <= axis < max(n, 1):
            raise IndexError(f"axis {axis} out of range for a {n}-D blob of shape {self._shape}")
        return axis + n if axis < 0 else axis

    def shape_at(self, axis):
        return self._shape[self.canonical_axis_index(axis)]

    def legacy_shape(self, index):
        if len(self._shape) > 4:
            raise ValueError("legacy accessors need a blob of at most 4 axes")
        if index >= len(self._shape) or index < -len(self._shape):
            return 1
        return self.shape_at(index)

    num = property(lambda self: self.legacy_shape(0))
    channels = property(lambda self: self.legacy_shape(1))
    height = property(lambda self: self.legacy_shape(2))
    width = property(lambda self: self.legacy_shape(3))

    def offset(self, *indices):
        off = 0
        for i, d in enumerate(self._shape):
            off = off * d + (indices[i] if i < len(indices) else 0)
        return off

    @property
    def capacity(self):
        return self._capacity

    # -- array access --------------------------------------------------------
    # Shaped views of the flat buffers are cached per slot (data/diff x cpu/gpu): layers
    # ask for them about a hundred times per LeNet iteration, and a CuPy reshape costs
    # microseconds each time.  A view is reused while its buffer is the same object and
    # its shape is the blob's.  A cached view keeps its buffer alive: code that frees a
    # side (offload) calls drop_views().
    _CPU_DATA, _GPU_DATA, _CPU_DIFF, _GPU_DIFF = range(4)

    def _view(self, flat, slot):
        cached = self._views[slot]
        if cached is not None and cached[0] is flat and cached[1].shape == self._shape:
            return cached[1]
        v = flat[: self._count].reshape(self._shape)
        self._views[slot] = (flat, v)
        return v

    def drop_views(self):
        self._views = [None] * 4

    def cpu_data(self):
        return self._view(self._data.cpu_data(), self._CPU_DATA)

    def mutable_cpu_data(self):
        return self._view(self._data.mutable_cpu_data(), self._CPU_DATA)

    def gpu_data(self):
        return self._view(self._data.gpu_data(), self._GPU_DATA)

    def mutable_gpu_data(self):
        return self._view(self._data.mutable_gpu_data(), self._GPU_DATA)

    def cpu_diff(self):
        return self._view(self._diff.cpu_data(), self._CPU_DIFF)

    def mutable_cpu_diff(self):
        return self._view(self._diff.mutable_cpu_data(), self._CPU_DIFF)

    def gpu_diff(self):
        return self._view(self._diff.gpu_data(), self._GPU_DIFF)

    def mutable_gpu_diff(self):
        return self._view(self._diff.mutable_gpu_data(), self._GPU_DIFF)

    def data_for(self, xp):
        return self.cpu_data() if xp is np else self.gpu_data()

    def mutable_data_for(self, xp):
        return self.mutable_cpu_data() if xp is np else self.mutable_gpu_data()

    def diff_for(self, xp):
        return self.cpu_diff() if xp is np else self.gpu_diff()

    def mutable_diff_for(self, xp):
        return self.mutable_cpu_diff() if xp is np else self.mutable_gpu_diff()

    @property
    def data(self):
        """pycaffe's ``blob.data``: a host view that writes through."""
        return self.mutable_cpu_data()

    @data.setter
    def data(self, value):
        self.mutable_cpu_data()[...] = value

    @property
    def diff(self):
        return self.mutable_cpu_diff()

    @diff.setter
    def diff(self, value):
        self.mutable_cpu_diff()[...] = value

    @property
    def data_mem(self):
        return self._data

    @property
    def diff_mem(self):
        return self._diff

    # -- math (on whichever side holds the newest data, as Caffe does) -------
    def _side(self, mem):
        return np if mem.head in (HEAD_AT_CPU, UNINITIALIZED) else backend.gpu_module()

    def update(self):
        """data -= diff."""
        xp = self._side(self._data)
        self.mutable_data_for(xp)[...] -= self.diff_for(xp)

    def _asum(self, mem, getter):
        if self._count == 0:
            return 0.0
        xp = self._side(mem)
        return float(abs(getter(xp)).sum())

    def asum_data(self):
        return self._asum(self._data, self.data_for)

    def asum_diff(self):
        return self._asum(self._diff, self.diff_for)

    def sumsq_data(self):
        if self._count == 0:
            return 0.0
        a = self.data_for(self._side(self._data))
        return float((a * a).sum())

    def sumsq_diff(self):
        if self._count == 0:
            return 0.0
        a = self.diff_for(self._side(self._diff))
        return float((a * a).sum())

    def scale_data(self, factor):
        self.mutable_data_for(self._side(self._data))[...] *= factor

    def scale_diff(self, factor):
        self.mutable_diff_for(self._side(self._diff))[...] *= factor

    # -- sharing and copying ---------------------------------------------------
    def own_data(self):
        """Give the data memory of its own back to a blob whose data was pointed at
        another buffer (``set_cpu_data``/``set_gpu_data``); a no-op when it owns it."""
        m = self._data
        if isinstance(m, SyncedMemory) and (m.host_array is None or m.owns_cpu_data) and \
                (m.device_array is None or m.owns_gpu_data or m.planned):
            return
        self._data = SyncedMemory(self._capacity, self.dtype)
        self.drop_views()

    def share_data(self, other):
        if self._count != other._count:
            raise ValueError(f"share_data: counts differ ({self._count} vs {other._count})")
        self._data = other._data

    def share_diff(self, other):
        if self._count != other._count:
            raise ValueError(f"share_diff: counts differ ({self._count} vs {other._count})")
        self._diff = other._diff

    def copy_from(self, source, copy_diff=False, reshape=False):
        if source._count != self._count or source.shape != self.shape:
            if reshape:
                self.reshape_like(source)
            else:
                raise ValueError(f"copy_from: shapes differ ({source.shape} vs {self.shape})")
        from . import context
        xp = context.xp()
        if copy_diff:
            self.mutable_diff_for(xp)[...] = source.diff_for(xp)
        else:
            self.mutable_data_for(xp)[...] = source.data_for(xp)

    # -- protobuf ----------------------------------------------------------------
    def shape_equals(self, proto):
        if proto.HasField("num") or proto.HasField("channels") or \
                proto.HasField("height") or proto.HasField("width"):
            if len(self._shape) > 4:
                return False
            return (self.legacy_shape(-4) == proto.num and self.legacy_shape(-3) == proto.channels
                    and self.legacy_shape(-2) == proto.height and self.legacy_shape(-1) == proto.width)
        return self._shape == tuple(proto.shape.dim)

    @staticmethod
    def proto_shape(proto):
        """The shape a BlobProto describes (legacy 4-D fields or ``shape``)."""
        if proto.HasField("num") or proto.HasField("channels") or \
                proto.HasField("height") or proto.HasField("width"):
            return (proto.num, proto.channels, proto.height, proto.width)
        return tuple(proto.shape.dim)

    def from_proto(self, proto, reshape=True):
        shape = self.proto_shape(proto)
        if reshape:
            self.reshape(shape)
        elif not self.shape_equals(proto):
            raise ValueError(f"shape mismatch (reshape not set): blob {self._shape}, proto {shape}")
        n = self._count
        if len(proto.double_data) > 0:
            src = np.asarray(proto.double_data, dtype=np.float64)
        else:
            src = np.asarray(proto.data, dtype=np.float32)
        if src.size != n:
            raise ValueError(f"BlobProto holds {src.size} values for shape {shape} ({n})")
        self.mutable_cpu_data()[...] = src.reshape(self._shape)
        if len(proto.double_diff) > 0:
            self.mutable_cpu_diff()[...] = np.asarray(proto.double_diff).reshape(self._shape)
        elif len(proto.diff) > 0:
            self.mutable_cpu_diff()[...] = np.asarray(proto.diff, dtype=np.float32).reshape(self._shape)

    def to_proto(self, proto=None, write_diff=False):
        """A BlobProto with ``shape`` and float (or double) data, as Caffe writes it."""
        from ..proto import caffe_pb2
        if proto is None:
            proto = caffe_pb2.BlobProto()
        proto.Clear()
        proto.ParseFromString(blob_proto_bytes(self._shape, self.cpu_data(),
                                               self.cpu_diff() if write_diff else None))
        return proto

    def __repr__(self):
        return f"Blob{self._shape}"
