"""Every 2-byte weight copy of a training step in one launch (issue 20: small nets).

A layer with a 2-byte body (bf16/fp16, engine/precision.py) reads its weights in that type:
the channels-last convolution a K, R, S, C copy of the fp32 K, C, R, S master weights, the
InnerProduct a copy of the same shape.  Cast one launch per layer, LeNet's step spent six
launches on four layers' weights; on a net whose whole step is a few hundred microseconds
of short kernels the launches cost more than the bytes.  ``WeightCast`` casts them all in
one launch instead, at the start of the step (engine/step.py), into copies the layers read
(``Layer.weights_cast_by``): the same rounding as the per-layer casts (vec16's ``mc_st``:
bf16 to nearest even by bits, fp16 by the hardware's cvt.rn), hence the same bits.

An entry is (src, dst, (k, c, rs)): ``dst`` (k, rs, c) = ``src`` (k, c, rs) transposed
and rounded; a plain copy is rs = 1.  The kernel's blocks each take ``PER_BLOCK``
consecutive elements of one entry (a table built once, on the host): writes in runs of
consecutive addresses, reads gathered (the copies this is for are small).

``cast_numpy`` is the same cast on numpy arrays (the reference the kernel is tested
against, bit for bit but fp16's NaN words, numpy's and cvt.rn's: tests/test_wcast.py,
tests/test_wcast_gpu.py).
"""
import functools

import numpy as np

from ..core import backend
from ..core import precision as P
from ._backend import raw_kernel
from .vec16 import ST16

__all__ = ["WeightCast", "cast_numpy", "block_table", "PER_BLOCK"]

PER_BLOCK = 1024            # elements of one block (4 per thread of 256)
_THREADS = 256

_SRC = r"""
extern "C" __global__ void __launch_bounds__(256) mc_wcast(
    const long long* __restrict__ table, const int* __restrict__ blocks) {
  // table: per entry src, dst (addresses), k, c, rs; blocks: per block entry, first
  const int e = blocks[2 * blockIdx.x], o0 = blocks[2 * blockIdx.x + 1];
  const float* __restrict__ x = (const float*)table[5 * e];
  unsigned short* __restrict__ y = (unsigned short*)table[5 * e + 1];
  const int c = (int)table[5 * e + 3], rs = (int)table[5 * e + 4];
  const int n = (int)table[5 * e + 2] * c * rs, crs = c * rs;
  for (int i = threadIdx.x; i < PER_BLOCK; i += blockDim.x) {
    const int o = o0 + i;                 // dst's (kk, j, cc)
    if (o >= n) break;
    const int kk = o / crs, r = o - kk * crs, j = r / c, cc = r - j * c;
    y[o] = mc_st(x[kk * crs + cc * rs + j]);
  }
}
"""


@functools.lru_cache(maxsize=None)
def _fn(storage):
    src = "#define MC_BF16 %d\n#define PER_BLOCK %d\n" % (storage == P.BFLOAT16, PER_BLOCK)
    return raw_kernel(src + ST16 + _SRC, "mc_wcast", "float")


def _check(entries, storage):
    bt = P.buffer_dtype(storage)
    for src, dst, (k, c, rs) in entries:
        n = k * c * rs
        if src.dtype != np.float32 or dst.dtype != bt or src.size != n or dst.size != n \
                or not (src.flags.c_contiguous and dst.flags.c_contiguous):
            raise ValueError(f"wcast: entry of {src.shape} {src.dtype} -> {dst.shape} "
                             f"{dst.dtype} does not fit (k, c, rs) = {(k, c, rs)} in "
                             f"{np.dtype(bt)}")
        if n >= 2 ** 31:
            raise ValueError(f"wcast: an entry of {n} elements (32-bit indices)")


def block_table(sizes):
    """(entry, first element) of each block for entries of ``sizes`` elements."""
    rows = [(e, o) for e, n in enumerate(sizes) for o in range(0, n, PER_BLOCK)]
    return np.asarray(rows, dtype=np.int32).reshape(-1, 2)


def cast_numpy(entries, storage):
    """The cast on numpy arrays: each ``dst`` = ``src`` (k, c, rs) -> (k, rs, c), rounded."""
    _check(entries, storage)
    for src, dst, (k, c, rs) in entries:
        t = np.ascontiguousarray(src.reshape(k, c, rs).transpose(0, 2, 1))
        P.narrow(np, t, dst.reshape(k, rs, c), storage)


class WeightCast:
    """One launch that casts every entry (CuPy arrays whose addresses stay put: the
    table holds them)."""

    def __init__(self, entries, storage):
        cp = backend.gpu_module()
        _check(entries, storage)
        self.storage = storage
        self.entries = list(entries)
        self.nbytes = sum(d.nbytes for _, d, _ in self.entries)
        table = [[s.data.ptr, d.data.ptr, k, c, rs] for s, d, (k, c, rs) in self.entries]
        self.table = cp.asarray(np.asarray(table, dtype=np.int64).reshape(-1, 5))
        self.blocks = cp.asarray(block_table([d.size for _, d, _ in self.entries]))
        self.grid = len(self.blocks)

    def __call__(self):
        if self.grid:
            _fn(self.storage)((self.grid,), (_THREADS,), (self.table, self.blocks))
