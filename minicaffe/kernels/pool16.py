"""MAX and AVE pooling of channels-last 2-byte maps (issue 20).

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

Overlapping windows (stride < kernel: ResNet's 3x3/2, CIFAR-10 quick's) and AVE, Caffe's
CEIL geometry and padding (a FLOOR layer's ``out_hw``), in fp32 and rounded once:

- MAX with an argmax byte (``max_pool_forward_argmax``/``max_pool_backward_argmax``): the
  forward selects as above and writes y and, per output element and channel, one byte:
  the window offset k = i*kw + j of the selected input (255: none; kernels with
  kh*kw > 255 are refused).  The backward is a gather, one thread per (input pixel, V
  channels): over the windows covering it (Caffe's phstart/phend), in Caffe's order (p,
  then q, ascending), the fp32 sum of dy where the byte names this input, rounded once.
  It reads neither x nor y (a later layer may rewrite y in place: CIFAR's pool1).
- AVE (``ave_pool_forward``/``ave_pool_backward``): Caffe's pool_size (the window clipped
  to [-pad, H + pad)), the fp32 sum of the window clipped to the image in row order
  divided by it; the backward the gather of dy / pool_size over the covering windows,
  in Caffe's order; each rounded once (to nearest even; a bf16 NaN made quiet, as
  kernels/vec16.py's stores).

Arrays are a BFLOAT16 buffer's uint16 words or a FLOAT16 one's float16 (``storage``), any
shape, holding N, H, W, C (x, dx) or N, PH, PW, C (y, dy) contiguously; ``shape`` is the
logical (N, C, H, W); ``nchw=True``: they hold N, C, H, W instead (2-byte maps the engine
holds NCHW: the kernels see N*C images of one channel).  The argmax bytes are N, PH, PW,
C in either case (uint8, what ``argmax_bytes`` counts), so a backward whose maps are held
otherwise than its forward's reads them right.  numpy arrays run a numpy body with the
same results (the CPU tests and the GPU tests' reference), CuPy arrays the kernels.
"""
import functools

import numpy as np

from ..core import precision as P
from ._backend import as_pair, is_cupy_array, launch, raw_kernel

__all__ = ["disjoint", "output_shape", "max_pool_forward", "max_pool_backward",
           "max_pool_forward_argmax", "max_pool_backward_argmax", "ave_pool_forward",
           "ave_pool_backward", "argmax_bytes", "MAX_ARGMAX_WINDOW"]

# the largest window (kh * kw) the argmax byte can name: offsets 0..254, 255 for none
MAX_ARGMAX_WINDOW = 255


def disjoint(kernel, stride):
    """True when no two pooling windows share an input: stride >= kernel on both axes."""
    kh, kw = as_pair(kernel, "kernel")
    sh, sw = as_pair(stride, "stride")
    return sh >= kh and sw >= kw


def output_shape(H, W, kernel, stride, pad):
    """Caffe's CEIL geometry (kernels/pooling.py's ``pool_output_shape``)."""
    from .pooling import pool_output_shape
    return pool_output_shape(H, W, kernel, stride, pad)


def _geometry(shape, kernel, stride, pad, out_hw, overlap=False):
    N, C, H, W = (int(v) for v in shape)
    kh, kw = as_pair(kernel, "kernel")
    sh, sw = as_pair(stride, "stride")
    ph, pw = as_pair(pad, "pad")
    if not overlap and not disjoint((kh, kw), (sh, sw)):
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
    Hp, Wp = max(CH * sh, (PH - 1) * sh + kh), max(CW * sw, (PW - 1) * sw + kw)
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


def _np_store(f, storage):
    """The 2-byte words of the float32 values ``f``, rounded as the kernels' ``mc_st``
    (kernels/vec16.py: to nearest even; a bf16 NaN keeps its sign and payload, made
    quiet)."""
    f = np.ascontiguousarray(f, np.float32)
    if storage == P.FLOAT16:
        with np.errstate(over="ignore", invalid="ignore"):
            return f.astype(np.float16).view(np.uint16)
    u = f.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    q = ((u >> 16) | np.uint32(0x40)).astype(np.uint16)
    return np.where((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), q, r)


