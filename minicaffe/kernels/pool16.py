"""MAX pooling of channels-last 2-byte maps whose windows do not overlap (issue 20).

The GPU engine holds bf16/fp16 feature maps N, H, W, C (engine/precision.py); cuDNN's
channels-last MAX pooling backward on them (``pooling_bw_kernel_max``, with a memset of
dx and a ``scalePackedTensor`` pass) took 6.5 ms of VGG-16 b64's 30 ms bf16 step on an
H100.  When no two windows share an input (``stride >= kernel`` on both axes: VGG's,
LeNet's 2x2/2) each input has at most one window, so the backward is a gather:

- forward: one thread per (window, V channels), V = 8 where C allows (16-byte loads and
  stores; else 4, 2, 1), the window's maximum per channel;
- backward: one thread per (stride cell, V channels): the cell of window (p, q) is the
  ``sh x sw`` block of inputs starting at the window's corner, so the cells tile the
  (padded) map and each input is written once -- ``dy`` where the window's argmax is,
  recomputed from ``x`` with the forward's rule, 0 elsewhere (inputs in no window, in
  the gaps of ``stride > kernel`` or past the last window: 0).  No atomics, no memset,
  no index buffer: the layer's backward reads x, which cuDNN's reads too.

The rule (both directions): the window's inputs are scanned row by row as Caffe's
kernels do (clipped to the image: padding is never selected), compared in fp32; an input
replaces the running maximum (initially -FLT_MAX) only if it is STRICTLY greater, so ties
go to the first maximum in window order (Caffe's rule; cuDNN 9's channels-last backward
sends a tied gradient there too: tests/test_pool16_gpu.py); a NaN is selected where none
was before, so a window holding a NaN gives that first NaN and its gradient goes there:
NaN propagation as our cuDNN pooling descriptor asks (``CUDNN_PROPAGATE_NAN``; cuDNN's
backward, measured on one window, sends the gradient to the first NaN too), where Caffe's
own kernel never selects a NaN.  A window with nothing above
-FLT_MAX (all -inf) gives -inf (Caffe's -FLT_MAX in a 2-byte type) and no gradient.  The
output is the selected input's 2-byte word itself: the forward is exact, bit for bit.

Arrays are a BFLOAT16 buffer's uint16 words or a FLOAT16 one's float16 (``storage``), any
shape, holding N, H, W, C (x, dx) or N, PH, PW, C (y, dy) contiguously; ``shape`` is the
logical (N, C, H, W).  numpy arrays run a numpy body with the same results (the CPU tests
and the GPU tests' reference), CuPy arrays the kernels.
"""
import functools

import numpy as np

from ..core import precision as P
from ._backend import as_pair, is_cupy_array, launch, raw_kernel

__all__ = ["disjoint", "output_shape", "max_pool_forward", "max_pool_backward"]


def disjoint(kernel, stride):
    """True when no two pooling windows share an input: stride >= kernel on both axes."""
    kh, kw = as_pair(kernel, "kernel")
    sh, sw = as_pair(stride, "stride")
    return sh >= kh and sw >= kw


def output_shape(H, W, kernel, stride, pad):
    """Caffe's CEIL geometry (kernels/pooling.py's ``pool_output_shape``)."""
    from .pooling import pool_output_shape
    return pool_output_shape(H, W, kernel, stride, pad)


