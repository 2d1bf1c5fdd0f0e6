"""The filter and bias gradients of a convolution over few input channels, on
channels-last 2-byte maps (issue 20).

A first convolution over one or a few input channels (LeNet's conv1: 1 -> 20, 5x5) is a
poor fit for cuDNN's channels-last tensor-core kernels, which want C a multiple of 8:
cuDNN pads the input and the gradient itself at every call (``nhwcAddPaddingKernel`` and
a memset per call), and LeNet b64 bf16's filter gradient took a 53 us implicit-GEMM
kernel of a 0.27 ms step (H100).  The work is small -- K*C*R*S sums over N*P*Q
positions -- so ``backward_filter`` does it in two plain kernels, the bias gradient with
it (a separate reduction before):

- the output positions N*P*Q split into ``blocks(...)`` contiguous chunks, a block per
  chunk, one thread per gradient element (k, c, r, s) and per bias element k, each
  summing its chunk's products in position order in fp32 (inputs outside the image count
  as zeros: Caffe's im2col);
- a second kernel adds the chunks' sums in chunk order to the fp32 diffs (dW += ...,
  db += ...: Caffe accumulates).  Deterministic, no atomics.

The convolution layer times it against cuDNN's filter-gradient algorithms and takes it
where faster (layers/cudnn_layers.py, ``DIRECT``).  (A direct forward kernel, one thread
per output pixel, was written too and dropped: cuDNN's forward was faster on every shape
measured, LeNet's conv1 0.0135 against 0.052 ms, H100.)

Every multiply and add is rounded on its own (NVRTC_OPTIONS: ``--fmad=false``), so the
numpy body, which does the same operations in the same order, gives the same bits: it is
the CPU tests' reference of Caffe's formulas and the GPU tests' reference of the kernels.

Arrays: ``x`` N, H, W, C and ``dy`` N, P, Q, K of a BFLOAT16 buffer's uint16 words or a
FLOAT16 one's float16 (``storage``); ``dw`` the fp32 K, C, R, S diff of the master
weights; ``db`` fp32 K.  ``geom`` is (N, C, H, W, K, R, S, stride, pad, dilation) with
pairs for the last three.  numpy arrays run the numpy body, CuPy arrays the kernels.
"""
import functools

import numpy as np

from ..core import precision as P
from ._backend import as_pair, is_cupy_array, raw_kernel
from .pool16 import _np_float
from .vec16 import LD16

__all__ = ["applies", "fits", "output_hw", "blocks", "partial_size", "backward_filter",
           "MAX_C", "MAX_CRS", "MAX_WEIGHTS"]

# what the kernels take: few input channels, a filter whose gradient a block holds
MAX_C, MAX_CRS, MAX_WEIGHTS = 4, 128, 8192
# the filter gradient's chunks: at most MAX_BLOCKS, each of at least MIN_CHUNK positions
MAX_BLOCKS, MIN_CHUNK = 256, 64
_THREADS = 256


def applies(x_shape, num_output, kernel, group=1):
    """True when these kernels compute the convolution: 2-D, ungrouped, at most MAX_C
    input channels, C*R*S <= MAX_CRS and K*C*R*S <= MAX_WEIGHTS."""
    if len(x_shape) != 4 or len(tuple(kernel)) != 2 or group != 1:
        return False
    c = int(x_shape[1])
    crs = c * int(np.prod(kernel))
    return c <= MAX_C and crs <= MAX_CRS and crs * int(num_output) <= MAX_WEIGHTS


def fits(geom):
    """True when the kernels' 32-bit indices cover ``geom``'s maps (N*P*Q*K and
    N*H*W*C, with room)."""
    g = _geom(geom)
    N, C, H, W, K = g[:5]
    Pn, Q = g[13:]
    return max(N * Pn * Q * max(K, 1), N * H * W * C) * 2 < 1 << 31


def _geom(geom):
    N, C, H, W, K, R, S, stride, pad, dilation = geom
    sh, sw = as_pair(stride, "stride")
    ph, pw = as_pair(pad, "pad")
    dh, dw = as_pair(dilation, "dilation")
    Pn = (H + 2 * ph - (dh * (R - 1) + 1)) // sh + 1
    Q = (W + 2 * pw - (dw * (S - 1) + 1)) // sw + 1
    return tuple(int(v) for v in (N, C, H, W, K, R, S, sh, sw, ph, pw, dh, dw, Pn, Q))


def output_hw(geom):
    """(P, Q): Caffe's convolution output size."""
    return _geom(geom)[-2:]