def _np_windows(PH, PW, sh, sw, i, j):
    """The padded map's inputs at offset (i, j) of every window: (N, PH, PW, C)."""
    return (slice(None), slice(i, i + sh * (PH - 1) + 1, sh), slice(j, j + sw * (PW - 1) + 1, sw))


def _np_gather(terms, g):
    """dx (N, H, W, C float32): per input the sum of ``terms(i, j)`` (N, PH, PW, C float32,
    0 where the window at offset (i, j) gives it nothing) over the windows covering it,
    in Caffe's order (p, then q, ascending: i, then j, descending)."""
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g[:12]
    Hp, Wp = max(ph + H, (PH - 1) * sh + kh), max(pw + W, (PW - 1) * sw + kw)
    dxp = np.zeros((N, Hp, Wp, C), np.float32)
    for i in reversed(range(kh)):
        for j in reversed(range(kw)):
            dxp[_np_windows(PH, PW, sh, sw, i, j)] += terms(i, j)
    return dxp[:, ph:ph + H, pw:pw + W]


def _np_pool_size(g):
    """Caffe's AVE divisor per window (PH, PW, 1), float32."""
    from .pooling import _ave_pool_size
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g[:12]
    return _ave_pool_size(H, W, kh, kw, sh, sw, ph, pw, PH, PW).astype(np.float32)[..., None]


def _np_argmax_forward(x, y, mask, storage, g):
    N, C, H, W = g[:4]
    best, idx = _np_select(_words(x, storage).reshape(N, H, W, C), g, storage)
    _words(y, storage)[...] = best.reshape(-1)
    mask.reshape(-1)[...] = np.where(idx < 0, 255, idx).astype(np.uint8).reshape(-1)


def _np_argmax_backward(dy, mask, dx, storage, g):
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g[:12]
    d = _np_float(_words(dy, storage), storage).reshape(N, PH, PW, C)
    m = mask.reshape(N, PH, PW, C)
    dxf = _np_gather(lambda i, j: np.where(m == i * kw + j, d, np.float32(0)), g)
    _words(dx, storage)[...] = _np_store(dxf, storage).reshape(-1)


def _np_ave_forward(x, y, storage, g):
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g[:12]
    Hp, Wp = max(ph + H, (PH - 1) * sh + kh), max(pw + W, (PW - 1) * sw + kw)
    xp = np.zeros((N, Hp, Wp, C), np.float32)           # padding adds +0.0: no change
    xp[:, ph:ph + H, pw:pw + W] = _np_float(_words(x, storage), storage).reshape(N, H, W, C)
    s = np.zeros((N, PH, PW, C), np.float32)
    for i in range(kh):                                 # the window's rows, in order
        for j in range(kw):
            s += xp[_np_windows(PH, PW, sh, sw, i, j)]
    _words(y, storage)[...] = _np_store(s / _np_pool_size(g), storage).reshape(-1)


def _np_ave_backward(dy, dx, storage, g):
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g[:12]
    t = _np_float(_words(dy, storage), storage).reshape(N, PH, PW, C) / _np_pool_size(g)
    dxf = _np_gather(lambda i, j: t, g)
    _words(dx, storage)[...] = _np_store(dxf, storage).reshape(-1)


# -- CUDA ------------------------------------------------------------------------------------
_VT = {8: "uint4", 4: "uint2", 2: "unsigned int", 1: "unsigned short"}
_MT = {8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}   # V bytes