def _geometry(shape, kernel, stride, pad, out_hw):
    N, C, H, W = (int(v) for v in shape)
    kh, kw = as_pair(kernel, "kernel")
    sh, sw = as_pair(stride, "stride")
    ph, pw = as_pair(pad, "pad")
    if not disjoint((kh, kw), (sh, sw)):
        raise ValueError(f"overlapping windows (kernel {(kh, kw)}, stride {(sh, sw)}): "
                         "these kernels pool disjoint windows only")
    if min(ph, pw) < 0 or ph >= kh or pw >= kw:
        raise ValueError(f"pad {(ph, pw)} must be >= 0 and smaller than the kernel")
    PH, PW = output_shape(H, W, (kh, kw), (sh, sw), (ph, pw)) if out_hw is None else \
        (int(out_hw[0]), int(out_hw[1]))
    # the cells tile [-pad, CH*sh - pad) >= the image; windows past them hold no input
    CH = max(PH, -(-(H + ph) // sh))
    CW = max(PW, -(-(W + pw) // sw))
    return N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, CH, CW


def _words(a, storage):
    dt = P.buffer_dtype(storage)
    if a.dtype != dt:
        raise TypeError(f"a {storage} buffer is held in {dt}, got {a.dtype}")
    return a.reshape(-1).view(np.uint16)


def _check_size(a, n, what):
    if a.size != n:
        raise ValueError(f"{what} holds {a.size} values, expected {n}")


# -- numpy body (the reference of the kernels) ---------------------------------------------
_NEG_INF = {P.BFLOAT16: 0xFF80, P.FLOAT16: 0xFC00}


def _np_float(words, storage):
    if storage == P.BFLOAT16:
        return (words.astype(np.uint32) << 16).view(np.float32)
    return words.view(np.float16).astype(np.float32)


def _np_select(xw, g, storage):
    """(the selected words (N, PH, PW, C), the window offset k = i*kw + j selected, -1
    for none) from x's words (N, H, W, C), by the module's rule."""
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, CH, CW = g
    Hp, Wp = CH * sh, CW * sw
    xp = np.full((N, Hp, Wp, C), _NEG_INF[storage], np.uint16)   # padding: never taken
    xp[:, ph:ph + H, pw:pw + W] = xw
    best = np.full((N, PH, PW, C), _NEG_INF[storage], np.uint16)
    m = np.full((N, PH, PW, C), -np.finfo(np.float32).max, np.float32)
    idx = np.full((N, PH, PW, C), -1, np.int32)
    for i in range(kh):
        for j in range(kw):
            h = xp[:, i:i + sh * PH:sh, j:j + sw * PW:sw]
            v = _np_float(h, storage)
            with np.errstate(invalid="ignore"):
                take = (v > m) | (np.isnan(v) & ~np.isnan(m))
            m = np.where(take, v, m)
            best = np.where(take, h, best)
            idx = np.where(take, i * kw + j, idx)
    return best, idx


def _np_forward(x, y, storage, g):
    N, C, H, W = g[:4]
    best, _ = _np_select(_words(x, storage).reshape(N, H, W, C), g, storage)
    _words(y, storage)[...] = best.reshape(-1)
    return y


def _np_backward(x, dy, dx, storage, g):
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, CH, CW = g
    _, idx = _np_select(_words(x, storage).reshape(N, H, W, C), g, storage)
    dyw = _words(dy, storage).reshape(N, PH, PW, C)
    dxp = np.zeros((N, CH * sh, CW * sw, C), np.uint16)
    for i in range(kh):
        for j in range(kw):
            dxp[:, i:i + sh * PH:sh, j:j + sw * PW:sw] = np.where(idx == i * kw + j, dyw, 0)
    _words(dx, storage)[...] = dxp[:, ph:ph + H, pw:pw + W].reshape(-1)
    return dx


# -- CUDA ------------------------------------------------------------------------------------
_VT = {8: "uint4", 4: "uint2", 2: "unsigned int", 1: "unsigned short"}

_SRC = r"""
#define V {V}
typedef {VT} VT;
typedef {IDX} IDX;     // int where every index fits: 32-bit divisions are cheaper
#define MC_LOOP(i, n) \
  for (IDX i = (IDX)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (IDX)blockDim.x * gridDim.x)
union MCVec { VT v; unsigned short h[V]; };
#define MC_NEG_INF {NEG_INF}

__device__ __forceinline__ float mc_f(unsigned short h) {
#if {BF16}
  return __uint_as_float(((unsigned int)h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

// the window (p, q) of image nn: per lane, the selected word and its offset i*kw+j (-1)
__device__ __forceinline__ void mc_select(
    const VT* __restrict__ x, const IDX nn, const int cv, const int H, const int W,
    const int CV, const int p, const int q, const int kh, const int kw, const int sh,
    const int sw, const int ph, const int pw, unsigned short* best, int* idx) {
  float m[V];
#pragma unroll
  for (int l = 0; l < V; ++l) { m[l] = -MC_FLT_MAX; best[l] = MC_NEG_INF; idx[l] = -1; }
  const int h0 = p * sh - ph, w0 = q * sw - pw;
  const int hs = max(h0, 0), ws = max(w0, 0);
  const int he = min(h0 + kh, H), we = min(w0 + kw, W);
  const VT* xb = x + nn * H * W * CV + cv;
  for (int h = hs; h < he; ++h) {
    for (int w = ws; w < we; ++w) {
      MCVec u;
      u.v = xb[((IDX)h * W + w) * CV];
      const int k = (h - h0) * kw + (w - w0);
#pragma unroll
      for (int l = 0; l < V; ++l) {
        const float v = mc_f(u.h[l]);
        if (v > m[l] || (v != v && m[l] == m[l])) { m[l] = v; best[l] = u.h[l]; idx[l] = k; }
      }
    }
  }
}

extern "C" __global__ void mc_max_pool16_fwd(
    const IDX n, const VT* __restrict__ x, VT* __restrict__ y, const int H,
    const int W, const int CV, const int PH, const int PW, const int kh, const int kw,
    const int sh, const int sw, const int ph, const int pw) {
  MC_LOOP(i, n) {
    const int cv = (int)(i % CV);
    IDX t = i / CV;
    const int q = (int)(t % PW);
    t /= PW;
    const int p = (int)(t % PH);
    const IDX nn = t / PH;
    unsigned short best[V];
    int idx[V];
    mc_select(x, nn, cv, H, W, CV, p, q, kh, kw, sh, sw, ph, pw, best, idx);
    MCVec o;
#pragma unroll
    for (int l = 0; l < V; ++l) o.h[l] = best[l];
    y[i] = o.v;
  }
}

extern "C" __global__ void mc_max_pool16_bwd(
    const IDX n, const VT* __restrict__ x, const VT* __restrict__ dy,
    VT* __restrict__ dx, const int H, const int W, const int CV, const int PH,
    const int PW, const int CH, const int CW, const int kh, const int kw, const int sh,
    const int sw, const int ph, const int pw) {
  MC_LOOP(i, n) {
    const int cv = (int)(i % CV);
    IDX t = i / CV;
    const int q = (int)(t % CW);
    t /= CW;
    const int p = (int)(t % CH);
    const IDX nn = t / CH;
    unsigned short best[V];
    int idx[V];
    MCVec g;
    if (p < PH && q < PW) {
      mc_select(x, nn, cv, H, W, CV, p, q, kh, kw, sh, sw, ph, pw, best, idx);
      g.v = dy[((nn * PH + p) * PW + q) * CV + cv];
    } else {
#pragma unroll
      for (int l = 0; l < V; ++l) { idx[l] = -1; g.h[l] = 0; }
    }
    const int h0 = p * sh - ph, w0 = q * sw - pw;
    const int hs = max(h0, 0), ws = max(w0, 0);
    const int he = min(h0 + sh, H), we = min(w0 + sw, W);
    VT* db = dx + nn * H * W * CV + cv;
    for (int h = hs; h < he; ++h) {
      for (int w = ws; w < we; ++w) {
        // an input of the cell outside the window (its rows >= kh, columns >= kw):
        // k = -2, never an argmax
        const int k = (h - h0 < kh && w - w0 < kw) ? (h - h0) * kw + (w - w0) : -2;
        MCVec o;
#pragma unroll
        for (int l = 0; l < V; ++l) o.h[l] = (idx[l] == k) ? g.h[l] : (unsigned short)0;
        db[((IDX)h * W + w) * CV] = o.v;
      }
    }
  }
}
"""


def _width(C, *arrays):
    """The widest V in (8, 4, 2, 1) dividing C with every array aligned to 2V bytes."""
    for v in (8, 4, 2, 1):
        if C % v == 0 and all(a.data.ptr % (2 * v) == 0 for a in arrays):
            return v
    return 1


@functools.lru_cache(maxsize=None)
def _kernel(storage, v, wide, name):
    """The kernel ``name`` for ``storage``, V = ``v`` lanes, 64-bit indices if ``wide``."""
    src = (_SRC.replace("{V}", str(v)).replace("{VT}", _VT[v])
           .replace("{IDX}", "long long" if wide else "int")
           .replace("{NEG_INF}", hex(_NEG_INF[storage]))
           .replace("{BF16}", "1" if storage == P.BFLOAT16 else "0"))
    return raw_kernel(src, name, "float")


def _idx(n, *sizes):
    """(whether 64-bit indices are needed, the loop count as the kernel's index type)."""
    wide = max((n,) + sizes) + (1 << 20) * 256 >= 1 << 31
    return wide, (np.int64(n) if wide else np.int32(n))


def _i32(*vals):
    return tuple(np.int32(v) for v in vals)


def max_pool_forward(x, y, shape, kernel, stride, pad, storage, out_hw=None):
    """``y`` (N, PH, PW, C words) = the MAX pooling of ``x`` (N, H, W, C words of
    ``storage``, ``shape`` = (N, C, H, W)) over disjoint windows; ``out_hw``: (PH, PW)
    when not Caffe's CEIL geometry (a FLOOR layer's).  Returns ``y``."""
    g = _geometry(shape, kernel, stride, pad, out_hw)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, CH, CW = g
    _check_size(x, N * C * H * W, "x")
    _check_size(y, N * C * PH * PW, "y")
    if not is_cupy_array(x):
        return _np_forward(x, y, storage, g)
    xw, yw = _words(x, storage), _words(y, storage)
    v = _width(C, xw, yw)
    n = N * PH * PW * (C // v)
    wide, nn = _idx(n, xw.size)
    launch(_kernel(storage, v, wide, "mc_max_pool16_fwd"), n,
           (nn, xw, yw) + _i32(H, W, C // v, PH, PW, kh, kw, sh, sw, ph, pw))
    return y


def max_pool_backward(x, dy, dx, shape, kernel, stride, pad, storage, out_hw=None):
    """``dx`` (N, H, W, C words) = ``dy`` (N, PH, PW, C) routed to each window's argmax in
    ``x`` (the forward's input), 0 elsewhere; every input is written.  Returns ``dx``."""
    g = _geometry(shape, kernel, stride, pad, out_hw)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, CH, CW = g
    _check_size(x, N * C * H * W, "x")
    _check_size(dx, N * C * H * W, "dx")
    _check_size(dy, N * C * PH * PW, "dy")
    if not is_cupy_array(x):
        return _np_backward(x, dy, dx, storage, g)
    xw, dyw, dxw = _words(x, storage), _words(dy, storage), _words(dx, storage)
    v = _width(C, xw, dyw, dxw)
    n = N * CH * CW * (C // v)
    wide, nn = _idx(n, xw.size)
    launch(_kernel(storage, v, wide, "mc_max_pool16_bwd"), n,
           (nn, xw, dyw, dxw) + _i32(H, W, C // v, PH, PW, CH, CW, kh, kw, sh, sw,
                                               ph, pw))
    return dx