def blocks(npq):
    """(number of chunks, positions per chunk) of the filter gradient over ``npq``
    output positions: a function of the shape only, so the numpy body sums alike."""
    g = max(1, min(MAX_BLOCKS, -(-npq // MIN_CHUNK)))
    chunk = -(-npq // g)
    return -(-npq // chunk), chunk


def partial_size(geom):
    """fp32 words of the filter gradient's per-chunk sums for ``geom``."""
    g = _geom(geom)
    N, C, K, R, S, Pn, Q = g[0], g[1], g[4], g[5], g[6], g[13], g[14]
    return blocks(N * Pn * Q)[0] * (K * C * R * S + K)


def _words(a, storage, n, what):
    dt = P.buffer_dtype(storage)
    if a.dtype != dt:
        raise TypeError(f"{what}: a {storage} buffer is held in {dt}, got {a.dtype}")
    if a.size != n:
        raise ValueError(f"{what} holds {a.size} values, expected {n}")
    return a.reshape(-1)


def _f32(a, what, n):
    if a.dtype != np.float32 or a.size != n:
        raise ValueError(f"{what}: expected {n} float32 values, got {a.size} {a.dtype}")
    return a.reshape(-1)


# -- numpy bodies ------------------------------------------------------------------------
def _np_patches(x, g):
    """(N, P, Q, C*R*S) fp32: each output position's inputs in (c, r, s) order, zeros
    outside the image."""
    N, C, H, W, K, R, S, sh, sw, ph, pw, dh, dw, Pn, Q = g
    xp = np.zeros((N, H + 2 * ph + dh * R, W + 2 * pw + dw * S, C), np.float32)
    xp[:, ph:ph + H, pw:pw + W] = x
    out = np.empty((N, Pn, Q, C, R, S), np.float32)
    for r in range(R):
        for s in range(S):
            out[:, :, :, :, r, s] = xp[:, r * dh:r * dh + sh * (Pn - 1) + 1:sh,
                                       s * dw:s * dw + sw * (Q - 1) + 1:sw]
    return out.reshape(N, Pn, Q, C * R * S)


def _np_backward_filter(x, dy, dw, db, storage, g):
    N, C, H, W, K, R, S = g[:7]
    Pn, Q = g[13:]
    crs = C * R * S
    npq = N * Pn * Q
    nb, chunk = blocks(npq)
    cols = _np_patches(_np_float(x, storage).reshape(N, H, W, C), g).reshape(npq, crs)
    d = _np_float(dy, storage).reshape(npq, K)
    pad = nb * chunk - npq
    cols = np.concatenate([cols, np.zeros((pad, crs), np.float32)]).reshape(nb, chunk, crs)
    d = np.concatenate([d, np.zeros((pad, K), np.float32)]).reshape(nb, chunk, K)
    valid = (np.arange(nb)[:, None] * chunk + np.arange(chunk)[None, :]) < npq
    accw = np.zeros((nb, K, crs), np.float32)
    accb = np.zeros((nb, K), np.float32)
    for t in range(chunk):              # each chunk's positions in order
        v = valid[:, t]
        accw = np.where(v[:, None, None], accw + d[:, t, :, None] * cols[:, t, None, :], accw)
        accb = np.where(v[:, None], accb + d[:, t], accb)
    sw_, sb = np.zeros((K, crs), np.float32), np.zeros(K, np.float32)
    for i in range(nb):                 # the chunks in order
        sw_ = sw_ + accw[i]
        sb = sb + accb[i]
    if dw is not None:
        f = dw.reshape(-1)
        f[...] = f + sw_.reshape(-1)
    if db is not None:
        f = db.reshape(-1)
        f[...] = f + sb
    return dw, db


# -- CUDA ----------------------------------------------------------------------------------
_SRC = r"""
#define C {C}
#define R {R}
#define S {S}
#define K {K}
#define CRS (C * R * S)
#define SH {SH}
#define SW {SW}
#define PH {PH}
#define PW {PW}
#define DH {DH}
#define DW {DW}
#define TP {TP}
#define EPT {EPT}
#define NE (K * CRS + K)
// per chunk of output positions: the sums of dy[k] * x[c, r, s] (e < K*CRS) and dy[k]
extern "C" __global__ void mc_conv16_wgrad(const unsigned short* __restrict__ x,
    const unsigned short* __restrict__ dy, float* __restrict__ partial,
    int N, int H, int W, int P, int Q, unsigned int npq, unsigned int chunk) {
  __shared__ float sd[TP * K];
  __shared__ float sx[TP * CRS];
  const unsigned int beg = blockIdx.x * chunk;
  const unsigned int end = min(beg + chunk, npq);
  float acc[EPT];
#pragma unroll
  for (int j = 0; j < EPT; ++j) acc[j] = 0.0f;
  for (unsigned int t0 = beg; t0 < end; t0 += TP) {
    const int nt = (int)min((unsigned int)TP, end - t0);
    for (int i = threadIdx.x; i < nt * K; i += blockDim.x) sd[i] = mc_ld(dy[t0 * K + i]);
    for (int i = threadIdx.x; i < nt * CRS; i += blockDim.x) {
      const int tt = i / CRS, e = i - tt * CRS;
      const int c = e / (R * S), rs = e - c * (R * S), r = rs / S, s = rs - r * S;
      const unsigned int pos = t0 + tt;
      const unsigned int np_ = pos / (unsigned int)Q, q = pos - np_ * Q;
      const unsigned int n = np_ / (unsigned int)P, p = np_ - n * P;
      const int ih = (int)p * SH - PH + r * DH, iw = (int)q * SW - PW + s * DW;
      sx[i] = (ih >= 0 && ih < H && iw >= 0 && iw < W)
          ? mc_ld(x[((n * H + ih) * W + iw) * C + c]) : 0.0f;
    }
    __syncthreads();
    // (elements outer, positions inner: on LeNet b64's conv1 (H100) 16.8 us a step; the
    // loops the other way round, with each thread's sums interleaved, took 26.6)
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const int e = threadIdx.x + j * blockDim.x;
      if (e < K * CRS) {
        const int k = e / CRS, f = e - k * CRS;
        for (int tt = 0; tt < nt; ++tt) acc[j] = acc[j] + sd[tt * K + k] * sx[tt * CRS + f];
      } else if (e < NE) {
        const int k = e - K * CRS;
        for (int tt = 0; tt < nt; ++tt) acc[j] = acc[j] + sd[tt * K + k];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    const int e = threadIdx.x + j * blockDim.x;
    if (e < NE) partial[blockIdx.x * NE + e] = acc[j];
  }
}

// dw[e] += the chunks' sums in order (e < K*CRS), db[k] likewise; mode 1: dw, 2: db
extern "C" __global__ void mc_conv16_wgrad_sum(const float* __restrict__ partial, int nb,
    float* __restrict__ dw, float* __restrict__ db, int mode) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= NE) return;
  const bool bias = e >= K * CRS;
  if (!(mode & (bias ? 2 : 1))) return;
  float s = 0.0f;
#pragma unroll 32
  for (int i = 0; i < nb; ++i) s = s + partial[i * NE + e];
  if (bias) db[e - K * CRS] = db[e - K * CRS] + s;
  else dw[e] = dw[e] + s;
}
"""


@functools.lru_cache(maxsize=None)
def _module(storage, C, R, S, K, sh, sw, ph, pw, dh, dw_):
    crs = C * R * S
    tp = max(1, min(64, 8192 // (K + crs)))          # a tile of positions: <= 32 KiB
    ept = -(-(K * crs + K) // _THREADS)
    vals = dict(C=C, R=R, S=S, K=K, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw_,
                TP=tp, EPT=ept)
    src = "#define MC_BF16 %d\n" % (storage == P.BFLOAT16) + LD16 + _SRC
    for k, v in vals.items():
        src = src.replace("{%s}" % k, str(v))
    return {n: raw_kernel(src, n, "float")
            for n in ("mc_conv16_wgrad", "mc_conv16_wgrad_sum")}


def _kernels(storage, g):
    N, C, H, W, K, R, S, sh, sw, ph, pw, dh, dw, Pn, Q = g
    return _module(storage, C, R, S, K, sh, sw, ph, pw, dh, dw)


def backward_filter(x, dy, dw, db, storage, geom, partial=None):
    """dw += the filter gradient, db += the bias gradient (either may be None), in fp32;
    ``partial``: a float32 buffer of at least ``partial_size(geom)`` words (the GPU
    body's per-chunk sums)."""
    g = _geom(geom)
    N, C, H, W, K, R, S = g[:7]
    Pn, Q = g[13:]
    x1 = _words(x, storage, N * H * W * C, "x")
    d1 = _words(dy, storage, N * Pn * Q * K, "dy")
    dw1 = None if dw is None else _f32(dw, "dw", K * C * R * S)
    db1 = None if db is None else _f32(db, "db", K)
    if dw1 is None and db1 is None:
        return dw, db
    if not is_cupy_array(x1):
        _np_backward_filter(x1, d1, dw1, db1, storage, g)
        return dw, db
    npq = N * Pn * Q
    nb, chunk = blocks(npq)
    ne = K * C * R * S + K
    if partial is None or partial.size < nb * ne or partial.dtype != np.float32:
        raise ValueError(f"partial: {nb * ne} float32 words needed")
    ks = _kernels(storage, g)
    ks["mc_conv16_wgrad"]((nb,), (_THREADS,), (x1, d1, partial, np.int32(N), np.int32(H),
                                               np.int32(W), np.int32(Pn), np.int32(Q),
                                               np.uint32(npq), np.uint32(chunk)))
    mode = (1 if dw1 is not None else 0) | (2 if db1 is not None else 0)
    some = dw1 if dw1 is not None else db1
    ks["mc_conv16_wgrad_sum"]((-(-ne // _THREADS),), (_THREADS,),
                              (partial, np.int32(nb), dw1 if dw1 is not None else some,
                               db1 if db1 is not None else some, np.int32(mode)))
    return dw, db