_SRC = r"""
#define V {V}
typedef {VT} VT;
typedef {MT} MT;
typedef {IDX} IDX;     // int where every index fits: 32-bit divisions are cheaper
#define MC_LOOP(i, n) \
  for (IDX i = (IDX)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (IDX)blockDim.x * gridDim.x)
// thread i's image nn, place (r, c) in an R x S grid and channels cv*V.. (CV per place;
// the kernel's CV in scope)
#define MC_DECODE(i, R, S, r, c) \
    const int cv = (int)((i) % CV); \
    IDX t = (i) / CV; \
    const int c = (int)(t % (S)); \
    t /= (S); \
    const int r = (int)(t % (R)); \
    const IDX nn = t / (R);
// the window of output (p, q) of a kh x kw window: its corner (h0, w0) in the padded map,
// its inputs' rows [hs, he) and columns [ws, we) (clipped to the image; the kernel's
// H, W, sh, sw, ph, pw in scope)
#define MC_WINDOW(p, q, kh, kw) \
  const int h0 = (p) * sh - ph, w0 = (q) * sw - pw; \
  const int hs = max(h0, 0), ws = max(w0, 0); \
  const int he = min(h0 + (kh), H), we = min(w0 + (kw), W);
union MCVec { VT v; unsigned short h[V]; };
union MCMask { MT v; unsigned char b[V]; };
#define MC_NEG_INF {NEG_INF}
#define MC_BF16 {BF16}
{LD16}{ST16}
// the window (p, q) of image nn: per lane, the selected word and its offset i*kw+j (-1)
__device__ __forceinline__ void mc_select(
    const VT* __restrict__ x, const IDX nn, const int cv, const int H, const int W,
    const int CV, const int p, const int q, const int kh, const int kw, const int sh,
    const int sw, const int ph, const int pw, unsigned short* best, int* idx) {
  float m[V];
#pragma unroll
  for (int l = 0; l < V; ++l) { m[l] = -MC_FLT_MAX; best[l] = MC_NEG_INF; idx[l] = -1; }
  MC_WINDOW(p, q, kh, kw)
  const VT* xb = x + nn * H * W * CV + cv;
  for (int h = hs; h < he; ++h) {
    for (int w = ws; w < we; ++w) {
      MCVec u;
      u.v = xb[((IDX)h * W + w) * CV];
      const int k = (h - h0) * kw + (w - w0);
#pragma unroll
      for (int l = 0; l < V; ++l) {
        const float v = mc_ld(u.h[l]);
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
    MC_DECODE(i, PH, PW, p, q)
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
    MC_DECODE(i, CH, CW, p, q)
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
    MC_WINDOW(p, q, sh, sw)          // the cell: the window's stride x stride corner
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

// Caffe's AVE divisor of window (p, q): the window clipped to [-pad, H + pad)
__device__ __forceinline__ float mc_pool_size(const int p, const int q, const int H,
                                              const int W, const int kh, const int kw,
                                              const int sh, const int sw, const int ph,
                                              const int pw) {
  const int hs = p * sh - ph, ws = q * sw - pw;
  const int he = min(hs + kh, H + ph), we = min(ws + kw, W + pw);
  return (float)((he - hs) * (we - ws));
}

// the argmax bytes of window (p, q), channels cv*V.. of image nn: N, PH, PW, C in memory
// whatever the maps' layout (CM > 1: the maps are NCHW, image nn is channel nn % CM of
// image nn / CM, V = CV = 1)
__device__ __forceinline__ IDX mc_mask_at(const IDX nn, const int p, const int q,
                                          const int cv, const int PH, const int PW,
                                          const int CM, const int CV) {
  if (CM == 1) return ((nn * PH + p) * PW + q) * CV + cv;
  return (((nn / CM) * PH + p) * PW + q) * CM + nn % CM;
}

extern "C" __global__ void mc_max_pool16_argmax_fwd(
    const IDX n, const VT* __restrict__ x, VT* __restrict__ y, MT* __restrict__ mask,
    const int H, const int W, const int CV, const int PH, const int PW, const int CM,
    const int kh, const int kw, const int sh, const int sw, const int ph, const int pw) {
  MC_LOOP(i, n) {
    MC_DECODE(i, PH, PW, p, q)
    unsigned short best[V];
    int idx[V];
    mc_select(x, nn, cv, H, W, CV, p, q, kh, kw, sh, sw, ph, pw, best, idx);
    MCVec o;
    MCMask m;
#pragma unroll
    for (int l = 0; l < V; ++l) {
      o.h[l] = best[l];
      m.b[l] = idx[l] < 0 ? (unsigned char)255 : (unsigned char)idx[l];
    }
    y[i] = o.v;
    mask[mc_mask_at(nn, p, q, cv, PH, PW, CM, CV)] = m.v;
  }
}

// the windows covering input row (column) h: p in [p0, p1), Caffe's formulas
#define MC_COVER(h, ph, kh, sh, PH, p0, p1) \
  const int p0 = ((h) + (ph) < (kh)) ? 0 : ((h) + (ph) - (kh)) / (sh) + 1; \
  const int p1 = min(((h) + (ph)) / (sh) + 1, (PH));

extern "C" __global__ void mc_max_pool16_argmax_bwd(
    const IDX n, const VT* __restrict__ dy, const MT* __restrict__ mask,
    VT* __restrict__ dx, const int H, const int W, const int CV, const int PH,
    const int PW, const int CM, const int kh, const int kw, const int sh, const int sw,
    const int ph, const int pw) {
  MC_LOOP(i, n) {
    MC_DECODE(i, H, W, h, w)
    MC_COVER(h, ph, kh, sh, PH, p0, p1)
    MC_COVER(w, pw, kw, sw, PW, q0, q1)
    float g[V];
#pragma unroll
    for (int l = 0; l < V; ++l) g[l] = 0.f;
    for (int p = p0; p < p1; ++p) {
      for (int q = q0; q < q1; ++q) {
        const int k = (h + ph - p * sh) * kw + (w + pw - q * sw);
        MCMask m;
        m.v = mask[mc_mask_at(nn, p, q, cv, PH, PW, CM, CV)];
        bool any = false;
#pragma unroll
        for (int l = 0; l < V; ++l) any |= (m.b[l] == k);
        if (!any) continue;
        MCVec d;
        d.v = dy[((nn * PH + p) * PW + q) * CV + cv];
#pragma unroll
        for (int l = 0; l < V; ++l)
          if (m.b[l] == k) g[l] += mc_ld(d.h[l]);
      }
    }
    MCVec o;
#pragma unroll
    for (int l = 0; l < V; ++l) o.h[l] = mc_st(g[l]);
    dx[i] = o.v;
  }
}

extern "C" __global__ void mc_ave_pool16_fwd(
    const IDX n, const VT* __restrict__ x, VT* __restrict__ y, const int H,
    const int W, const int CV, const int PH, const int PW, const int kh, const int kw,
    const int sh, const int sw, const int ph, const int pw) {
  MC_LOOP(i, n) {
    MC_DECODE(i, PH, PW, p, q)
    const float size = mc_pool_size(p, q, H, W, kh, kw, sh, sw, ph, pw);
    MC_WINDOW(p, q, kh, kw)     // (pad >= 0: min(he, H + ph, H) is min(he, H))
    float s[V];
#pragma unroll
    for (int l = 0; l < V; ++l) s[l] = 0.f;
    const VT* xb = x + nn * H * W * CV + cv;
    for (int hh = hs; hh < he; ++hh) {
      for (int ww = ws; ww < we; ++ww) {
        MCVec u;
        u.v = xb[((IDX)hh * W + ww) * CV];
#pragma unroll
        for (int l = 0; l < V; ++l) s[l] += mc_ld(u.h[l]);
      }
    }
    MCVec o;
#pragma unroll
    for (int l = 0; l < V; ++l) o.h[l] = mc_st(s[l] / size);
    y[i] = o.v;
  }
}

extern "C" __global__ void mc_ave_pool16_bwd(
    const IDX n, const VT* __restrict__ dy, VT* __restrict__ dx, const int H,
    const int W, const int CV, const int PH, const int PW, const int kh, const int kw,
    const int sh, const int sw, const int ph, const int pw) {
  MC_LOOP(i, n) {
    MC_DECODE(i, H, W, h, w)
    MC_COVER(h, ph, kh, sh, PH, p0, p1)
    MC_COVER(w, pw, kw, sw, PW, q0, q1)
    float g[V];
#pragma unroll
    for (int l = 0; l < V; ++l) g[l] = 0.f;
    for (int p = p0; p < p1; ++p) {
      for (int q = q0; q < q1; ++q) {
        const float size = mc_pool_size(p, q, H, W, kh, kw, sh, sw, ph, pw);
        MCVec d;
        d.v = dy[((nn * PH + p) * PW + q) * CV + cv];
#pragma unroll
        for (int l = 0; l < V; ++l) g[l] += mc_ld(d.h[l]) / size;
      }
    }
    MCVec o;
#pragma unroll
    for (int l = 0; l < V; ++l) o.h[l] = mc_st(g[l]);
    dx[i] = o.v;
  }
}
"""


