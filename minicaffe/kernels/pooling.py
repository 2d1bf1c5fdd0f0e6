"""Caffe pooling (MAX, AVE, STOCHASTIC) forward/backward, numpy and CuPy.

All arrays are NCHW.  ``kernel``, ``stride`` and ``pad`` are ints or
``(h, w)`` pairs.  Semantics follow Caffe's ``pooling_layer.cpp/.cu``:

Output size (CEIL rounding, then the padding correction)::

    PH = ceil((H + 2*pad_h - kernel_h) / stride_h) + 1
    if pad_h > 0 and (PH - 1) * stride_h >= H + pad_h: PH -= 1     (same for W)

Window of output ``(ph, pw)``: ``hstart = ph*stride_h - pad_h``.

* MAX: ``hend = min(hstart + kernel_h, H)``, ``hstart = max(hstart, 0)``;
  scanned ``h`` then ``w`` ascending, a value replaces the running maximum
  (initialised to ``-FLT_MAX``) only if it is STRICTLY greater, so ties go to
  the first maximum and NaNs are never selected.  ``mask`` (int32, same shape
  as ``y``) holds the argmax's flat index ``h*W + w`` inside its ``(n, c)``
  plane (``-1`` for a window with no value above ``-FLT_MAX``).  A Caffe
  ``top_mask`` is ``mask.astype(y.dtype)``.
* AVE: ``hend = min(hstart + kernel_h, H + pad_h)``;
  ``pool_size = (hend - hstart) * (wend - wstart)`` is taken BEFORE clipping
  to the image; the window is then clipped to ``[0, H) x [0, W)`` and
  ``y = sum(x in window) / pool_size`` (padding counts in the divisor only
  up to ``H + pad``, unlike torch's ``count_include_pad`` with ``ceil_mode``).
* STOCHASTIC (pad must be 0): window ``[ph*stride, min(ph*stride + k, H))``.
  Train: ``thres = u * sum(window)`` with ``u`` from ``rand_uniform`` (shape of
  ``y``, values in ``[0, 1]``); the first element (row-major) whose running
  sum is ``>= thres`` is selected: ``y`` = its value, ``idx`` = its flat index
  ``h*W + w`` in the plane (int32; Caffe stores the global index as float in
  ``rand_idx_`` -- we keep the plane index, like ``mask``).  If no element
  qualifies (only possible with negative inputs) the last window element is
  taken; an empty window gives ``y = 0, idx = -1``.  Test:
  ``y = sum(x^2) / (FLT_MIN + sum(x))`` (Caffe's ``cumsum`` starts at
  ``FLT_MIN``).  Caffe computes ``thres`` in float also for double; here it is
  computed in the array's dtype.

Global pooling is ``kernel = (H, W)``, ``stride = 1``, ``pad = 0``.

Backward functions return ``dx`` of shape ``x_shape``; MAX/AVE forward and
every backward take an optional ``out=`` array that receives the result.
The numpy bodies are vectorised over N and C and loop only over the kernel
window offsets.  MAX/AVE use "phase planes" (below) when the geometry allows:
each window offset is then one contiguous 1-D operation; MAX finds its first
maximum with integer ranks instead of masked copies, and MAX/STOCHASTIC
backward is ``np.add.at`` in the array's dtype, in output order, i.e. Caffe's
CPU summation order.  Everything else (``FAST_PATH = False``, global pooling
and other geometries where the planes would waste work) runs the general
path on strided views, with the same results (the general MAX/STOCHASTIC
backward sums in float64: equal up to float rounding).  With a CPU kernel pool
(core/threads.py: ``--threads N``, N > 1) MAX/AVE forward and backward split calls of at
least ``PARALLEL_MIN_WORK`` into contiguous batch ranges run in the pool's threads: each
image's output depends on that image alone, so the bits are the serial path's.
The CuPy bodies are RawKernels mirroring Caffe's (one thread per output element
forward, one thread per input element backward: deterministic gathers, no
atomics, unless the window geometry is not given to max/stochastic backward,
when a scatter-add is used).
"""
from __future__ import annotations

import math
import threading

import numpy as np

from ._backend import (FLT_MAX, FLT_MIN, _cupy, as_pair, cuda_type,
                       is_cupy_array, launch, raw_kernel)

__all__ = [
    "pool_output_shape", "max_pool_forward", "max_pool_backward",
    "ave_pool_forward", "ave_pool_backward", "stochastic_pool_forward_train",
    "stochastic_pool_forward_test", "stochastic_pool_backward",
]


# --------------------------------------------------------------------------
# geometry
# --------------------------------------------------------------------------
def _pooled(size, k, s, p):
    out = int(math.ceil(float(size + 2 * p - k) / s)) + 1
    if p > 0 and (out - 1) * s >= size + p:
        out -= 1
    return out


def pool_output_shape(H, W, kernel, stride=1, pad=0):
    """``(PH, PW)`` with Caffe's CEIL rounding and padding correction."""
    kh, kw = as_pair(kernel, "kernel")
    sh, sw = as_pair(stride, "stride")
    ph, pw = as_pair(pad, "pad")
    return _pooled(H, kh, sh, ph), _pooled(W, kw, sw, pw)


def _geom(x_shape, kernel, stride, pad):
    if len(x_shape) != 4:
        raise ValueError(f"pooling expects (N, C, H, W), got shape {tuple(x_shape)}")
    N, C, H, W = (int(v) for v in x_shape)
    kh, kw = as_pair(kernel, "kernel")
    sh, sw = as_pair(stride, "stride")
    ph, pw = as_pair(pad, "pad")
    if min(kh, kw, sh, sw) < 1 or min(ph, pw) < 0:
        raise ValueError("kernel/stride must be >= 1 and pad >= 0")
    PH, PW = _pooled(H, kh, sh, ph), _pooled(W, kw, sw, pw)
    if PH <= 0 or PW <= 0:
        raise ValueError(f"empty pooling output ({PH}, {PW}) for input {tuple(x_shape)}")
    return N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW


def uses_phase_planes(x_shape, kernel, stride=1, pad=0):
    """True when MAX/AVE pooling of ``x_shape`` takes the fast path (windows read as
    strided phase planes) rather than the per-offset loop: ``FAST_PATH`` is on and the
    planes waste at most ``FAST_MAX_WASTE`` times the output's size."""
    return _Phase(*_geom(x_shape, kernel, stride, pad)).ok()


def _padded(x, H, W, kh, kw, sh, sw, ph, pw, PH, PW, fill):
    """x embedded at offset (ph, pw) in an array covering every window (x itself
    when no window reaches past the image)."""
    N, C = x.shape[:2]
    if ph == pw == 0 and (PH - 1) * sh + kh <= H and (PW - 1) * sw + kw <= W:
        return x
    Hp = max(ph + H, (PH - 1) * sh + kh)
    Wp = max(pw + W, (PW - 1) * sw + kw)
    if fill == 0:
        xp = np.zeros((N, C, Hp, Wp), dtype=x.dtype)
    else:
        xp = np.full((N, C, Hp, Wp), fill, dtype=x.dtype)
    xp[:, :, ph:ph + H, pw:pw + W] = x
    return xp


def _win(i, j, sh, sw, PH, PW):
    return (slice(None), slice(None),
            slice(i, i + sh * (PH - 1) + 1, sh), slice(j, j + sw * (PW - 1) + 1, sw))


def _ave_pool_size(H, W, kh, kw, sh, sw, ph, pw, PH, PW):
    hs = np.arange(PH) * sh - ph
    ws = np.arange(PW) * sw - pw
    he = np.minimum(hs + kh, H + ph)
    we = np.minimum(ws + kw, W + pw)
    return (he - hs)[:, None] * (we - ws)[None, :]          # (PH, PW) int


def _dtype_const(v, dtype):
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=np.float64).astype(dtype)[()]


def _i32(*vals):
    return tuple(np.int32(v) for v in vals)


# --------------------------------------------------------------------------
# numpy fast path: flat phase planes
# --------------------------------------------------------------------------
# The padded input is split once into sh*sw phase planes (rows a::sh, columns
# b::sw), each stored flat over (N, C, Hq, Wq).  The window offset (i, j) of
# every output then lies in plane (i % sh, j % sw) at a constant flat shift
# (i // sh) * Wq + j // sw from the output's own position (hq, wq), so every
# per-offset step is ONE contiguous 1-D operation over N*C*Hq*Wq elements
# instead of a doubly-strided 4-D one.  Outputs are computed on the extended
# grid (Hq, Wq) >= (PH, PW); the extra rows/columns are discarded (forward)
# or held at zero (backward).  Only used when that extension wastes little.
FAST_PATH = True          # tests switch it off to compare with the general path
FAST_MAX_WASTE = 1.6      # use the fast path when Hq*Wq <= this * PH*PW


# Per-thread scratch arrays reused across calls (a fresh array of this size
# costs its page faults on every call): never returned to the caller.
SCRATCH_BYTES = 256 << 20
_SCRATCH = threading.local()


def _scratch(key, shape, dtype, fill=None):
    """A reusable per-thread array for ``key``; ``fill`` is applied when the
    array is made (callers that need it filled every call fill it themselves)."""
    cache = getattr(_SCRATCH, "arrays", None)
    if cache is None:
        cache = _SCRATCH.arrays = {}
    k = (key, tuple(shape), np.dtype(dtype).str)
    a = cache.pop(k, None)
    if a is None:
        a = (np.empty(shape, dtype) if fill is None else np.full(shape, fill, dtype))
        if a.nbytes > SCRATCH_BYTES:
            return a
        while cache and sum(v.nbytes for v in cache.values()) + a.nbytes > SCRATCH_BYTES:
            del cache[next(iter(cache))]          # the least recently used
    cache[k] = a
    return a