def _width(C, *arrays):
    """The widest V in (8, 4, 2, 1) dividing C with every array aligned to V elements
    (2V bytes for the 2-byte words, V for the argmax bytes)."""
    for v in (8, 4, 2, 1):
        if C % v == 0 and all(a.data.ptr % (a.dtype.itemsize * v) == 0 for a in arrays):
            return v
    return 1


@functools.lru_cache(maxsize=None)
def _kernel(storage, v, wide, name):
    """The kernel ``name`` for ``storage``, V = ``v`` lanes, 64-bit indices if ``wide``."""
    from .vec16 import LD16, ST16
    src = (_SRC.replace("{V}", str(v)).replace("{VT}", _VT[v]).replace("{MT}", _MT[v])
           .replace("{IDX}", "long long" if wide else "int")
           .replace("{NEG_INF}", hex(_NEG_INF[storage]))
           .replace("{LD16}", LD16).replace("{ST16}", ST16)
           .replace("{BF16}", "1" if storage == P.BFLOAT16 else "0"))
    return raw_kernel(src, name, "float")


def _idx(n, *sizes):
    """(whether 64-bit indices are needed, the loop count as the kernel's index type)."""
    wide = max((n,) + sizes) + (1 << 20) * 256 >= 1 << 31
    return wide, (np.int64(n) if wide else np.int32(n))


def _i32(*vals):
    return tuple(np.int32(v) for v in vals)


def _launch16(name, storage, N, C, pixels, arrays, H, W, *rest):
    """Launch kernel ``name`` with one thread per (image of N, pixel of ``pixels``, V
    channels of C) on ``arrays`` (the 2-byte words and argmax bytes; V the widest they
    allow), passing H, W, C / V and ``rest``."""
    v = _width(C, *arrays)
    n = N * pixels * (C // v)
    wide, nn = _idx(n, max(a.size for a in arrays))
    launch(_kernel(storage, v, wide, name), n, (nn,) + tuple(arrays) + _i32(H, W, C // v, *rest))


def _fold(N, C, nchw):
    """(images, channels, channels folded into each image: the argmax kernels' CM) of maps
    held N, H, W, C, or N, C, H, W (``nchw``: N*C images of one channel)."""
    return (N * C, 1, C) if nchw else (N, C, 1)


def max_pool_forward(x, y, shape, kernel, stride, pad, storage, out_hw=None, nchw=False):
    """``y`` (N, PH, PW, C words) = the MAX pooling of ``x`` (N, H, W, C words of
    ``storage``, ``shape`` = (N, C, H, W)) over disjoint windows; ``out_hw``: (PH, PW)
    when not Caffe's CEIL geometry (a FLOOR layer's); ``nchw``: both held N, C, H, W.
    Returns ``y``."""
    g = _geometry(shape, kernel, stride, pad, out_hw)
    if nchw:       # N*C images of one channel: the same windows
        g = _folded(g)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, CH, CW = g
    _check_size(x, N * C * H * W, "x")
    _check_size(y, N * C * PH * PW, "y")
    if not is_cupy_array(x):
        return _np_forward(x, y, storage, g)
    _launch16("mc_max_pool16_fwd", storage, N, C, PH * PW,
              (_words(x, storage), _words(y, storage)), H, W, PH, PW, kh, kw, sh, sw, ph, pw)
    return y


def max_pool_backward(x, dy, dx, shape, kernel, stride, pad, storage, out_hw=None,
                      nchw=False):
    """``dx`` (N, H, W, C words) = ``dy`` (N, PH, PW, C) routed to each window's argmax in
    ``x`` (the forward's input), 0 elsewhere; every input is written.  Returns ``dx``."""
    g = _geometry(shape, kernel, stride, pad, out_hw)
    if nchw:
        g = _folded(g)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW, CH, CW = g
    _check_size(x, N * C * H * W, "x")
    _check_size(dx, N * C * H * W, "dx")
    _check_size(dy, N * C * PH * PW, "dy")
    if not is_cupy_array(x):
        return _np_backward(x, dy, dx, storage, g)
    _launch16("mc_max_pool16_bwd", storage, N, C, CH * CW,
              (_words(x, storage), _words(dy, storage), _words(dx, storage)),
              H, W, PH, PW, CH, CW, kh, kw, sh, sw, ph, pw)
    return dx


# -- overlapping windows (MAX with argmax bytes) and AVE -------------------------------------
def argmax_bytes(shape, out_hw):
    """Bytes of the argmax buffer of a MAX pooling of ``shape`` (N, C, H, W) into
    ``out_hw`` (PH, PW): one per output element and channel."""
    return int(shape[0]) * int(shape[1]) * int(out_hw[0]) * int(out_hw[1])


def _folded(g):
    """The geometry of NCHW maps seen as N*C images of one channel held N, H, W, C."""
    N, C = g[:2]
    return (N * C, 1) + tuple(g[2:])


def _to_nhwc(a, N, C, H, W):
    """numpy: the NCHW words of ``a`` as a contiguous NHWC array of the buffer's type."""
    return np.ascontiguousarray(a.reshape(N, C, H, W).transpose(0, 2, 3, 1))


def _from_nhwc(src, dst, N, C, H, W):
    dst.reshape(N, C, H, W)[...] = src.reshape(N, H, W, C).transpose(0, 3, 1, 2)


def _np_call(body, g, nchw, ins, outs, storage):
    """Run the numpy ``body(*ins, *outs, storage, g)`` on NHWC arrays: ``ins``/``outs``
    [(array, (H, W) of the map or None for the argmax bytes)] converted from and to NCHW
    when ``nchw``."""
    if not nchw:
        body(*[a for a, _ in ins], *[a for a, _ in outs], storage, g)
        return
    N, C = g[:2]
    cv = [a if hw is None else _to_nhwc(a, N, C, *hw) for a, hw in ins]
    co = [a if hw is None else np.empty_like(a) for a, hw in outs]
    body(*cv, *co, storage, g)
    for (a, hw), c in zip(outs, co):
        if hw is not None:
            _from_nhwc(c, a, N, C, *hw)


def _check_mask(mask, n):
    if mask.dtype != np.uint8:
        raise TypeError(f"the argmax bytes are uint8, got {mask.dtype}")
    _check_size(mask, n, "argmax")


def _overlap_geometry(shape, kernel, stride, pad, out_hw, argmax):
    g = _geometry(shape, kernel, stride, pad, out_hw, overlap=True)
    if argmax and g[4] * g[5] > MAX_ARGMAX_WINDOW:
        raise ValueError(f"kernel {g[4:6]}: a window of {g[4] * g[5]} inputs, more than "
                         f"the argmax byte names ({MAX_ARGMAX_WINDOW})")
    return g


def max_pool_forward_argmax(x, y, mask, shape, kernel, stride, pad, storage, out_hw=None,
                            nchw=False):
    """``y`` = the MAX pooling of ``x`` over any windows (overlapping too), and ``mask``
    (uint8, ``argmax_bytes`` of them, N, PH, PW, C) = each selection's window offset
    i*kw + j (255: none).  Same rule and bits as ``max_pool_forward``.  Returns ``y``."""
    g = _overlap_geometry(shape, kernel, stride, pad, out_hw, True)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g[:12]
    _check_size(x, N * C * H * W, "x")
    _check_size(y, N * C * PH * PW, "y")
    _check_mask(mask, N * C * PH * PW)
    if not is_cupy_array(x):
        _np_call(_np_argmax_forward, g, nchw, [(x, (H, W))], [(y, (PH, PW)), (mask, None)],
                 storage)
        return y
    N, C, cm = _fold(N, C, nchw)
    _launch16("mc_max_pool16_argmax_fwd", storage, N, C, PH * PW,
              (_words(x, storage), _words(y, storage), mask.reshape(-1)),
              H, W, PH, PW, cm, kh, kw, sh, sw, ph, pw)
    return y


def max_pool_backward_argmax(dy, mask, dx, shape, kernel, stride, pad, storage, out_hw=None,
                             nchw=False):
    """``dx`` (every input written) = per input the fp32 sum, in Caffe's window order, of
    ``dy`` over the windows whose argmax byte (``max_pool_forward_argmax``'s ``mask``)
    names it, rounded once.  Reads neither x nor y.  Returns ``dx``."""
    g = _overlap_geometry(shape, kernel, stride, pad, out_hw, True)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g[:12]
    _check_size(dx, N * C * H * W, "dx")
    _check_size(dy, N * C * PH * PW, "dy")
    _check_mask(mask, N * C * PH * PW)
    if not is_cupy_array(dy):
        _np_call(_np_argmax_backward, g, nchw, [(dy, (PH, PW)), (mask, None)],
                 [(dx, (H, W))], storage)
        return dx
    N, C, cm = _fold(N, C, nchw)
    _launch16("mc_max_pool16_argmax_bwd", storage, N, C, H * W,
              (_words(dy, storage), mask.reshape(-1), _words(dx, storage)),
              H, W, PH, PW, cm, kh, kw, sh, sw, ph, pw)
    return dx


def ave_pool_forward(x, y, shape, kernel, stride, pad, storage, out_hw=None, nchw=False):
    """``y`` = Caffe's AVE pooling of ``x`` (see the module docstring).  Returns ``y``."""
    g = _overlap_geometry(shape, kernel, stride, pad, out_hw, False)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g[:12]
    _check_size(x, N * C * H * W, "x")
    _check_size(y, N * C * PH * PW, "y")
    if nchw:       # N*C images of one channel: the same sums
        g = _folded(g)
        N, C = g[:2]
    if not is_cupy_array(x):
        _np_ave_forward(x, y, storage, g)
        return y
    _launch16("mc_ave_pool16_fwd", storage, N, C, PH * PW,
              (_words(x, storage), _words(y, storage)), H, W, PH, PW, kh, kw, sh, sw, ph, pw)
    return y


def ave_pool_backward(dy, dx, shape, kernel, stride, pad, storage, out_hw=None, nchw=False):
    """``dx`` (every input written) = per input the fp32 sum of dy / pool_size over the
    windows covering it, in Caffe's order, rounded once.  Returns ``dx``."""
    g = _overlap_geometry(shape, kernel, stride, pad, out_hw, False)
    N, C, H, W, kh, kw, sh, sw, ph, pw, PH, PW = g[:12]
    _check_size(dx, N * C * H * W, "dx")
    _check_size(dy, N * C * PH * PW, "dy")
    if nchw:
        g = _folded(g)
        N, C = g[:2]
    if not is_cupy_array(dy):
        _np_ave_backward(dy, dx, storage, g)
        return dx
    _launch16("mc_ave_pool16_bwd", storage, N, C, H * W,
              (_words(dy, storage), _words(dx, storage)), H, W, PH, PW, kh, kw, sh, sw, ph, pw)
    return dx