class _Phase:
    __slots__ = ("N", "C", "H", "W", "kh", "kw", "sh", "sw", "ph", "pw", "PH", "PW",
                 "Hq", "Wq", "L", "extra")

    def __init__(self, N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW):
        self.N, self.C, self.H, self.W = N, C, H, W
        self.kh, self.kw, self.sh, self.sw, self.ph, self.pw = kh, kw, sh, sw, ph, pw
        self.PH, self.PW = PH, PW
        Hp = max(ph + H, (PH - 1) * sh + kh)
        Wp = max(pw + W, (PW - 1) * sw + kw)
        self.Hq, self.Wq = -(-Hp // sh), -(-Wp // sw)
        self.L = N * C * self.Hq * self.Wq
        self.extra = ((kh - 1) // sh) * self.Wq + (kw - 1) // sw

    def ok(self):
        return FAST_PATH and self.Hq * self.Wq <= FAST_MAX_WASTE * self.PH * self.PW

    def offsets(self, reverse=False):
        """(i, j, a, b, shift) for every window offset, row-major (or reversed)."""
        out = [(i, j, i % self.sh, j % self.sw, (i // self.sh) * self.Wq + j // self.sw)
               for i in range(self.kh) for j in range(self.kw)]
        return out[::-1] if reverse else out

    def _blocks(self):
        """(a, b, image rows slice, image cols slice, hq0, wq0) per phase plane."""
        for a in range(self.sh):
            h0 = (a - self.ph) % self.sh
            if h0 >= self.H:
                continue
            hq0 = (h0 + self.ph) // self.sh
            for b in range(self.sw):
                w0 = (b - self.pw) % self.sw
                if w0 >= self.W:
                    continue
                wq0 = (w0 + self.pw) // self.sw
                yield a, b, slice(h0, None, self.sh), slice(w0, None, self.sw), hq0, wq0

    def grid(self, flat):
        return flat[:self.L].reshape(self.N, self.C, self.Hq, self.Wq)

    def geometry(self):
        return (self.N, self.C, self.H, self.W, self.kh, self.kw, self.sh, self.sw,
                self.ph, self.pw)

    def split(self, x, fill):
        """Phase planes of x padded with ``fill``: array (sh, sw, L + extra).  A
        scratch array: its non-image positions keep the fill between calls."""
        buf = _scratch(("split", float(fill)) + self.geometry(),
                       (self.sh, self.sw, self.L + self.extra), x.dtype, fill)
        for a, b, rs, cs, hq0, wq0 in self._blocks():
            src = x[:, :, rs, cs]
            self.grid(buf[a, b])[:, :, hq0:hq0 + src.shape[2], wq0:wq0 + src.shape[3]] = src
        return buf

    def merge(self, buf, dtype, out=None):
        """The image part of phase planes ``buf`` as (N, C, H, W) (into ``out``)."""
        dx = np.empty((self.N, self.C, self.H, self.W), dtype=dtype) if out is None else out
        for a, b, rs, cs, hq0, wq0 in self._blocks():
            dst = dx[:, :, rs, cs]
            dst[...] = self.grid(buf[a, b])[:, :, hq0:hq0 + dst.shape[2],
                                            wq0:wq0 + dst.shape[3]]
        return dx

    def extend(self, a):
        """(N, C, PH, PW) ``a`` placed on the (Hq, Wq) grid, flat; the rest 0
        (a scratch array: the extra rows and columns stay 0 between calls)."""
        ext = _scratch(("extend",) + self.geometry(), (self.L,), a.dtype, 0)
        self.grid(ext)[:, :, :self.PH, :self.PW] = a
        return ext

    def crop(self, ext, out=None):
        g = self.grid(ext)[:, :, :self.PH, :self.PW]
        if out is None:
            return np.ascontiguousarray(g)
        np.copyto(out, g)
        return out


def _small_uint(limit):
    """The smallest unsigned dtype holding 0..limit."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if limit <= np.iinfo(dt).max:
            return dt
    return np.uint64


def _max_fwd_fast(x, P, out=None, mask_out=None):
    """MAX forward on phase planes.  The first maximum in Caffe's scan order is
    found without masked copies: each offset ``k`` (row-major) contributes
    ``(x_k == y) * (K - k)`` to a running integer maximum, so the winner is the
    smallest ``k`` holding ``y`` (``==`` never holds for NaN)."""
    floor = _dtype_const(-FLT_MAX, x.dtype)
    buf = P.split(x, -np.inf)
    L = P.L
    offs = P.offsets()
    K = len(offs)
    y = _scratch("y", (L,), x.dtype)
    y.fill(floor)
    for i, j, a, b, s in offs:
        np.fmax(y, buf[a, b, s:s + L], out=y)
    kdt = _small_uint(K)
    rank = _scratch("rank", (L,), kdt)
    rank.fill(0)
    eq = _scratch("eq", (L,), bool)
    tmp = _scratch("tmp", (L,), kdt)
    for k, (i, j, a, b, s) in enumerate(offs):
        np.equal(buf[a, b, s:s + L], y, out=eq)
        np.multiply(eq, kdt(K - k), out=tmp)
        np.maximum(rank, tmp, out=rank)
    yc = P.crop(y, out)
    # the offset k = K - rank as i*W + j = k + (k // kw) * (W - kw), in int32 arithmetic
    # (np.take through a table made an intp copy of the ranks and, with ``out``, a copy
    # of it: 5.3 MB of temporaries for half of CIFAR-10 quick's pool1, which glibc took
    # from and gave back to the system on every call: page faults and TLB flushes)
    shape = (P.N, P.C, P.PH, P.PW)
    mask = np.empty(shape, np.int32) if mask_out is None else mask_out
    np.subtract(np.int32(K), P.grid(rank)[:, :, :P.PH, :P.PW], out=mask, dtype=np.int32)
    row = _scratch("row", shape, np.int32)
    np.floor_divide(mask, np.int32(P.kw), out=row)
    np.multiply(row, np.int32(P.W - P.kw), out=row)
    mask += row
    base = ((np.arange(P.PH) * P.sh - P.ph)[:, None] * P.W
            + (np.arange(P.PW) * P.sw - P.pw)[None, :]).astype(np.int32)
    mask += base
    none = np.greater(yc, floor, out=_scratch("none", shape, bool))
    np.logical_not(none, out=none)
    if none.any():     # rank 0 (no offset equal to y) only here: y is the floor
        np.copyto(mask, np.int32(-1), where=none)
    return yc, mask


def _ave_fwd_fast(x, psize, P, out=None):
    buf = P.split(x, 0)
    L = P.L
    acc = _scratch("acc", (L,), x.dtype)
    acc.fill(0)
    for i, j, a, b, s in P.offsets():
        acc += buf[a, b, s:s + L]
    acc = P.crop(acc, out)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(acc, psize, out=acc)
    return acc


def _ave_bwd_fast(gdiv, P, out=None):
    ge = P.extend(gdiv)
    dbuf = _scratch("dbuf", (P.sh, P.sw, P.L + P.extra), gdiv.dtype)
    dbuf.fill(0)
    L = P.L
    for i, j, a, b, s in P.offsets(reverse=True):
        dst = dbuf[a, b, s:s + L]
        dst += ge
    return P.merge(dbuf, gdiv.dtype, out)


# --------------------------------------------------------------------------
# MAX
# --------------------------------------------------------------------------
def _to(out, a):
    """``a``, or ``a`` copied into ``out`` (then ``out``)."""
    if out is None or a is out:
        return a
    out[...] = a
    return out


def _direct(out, shape, dtype):
    """Whether a numpy body may write straight into ``out``."""
    return out is None or (isinstance(out, np.ndarray) and out.flags.c_contiguous
                           and tuple(out.shape) == tuple(shape) and out.dtype == dtype)


# Each part of a pooling call split over the kernel pool has at least this much work
# (input elements x window positions per output stride area); below twice it the call
# stays on one thread.  MAX forward timed alone on two threads (2-core CPU machine,
# minimum of 60 alternating rounds): LeNet's pool2, 64 x 50 x 8 x 8 (work 204,800),
# 0.45 ms serial, 0.56 split in two; its pool1, 64 x 20 x 24 x 24 (737,280), 0.94 -> 0.78;
# CIFAR-10 quick's pool1, 100 x 32 x 32 x 32 3x3/2 (7.4 million), 8.0 -> 5.3 ms.  Calls
# that large take one part per thread (16 parts on 16 threads).
PARALLEL_MIN_WORK = 1 << 18


def _batch_parts(N, work):
    """With a CPU kernel pool (core/threads.py, ``--threads N``), outside its parts, and
    at least twice PARALLEL_MIN_WORK of ``work``: the pool and the contiguous batch
    ranges of the parts (one per thread, at most one per PARALLEL_MIN_WORK and two
    images), else (None, None).  Every numpy pooling output depends on its own image
    only, so the parts give the serial path's bits."""
    from ..core import threads
    pool = threads.kernel_pool()
    if pool is None or threads.in_kernel_pool():
        return None, None
    t = min(threads.kernel_threads(), N // 2, work // max(PARALLEL_MIN_WORK, 1))
    if t < 2:
        return None, None
    cuts = [N * i // t for i in range(t + 1)]
    return pool, list(zip(cuts[:-1], cuts[1:]))


def _work(g):
    """A pooling call's work for PARALLEL_MIN_WORK: input elements x window positions
    per stride area (how often each input is read)."""
    N, C, H, W, kh, kw, sh, sw = g[:8]
    return N * C * H * W * kh * kw // (sh * sw)


def _whole(out, shape, dtype):
    """The array the parts write into: ``out`` when they may write there directly."""
    if out is not None and _direct(out, shape, dtype):
        return out
    return np.empty(shape, dtype)


def _in_parts(pool, parts, fn):
    """``fn(a, b)`` for each batch range, in the pool; the results in range order."""
    from ..core import threads
    return threads.run_parts(len(parts), lambda slot, i: fn(*parts[i]))


def max_pool_forward(x, kernel, stride=1, pad=0, out=None, mask_out=None, relu=False):
    """MAX pooling -> ``(y, mask)``; ``mask`` int32 plane index ``h*W+w``.
    ``out`` (optional) receives ``y`` and is returned as ``y``; on the GPU ``mask_out``
    (optional) receives the mask.  ``relu`` (numpy): then y = max(y, 0), a plain
    in-place ReLU after the layer, in each part of the kernel pool (the mask is the
    pooling's)."""
    g = _geom(x.shape, kernel, stride, pad)
    if is_cupy_array(x):
        y, mask = _max_fwd_cupy(x, *g, out=out, mask_out=mask_out)
        return _to(out, y), mask
    pool, parts = _batch_parts(g[0], _work(g))
    if pool is not None:   # each part writes its images' y and mask in place (no concat)
        y = _whole(out, (g[0], g[1], g[10], g[11]), x.dtype)
        mask = np.empty(y.shape, np.int32)

        def part(a, b):
            _max_fwd_numpy(x[a:b], _geom(x[a:b].shape, kernel, stride, pad), y[a:b],
                           mask[a:b])
            if relu:
                np.maximum(y[a:b], 0, out=y[a:b])
        _in_parts(pool, parts, part)
        return _to(out, y), mask
    y, mask = _max_fwd_numpy(x, g, out)
    if relu:
        np.maximum(y, 0, out=y)
    return y, mask


def _max_fwd_numpy(x, g, out, mask_out=None):
    """(y, mask); ``mask_out`` (contiguous int32, optional) receives the mask."""
    P = _Phase(*g)
    if P.ok() and _direct(out, (P.N, P.C, P.PH, P.PW), x.dtype):
        return _max_fwd_fast(x, P, out, mask_out)
    y, mask = _max_fwd_general(x, *g)
    return _to(out, y), _to(mask_out, mask)


def _max_fwd_general(x, *g):
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g
    xp = _padded(x, H, W, kh, kw, sh, sw, ph, pw, PH, PW, -np.inf)
    floor = _dtype_const(-FLT_MAX, x.dtype)
    # the maximum: elementwise over the kh*kw strided window views (fmax never picks NaN)
    y = np.full((N, C, PH, PW), floor, dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            np.fmax(y, xp[_win(i, j, sh, sw, PH, PW)], out=y)
    # its index: the first window position, in Caffe's scan order (h, then w), holding
    # the maximum; values not above -FLT_MAX are never selected (mask -1)
    base = ((np.arange(PH) * sh - ph)[:, None] * W
            + (np.arange(PW) * sw - pw)[None, :]).astype(np.int32)
    mask = np.full((N, C, PH, PW), -1, dtype=np.int32)
    for i in reversed(range(kh)):
        for j in reversed(range(kw)):
            hit = xp[_win(i, j, sh, sw, PH, PW)] == y
            np.copyto(mask, base + np.int32(i * W + j), where=hit)
    np.copyto(mask, np.int32(-1), where=~(y > floor))
    return y, mask


def _index_backward_numpy(dy, idx, x_shape):
    N, C, H, W = (int(v) for v in x_shape)
    idx = np.asarray(idx).astype(np.int64, copy=False)
    plane = (np.arange(N * C, dtype=np.int64) * (H * W)).reshape(N, C, 1, 1)
    valid = idx >= 0
    flat = (idx + plane)[valid]
    # bincount sums the contributions to each input pixel in output order
    # ((ph, pw) ascending), deterministically, far faster than np.add.at.
    dx = np.bincount(flat, weights=np.asarray(dy)[valid], minlength=N * C * H * W)
    return dx.astype(dy.dtype, copy=False).reshape(N, C, H, W)


def max_pool_backward(dy, mask, x_shape, kernel=None, stride=None, pad=0, out=None,
                      relu_y=None):
    """Route ``dy`` to the argmax positions in ``mask``.

    ``kernel``/``stride``/``pad`` (the forward geometry) are optional: the
    numpy body does not need them; the CuPy body uses Caffe's deterministic
    gather kernel when they are given and a scatter-add otherwise.  ``out``
    (optional) receives ``dx`` and is returned.  ``relu_y`` (numpy): the output of a
    forward with ``relu``; dy is first masked in place, dy *= (relu_y > 0) (the
    in-place ReLU's backward, in each part of the kernel pool).
    """
    if is_cupy_array(dy):
        return _to(out, _index_bwd_cupy(dy, mask, x_shape, kernel, stride, pad, out=out))
    return _index_backward_dispatch(dy, mask, x_shape, out, relu_y)


def _relu_mask(dy, y):
    if y is not None:
        np.multiply(dy, y > 0, out=dy)


def _index_backward_dispatch(dy, mask, x_shape, out=None, relu_y=None):
    """numpy: ``np.add.at`` in the array's dtype, in output order (Caffe's CPU
    order), or the float64 bincount of the general path."""
    dy = np.asarray(dy)
    shape = tuple(int(v) for v in x_shape)
    pool, parts = _batch_parts(shape[0], math.prod(shape) // 2)   # a scatter: half
    if pool is not None and FAST_PATH:   # one image's dx takes its own dy only
        dx = _whole(out, shape, dy.dtype)

        def part(a, b):
            _relu_mask(dy[a:b], None if relu_y is None else relu_y[a:b])
            _index_backward_addat(dy[a:b], mask[a:b], (b - a,) + shape[1:], dx[a:b])
        _in_parts(pool, parts, part)
        return _to(out, dx)
    _relu_mask(dy, relu_y)
    if FAST_PATH:
        if _direct(out, tuple(int(v) for v in x_shape), dy.dtype):
            return _index_backward_addat(dy, mask, x_shape, out)
        return _to(out, _index_backward_addat(dy, mask, x_shape))
    return _to(out, _index_backward_numpy(dy, mask, x_shape))


def _index_backward_addat(dy, mask, x_shape, out=None):
    N, C, H, W = (int(v) for v in x_shape)
    mask = np.asarray(mask)
    if mask.shape != dy.shape or mask.ndim != 4 or mask.shape[:2] != (N, C):
        raise ValueError(f"dy {dy.shape} / mask {mask.shape} do not match x_shape {x_shape}")
    # per-thread scratch for the intp indices (a fresh 3.3 MB array per call for half of
    # CIFAR-10 quick's pool1 went back to the system each time, as in _max_fwd_fast)
    idx = _scratch("addat_idx", mask.shape, np.intp)
    np.copyto(idx, mask, casting="unsafe")
    invalid = np.less(idx, 0, out=_scratch("addat_invalid", mask.shape, bool))
    idx += (np.arange(N * C, dtype=np.intp) * (H * W)).reshape(N, C, 1, 1)
    idx, vals = idx.reshape(-1), dy.reshape(-1)
    if invalid.any():                               # -1: nothing selected, nothing routed
        keep = ~invalid.reshape(-1)
        idx, vals = idx[keep], vals[keep]
    dx = np.zeros((N, C, H, W), dtype=dy.dtype) if out is None else out
    if out is not None:
        dx.fill(0)
    # np.add.at adds one at a time in index order: (ph, pw) ascending per pixel
    np.add.at(dx.reshape(-1), idx, vals)
    return dx


# --------------------------------------------------------------------------
# AVE
# --------------------------------------------------------------------------
def ave_pool_forward(x, kernel, stride=1, pad=0, out=None):
    """AVE pooling with Caffe's divisor (see module docstring) -> ``y``
    (written into ``out`` when given)."""
    g = _geom(x.shape, kernel, stride, pad)
    if is_cupy_array(x):
        return _to(out, _ave_fwd_cupy(x, *g, out=out))
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g
    pool, parts = _batch_parts(N, _work(g))
    if pool is not None:
        y = _whole(out, (N, C, PH, PW), x.dtype)
        _in_parts(pool, parts, lambda a, b: _ave_fwd_numpy(
            x[a:b], _geom(x[a:b].shape, kernel, stride, pad), y[a:b]))
        return _to(out, y)
    return _ave_fwd_numpy(x, g, out)


def _ave_fwd_numpy(x, g, out):
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g
    P = _Phase(*g)
    # the planes pay for their copy only when windows overlap (each input read
    # more than once); without overlap the strided sums are as fast
    if P.ok() and kh * kw > sh * sw and _direct(out, (N, C, PH, PW), x.dtype):
        psize = _ave_pool_size(H, W, kh, kw, sh, sw, ph, pw, PH, PW).astype(x.dtype)
        return _ave_fwd_fast(x, psize, P, out)
    return _to(out, _ave_fwd_general(x, *g))


def _ave_fwd_general(x, *g):
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g
    xp = _padded(x, H, W, kh, kw, sh, sw, ph, pw, PH, PW, 0)
    acc = np.zeros((N, C, PH, PW), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            acc += xp[_win(i, j, sh, sw, PH, PW)]
    psize = _ave_pool_size(H, W, kh, kw, sh, sw, ph, pw, PH, PW).astype(x.dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        return acc / psize


def ave_pool_backward(dy, x_shape, kernel, stride=1, pad=0, out=None):
    """Adjoint of :func:`ave_pool_forward` -> ``dx`` of shape ``x_shape``
    (written into ``out`` when given)."""
    g = _geom(x_shape, kernel, stride, pad)
    if is_cupy_array(dy):
        return _to(out, _ave_bwd_cupy(dy, *g, out=out))
    N, C, H, W = g[:4]
    pool, parts = _batch_parts(N, _work(g))
    if pool is not None:
        dx = _whole(out, (N, C, H, W), dy.dtype)
        _in_parts(pool, parts, lambda a, b: _ave_bwd_numpy(
            dy[a:b], _geom((b - a, C, H, W), kernel, stride, pad), dx[a:b]))
        return _to(out, dx)
    if _direct(out, (N, C, H, W), dy.dtype):
        return _ave_bwd_numpy(dy, g, out)
    return _to(out, _ave_bwd_numpy(dy, g))


def _ave_bwd_numpy(dy, g, out=None):
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g
    if tuple(dy.shape) != (N, C, PH, PW):
        raise ValueError(f"dy has shape {dy.shape}, expected {(N, C, PH, PW)}")
    psize = _ave_pool_size(H, W, kh, kw, sh, sw, ph, pw, PH, PW).astype(dy.dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        gdiv = dy / psize
    P = _Phase(*g)
    if P.ok():
        return _ave_bwd_fast(gdiv, P, out)
    Hp = max(ph + H, (PH - 1) * sh + kh)
    Wp = max(pw + W, (PW - 1) * sw + kw)
    dxp = np.zeros((N, C, Hp, Wp), dtype=dy.dtype)
    # offsets descending <=> (ph, pw) ascending per pixel: the GPU's order
    for i in range(kh - 1, -1, -1):
        for j in range(kw - 1, -1, -1):
            dxp[_win(i, j, sh, sw, PH, PW)] += gdiv
    return _to(out, np.ascontiguousarray(dxp[:, :, ph:ph + H, pw:pw + W]))


# --------------------------------------------------------------------------
# STOCHASTIC
# --------------------------------------------------------------------------
def _check_no_pad(pad):
    if as_pair(pad, "pad") != (0, 0):
        raise ValueError("stochastic pooling supports pad = 0 only (as Caffe)")


def stochastic_pool_forward_train(x, rand_uniform, kernel, stride=1, pad=0):
    """Stochastic pooling, training -> ``(y, idx)`` (idx int32 ``h*W+w``)."""
    _check_no_pad(pad)
    g = _geom(x.shape, kernel, stride, 0)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g
    if tuple(rand_uniform.shape) != (N, C, PH, PW):
        raise ValueError(f"rand_uniform has shape {rand_uniform.shape}, "
                         f"expected {(N, C, PH, PW)}")
    if is_cupy_array(x):
        return _sto_train_cupy(x, rand_uniform, *g)
    xp = _padded(x, H, W, kh, kw, sh, sw, 0, 0, PH, PW, 0)
    hs = np.arange(PH) * sh
    ws = np.arange(PW) * sw
    total = np.zeros((N, C, PH, PW), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            total += xp[_win(i, j, sh, sw, PH, PW)]
    thres = np.asarray(rand_uniform).astype(x.dtype, copy=False) * total
    cum = np.zeros_like(total)
    y = np.zeros_like(total)
    idx = np.full((N, C, PH, PW), -1, dtype=np.int32)
    found = np.zeros((N, C, PH, PW), dtype=bool)
    for i in range(kh):
        hin = (hs + i) < H
        for j in range(kw):
            inside = hin[:, None] & ((ws + j) < W)[None, :]      # (PH, PW)
            v = xp[_win(i, j, sh, sw, PH, PW)]
            cum += v
            pos = ((hs + i)[:, None] * W + (ws + j)[None, :]).astype(np.int32)
            # fallback candidate: latest element inside the image
            last = inside & ~found
            np.copyto(y, v, where=last)
            np.copyto(idx, np.broadcast_to(pos, idx.shape), where=last)
            found |= inside & (cum >= thres)
    return y, idx


def stochastic_pool_forward_test(x, kernel, stride=1, pad=0):
    """Stochastic pooling, test: ``sum(x^2) / (FLT_MIN + sum(x))`` per window."""
    _check_no_pad(pad)
    g = _geom(x.shape, kernel, stride, 0)
    if is_cupy_array(x):
        return _sto_test_cupy(x, *g)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g
    xp = _padded(x, H, W, kh, kw, sh, sw, 0, 0, PH, PW, 0)
    cumsum = np.full((N, C, PH, PW), _dtype_const(FLT_MIN, x.dtype), dtype=x.dtype)
    cumval = np.zeros((N, C, PH, PW), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            v = xp[_win(i, j, sh, sw, PH, PW)]
            cumsum += v
            cumval += v * v
    with np.errstate(divide="ignore", invalid="ignore"):
        return cumval / cumsum


def stochastic_pool_backward(dy, idx, x_shape, kernel=None, stride=None, pad=0, out=None):
    """Route ``dy`` to the sampled positions ``idx`` (like max backward)."""
    _check_no_pad(pad)
    if is_cupy_array(dy):
        return _to(out, _index_bwd_cupy(dy, idx, x_shape, kernel, stride, 0))
    return _index_backward_dispatch(dy, idx, x_shape, out)


# --------------------------------------------------------------------------
# CuPy bodies (mirror Caffe's pooling_layer.cu)
# --------------------------------------------------------------------------
_HDR = r"""
#define MC_DECODE_TOP(index)                                   \
  const int pw_ = (int)(index % PW);                           \
  const int ph_ = (int)((index / PW) % PH);                    \
  const long long nc_ = index / ((long long)PW * PH);
#define MC_DECODE_BOTTOM(index)                                \
  const int w_ = (int)(index % W);                             \
  const int h_ = (int)((index / W) % H);                       \
  const long long nc_ = index / ((long long)W * H);
"""

_MAX_FWD_SRC = _HDR + r"""
extern "C" __global__ void mc_max_pool_fwd(
    const long long nthreads, const T* __restrict__ bottom,
    const int H, const int W, const int PH, const int PW,
    const int kh, const int kw, const int sh, const int sw,
    const int ph, const int pw, T* __restrict__ top, int* __restrict__ mask) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    MC_DECODE_TOP(index)
    int hstart = ph_ * sh - ph;
    int wstart = pw_ * sw - pw;
    const int hend = min(hstart + kh, H);
    const int wend = min(wstart + kw, W);
    hstart = max(hstart, 0);
    wstart = max(wstart, 0);
    T maxval = -MC_FLT_MAX;
    int maxidx = -1;
    const T* slice = bottom + nc_ * H * W;
    for (int h = hstart; h < hend; ++h) {
      for (int w = wstart; w < wend; ++w) {
        if (slice[h * W + w] > maxval) {
          maxidx = h * W + w;
          maxval = slice[maxidx];
        }
      }
    }
    top[index] = maxval;
    mask[index] = maxidx;
  }
}
"""

_AVE_FWD_SRC = _HDR + r"""
extern "C" __global__ void mc_ave_pool_fwd(
    const long long nthreads, const T* __restrict__ bottom,
    const int H, const int W, const int PH, const int PW,
    const int kh, const int kw, const int sh, const int sw,
    const int ph, const int pw, T* __restrict__ top) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    MC_DECODE_TOP(index)
    int hstart = ph_ * sh - ph;
    int wstart = pw_ * sw - pw;
    int hend = min(hstart + kh, H + ph);
    int wend = min(wstart + kw, W + pw);
    const int pool_size = (hend - hstart) * (wend - wstart);
    hstart = max(hstart, 0);
    wstart = max(wstart, 0);
    hend = min(hend, H);
    wend = min(wend, W);
    T aveval = 0;
    const T* slice = bottom + nc_ * H * W;
    for (int h = hstart; h < hend; ++h) {
      for (int w = wstart; w < wend; ++w) {
        aveval += slice[h * W + w];
      }
    }
    top[index] = aveval / (T)pool_size;
  }
}
"""

_STO_TRAIN_SRC = _HDR + r"""
extern "C" __global__ void mc_sto_pool_fwd_train(
    const long long nthreads, const T* __restrict__ bottom,
    const T* __restrict__ rand_u,
    const int H, const int W, const int PH, const int PW,
    const int kh, const int kw, const int sh, const int sw,
    T* __restrict__ top, int* __restrict__ idx) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    MC_DECODE_TOP(index)
    const int hstart = ph_ * sh;
    const int hend = min(hstart + kh, H);
    const int wstart = pw_ * sw;
    const int wend = min(wstart + kw, W);
    const T* slice = bottom + nc_ * H * W;
    T cumsum = 0;
    // First pass: get sum
    for (int h = hstart; h < hend; ++h)
      for (int w = wstart; w < wend; ++w)
        cumsum += slice[h * W + w];
    const T thres = rand_u[index] * cumsum;
    // Second pass: get value, and set index.
    cumsum = 0;
    T val = 0;
    int sel = -1;
    for (int h = hstart; h < hend && !(sel >= 0 && cumsum >= thres); ++h) {
      for (int w = wstart; w < wend; ++w) {
        cumsum += slice[h * W + w];
        sel = h * W + w;
        val = slice[sel];
        if (cumsum >= thres) break;
      }
    }
    top[index] = val;
    idx[index] = sel;
  }
}
"""

_STO_TEST_SRC = _HDR + r"""
extern "C" __global__ void mc_sto_pool_fwd_test(
    const long long nthreads, const T* __restrict__ bottom,
    const int H, const int W, const int PH, const int PW,
    const int kh, const int kw, const int sh, const int sw,
    T* __restrict__ top) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    MC_DECODE_TOP(index)
    const int hstart = ph_ * sh;
    const int hend = min(hstart + kh, H);
    const int wstart = pw_ * sw;
    const int wend = min(wstart + kw, W);
    // We set cumsum to be 0 to avoid divide-by-zero problems
    T cumsum = (T)MC_FLT_MIN;
    T cumvalues = 0;
    const T* slice = bottom + nc_ * H * W;
    for (int h = hstart; h < hend; ++h) {
      for (int w = wstart; w < wend; ++w) {
        const T v = slice[h * W + w];
        cumsum += v;
        cumvalues += v * v;
      }
    }
    top[index] = cumvalues / cumsum;
  }
}
"""

# Max and stochastic backward share one gather kernel: mask/idx hold the
# plane index of the selected input; (ph, pw) ascending like Caffe.
_INDEX_BWD_SRC = _HDR + r"""
extern "C" __global__ void mc_index_pool_bwd(
    const long long nthreads, const T* __restrict__ top_diff,
    const int* __restrict__ mask,
    const int H, const int W, const int PH, const int PW,
    const int kh, const int kw, const int sh, const int sw,
    const int ph, const int pw, T* __restrict__ bottom_diff) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    MC_DECODE_BOTTOM(index)
    const int phstart = (h_ + ph < kh) ? 0 : (h_ + ph - kh) / sh + 1;
    const int phend = min((h_ + ph) / sh + 1, PH);
    const int pwstart = (w_ + pw < kw) ? 0 : (w_ + pw - kw) / sw + 1;
    const int pwend = min((w_ + pw) / sw + 1, PW);
    T gradient = 0;
    const long long offset = nc_ * PH * PW;
    const T* td = top_diff + offset;
    const int* m = mask + offset;
    const int me = h_ * W + w_;
    for (int p = phstart; p < phend; ++p) {
      for (int q = pwstart; q < pwend; ++q) {
        if (m[p * PW + q] == me) gradient += td[p * PW + q];
      }
    }
    bottom_diff[index] = gradient;
  }
}
"""

# Scatter fallback when the window geometry is unknown (atomics: the
# summation order of coinciding contributions is not deterministic).
_INDEX_SCATTER_SRC = r"""
extern "C" __global__ void mc_index_pool_scatter(
    const long long nthreads, const T* __restrict__ top_diff,
    const int* __restrict__ mask, const int HW, const int PHW,
    T* __restrict__ bottom_diff) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    const int m = mask[index];
    if (m >= 0) atomicAdd(bottom_diff + (index / PHW) * HW + m, top_diff[index]);
  }
}
"""

_AVE_BWD_SRC = _HDR + r"""
extern "C" __global__ void mc_ave_pool_bwd(
    const long long nthreads, const T* __restrict__ top_diff,
    const int H, const int W, const int PH, const int PW,
    const int kh, const int kw, const int sh, const int sw,
    const int ph, const int pw, T* __restrict__ bottom_diff) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    // find out the local index; compute in the padded coordinates
    MC_DECODE_BOTTOM(index)
    const int w = w_ + pw;
    const int h = h_ + ph;
    const int phstart = (h < kh) ? 0 : (h - kh) / sh + 1;
    const int phend = min(h / sh + 1, PH);
    const int pwstart = (w < kw) ? 0 : (w - kw) / sw + 1;
    const int pwend = min(w / sw + 1, PW);
    T gradient = 0;
    const T* td = top_diff + nc_ * PH * PW;
    for (int p = phstart; p < phend; ++p) {
      for (int q = pwstart; q < pwend; ++q) {
        // figure out the pooling size
        const int hstart = p * sh - ph;
        const int wstart = q * sw - pw;
        const int hend = min(hstart + kh, H + ph);
        const int wend = min(wstart + kw, W + pw);
        const int pool_size = (hend - hstart) * (wend - wstart);
        gradient += td[p * PW + q] / (T)pool_size;
      }
    }
    bottom_diff[index] = gradient;
  }
}
"""


def _gpu_out(out, shape, dtype):
    """``out`` when a CuPy body can write straight into it, else a new array."""
    cp = _cupy()
    if (out is not None and isinstance(out, cp.ndarray) and out.flags.c_contiguous
            and tuple(out.shape) == tuple(shape) and out.dtype == dtype):
        return out
    return cp.empty(shape, dtype=dtype)


def _max_fwd_cupy(x, N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, out=None, mask_out=None):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    y = _gpu_out(out, (N, C, PH, PW), x.dtype)
    mask = _gpu_out(mask_out, (N, C, PH, PW), np.dtype(np.int32))
    k = raw_kernel(_MAX_FWD_SRC, "mc_max_pool_fwd", cuda_type(x.dtype))
    launch(k, y.size, (np.int64(y.size), x) + _i32(H, W, PH, PW, kh, kw, sh, sw, ph, pw)
           + (y, mask))
    return y, mask


def _ave_fwd_cupy(x, N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, out=None):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    y = _gpu_out(out, (N, C, PH, PW), x.dtype)
    k = raw_kernel(_AVE_FWD_SRC, "mc_ave_pool_fwd", cuda_type(x.dtype))
    launch(k, y.size, (np.int64(y.size), x) + _i32(H, W, PH, PW, kh, kw, sh, sw, ph, pw)
           + (y,))
    return y


def _ave_bwd_cupy(dy, N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, out=None):
    cp = _cupy()
    if tuple(dy.shape) != (N, C, PH, PW):
        raise ValueError(f"dy has shape {dy.shape}, expected {(N, C, PH, PW)}")
    dy = cp.ascontiguousarray(dy)
    dx = _gpu_out(out, (N, C, H, W), dy.dtype)
    k = raw_kernel(_AVE_BWD_SRC, "mc_ave_pool_bwd", cuda_type(dy.dtype))
    launch(k, dx.size, (np.int64(dx.size), dy) + _i32(H, W, PH, PW, kh, kw, sh, sw, ph, pw)
           + (dx,))
    return dx


def _sto_train_cupy(x, u, N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    u = cp.ascontiguousarray(u, dtype=x.dtype)
    y = cp.empty((N, C, PH, PW), dtype=x.dtype)
    idx = cp.empty((N, C, PH, PW), dtype=cp.int32)
    k = raw_kernel(_STO_TRAIN_SRC, "mc_sto_pool_fwd_train", cuda_type(x.dtype))
    launch(k, y.size, (np.int64(y.size), x, u) + _i32(H, W, PH, PW, kh, kw, sh, sw)
           + (y, idx))
    return y, idx


def _sto_test_cupy(x, N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    y = cp.empty((N, C, PH, PW), dtype=x.dtype)
    k = raw_kernel(_STO_TEST_SRC, "mc_sto_pool_fwd_test", cuda_type(x.dtype))
    launch(k, y.size, (np.int64(y.size), x) + _i32(H, W, PH, PW, kh, kw, sh, sw) + (y,))
    return y


def _index_bwd_cupy(dy, mask, x_shape, kernel, stride, pad, out=None):
    cp = _cupy()
    N, C, H, W = (int(v) for v in x_shape)
    dy = cp.ascontiguousarray(dy)
    mask = cp.ascontiguousarray(mask, dtype=cp.int32)
    if dy.ndim != 4 or dy.shape[:2] != (N, C) or mask.shape != dy.shape:
        raise ValueError(f"dy {dy.shape} / mask {mask.shape} do not match x_shape {x_shape}")
    PH, PW = int(dy.shape[2]), int(dy.shape[3])
    ctype = cuda_type(dy.dtype)
    if kernel is None:
        dx = cp.zeros((N, C, H, W), dtype=dy.dtype)
        k = raw_kernel(_INDEX_SCATTER_SRC, "mc_index_pool_scatter", ctype)
        launch(k, dy.size, (np.int64(dy.size), dy, mask) + _i32(H * W, PH * PW) + (dx,))
        return dx
    kh, kw = as_pair(kernel, "kernel")
    sh, sw = as_pair(1 if stride is None else stride, "stride")
    ph, pw = as_pair(pad, "pad")
    if (PH, PW) != (_pooled(H, kh, sh, ph), _pooled(W, kw, sw, pw)):
        raise ValueError("dy's spatial shape does not match the pooling geometry")
    dx = _gpu_out(out, (N, C, H, W), dy.dtype)
    k = raw_kernel(_INDEX_BWD_SRC, "mc_index_pool_bwd", ctype)
    launch(k, dx.size, (np.int64(dx.size), dy, mask)
           + _i32(H, W, PH, PW, kh, kw, sh, sw, ph, pw) + (dx,))
    return dx
