"""Local response normalisation (Caffe's LRNLayer), numpy and CuPy bodies.

All arrays are NCHW; ``size`` must be odd (Caffe checks this for both norm
regions); ``pre_pad = (size - 1) // 2``.

ACROSS_CHANNELS::

    scale[n,c,h,w] = k + alpha/size * sum_{c' = c-pre_pad .. c+pre_pad} x[n,c',h,w]^2
    y = x * scale^-beta
    dx = dy * scale^-beta
         - (2*alpha*beta/size) * x * sum_{window}(dy * y / scale)

(``alpha/size`` is computed in the array dtype, ``2*alpha*beta/size`` in
double then cast, as Caffe does.)  The numpy body sums the ``size`` shifted
channel slices of a zero-padded array; the CuPy body uses one thread per
element summing its channel window in the same order (Caffe's GPU kernel
uses a running window per pixel; the maths is the same, the rounding of our
direct sum is better and matches numpy).

WITHIN_CHANNEL, as Caffe composes it (Power(x, 2) -> AVE pool(size, pad =
pre_pad, stride 1) -> Power(power=-beta, scale=alpha, shift=1) -> product)::

    scale = 1 + alpha * avepool(x^2)          # = 1 + alpha/size^2 * windowsum(x^2)
    y     = x * scale^-beta
    dx    = dy * scale^-beta
            - 2*alpha*beta * x * avepool_backward(dy * y / scale)

``avepool`` uses Caffe's AVE semantics (only in-image values summed; with
stride 1 and pad = (size-1)/2 the divisor is always size^2).  Note that ``k``
is not used by Caffe in this mode (the shift is 1).

Forward functions return ``(y, scale)``; backward functions take
``(dy, x, y, scale, ...)`` and return ``dx``.  With a CPU kernel pool (core/threads.py,
``--threads N``) the numpy bodies run on batch ranges in its threads (each image's
result is its own: the serial bits).
"""
from __future__ import annotations

import numpy as np

from ._backend import _cupy, cuda_type, elementwise_kernel, is_cupy_array, launch, raw_kernel
from .pooling import ave_pool_backward, ave_pool_forward

__all__ = [
    "lrn_across_channels_forward", "lrn_across_channels_backward",
    "lrn_within_channel_forward", "lrn_within_channel_backward",
    "lrn_forward", "lrn_backward",
]


def _check(x, size):
    if x.ndim != 4:
        raise ValueError(f"LRN expects (N, C, H, W), got shape {x.shape}")
    size = int(size)
    if size < 1 or size % 2 != 1:
        raise ValueError(f"LRN only supports odd values for local_size, got {size}")
    return size


def _scalar(v, dtype):
    return np.asarray(v, dtype=np.float64).astype(dtype)[()]


def _by_image(body, arrays, work):
    """``body(*arrays)`` (numpy; it returns a tuple of arrays, one image per row), run
    with a CPU kernel pool (core/threads.py, ``--threads N``) on contiguous batch ranges
    in the pool's threads (pooling.py's ``_batch_parts`` chooses them from ``work``) and
    joined: every output image depends on its own input image alone, so the results
    are the serial body's."""
    from .pooling import _batch_parts, _in_parts
    pool, parts = _batch_parts(arrays[0].shape[0], work)
    if pool is None:
        return body(*arrays)
    done = _in_parts(pool, parts, lambda a, b: body(*(x[a:b] for x in arrays)))
    return tuple(np.concatenate(outs) for outs in zip(*done))


def _window_sum_channels(a, size):
    """sum_{o=0}^{size-1} a[:, c - pre_pad + o] (zero outside), numpy."""
    N, C, H, W = a.shape
    pre = (size - 1) // 2
    padded = np.zeros((N, C + size - 1, H, W), dtype=a.dtype)
    padded[:, pre:pre + C] = a
    acc = np.zeros_like(a)
    for o in range(size):
        acc += padded[:, o:o + C]
    return acc


# --------------------------------------------------------------------------
# ACROSS_CHANNELS
# --------------------------------------------------------------------------
def lrn_across_channels_forward(x, size=5, alpha=1.0, beta=0.75, k=1.0):
    """ACROSS_CHANNELS LRN -> ``(y, scale)``, both shaped like ``x``."""
    size = _check(x, size)
    dt = x.dtype
    alpha_over_size = _scalar(alpha, dt) / _scalar(size, dt)
    negative_beta = _scalar(-beta, dt)
    kk = _scalar(k, dt)
    if is_cupy_array(x):
        return _across_fwd_cupy(x, size, alpha_over_size, negative_beta, kk)

    def body(x):
        accum = _window_sum_channels(x * x, size)
        scale = kk + accum * alpha_over_size
        return x * np.power(scale, negative_beta), scale
    return _by_image(body, (x,), x.size * (size + 8))


def lrn_across_channels_backward(dy, x, y, scale, size=5, alpha=1.0, beta=0.75):
    """Gradient of :func:`lrn_across_channels_forward` w.r.t. ``x``."""
    size = _check(x, size)
    dt = x.dtype
    negative_beta = _scalar(-beta, dt)
    cache_ratio = _scalar(2.0 * alpha * beta / size, dt)
    if is_cupy_array(x):
        return _across_bwd_cupy(dy, x, y, scale, size, negative_beta, cache_ratio)

    def body(dy, x, y, scale):
        accum_ratio = _window_sum_channels(dy * y / scale, size)
        return (dy * np.power(scale, negative_beta) - cache_ratio * x * accum_ratio,)
    return _by_image(body, (dy, x, y, scale), x.size * (size + 8))[0]


lrn_forward = lrn_across_channels_forward
lrn_backward = lrn_across_channels_backward


# --------------------------------------------------------------------------
# WITHIN_CHANNEL
# --------------------------------------------------------------------------
def lrn_within_channel_forward(x, size=5, alpha=1.0, beta=0.75):
    """WITHIN_CHANNEL LRN -> ``(y, scale)`` with ``scale = 1 + alpha*avepool(x^2)``."""
    size = _check(x, size)
    pre = (size - 1) // 2
    dt = x.dtype
    a = _scalar(alpha, dt)
    negative_beta = _scalar(-beta, dt)
    if is_cupy_array(x):
        pooled = ave_pool_forward(_sq_cupy(x), size, 1, pre)
        scale, y = elementwise_kernel(
            "T x, T p, T alpha, T negbeta", "T scale, T y",
            "scale = (T)1 + alpha * p; y = x * pow(scale, negbeta);",
            "mc_lrn_within_fwd")(x, pooled, a, negative_beta)
        return y, scale

    def body(x):
        pooled = ave_pool_forward(x * x, size, 1, pre)
        scale = dt.type(1) + a * pooled
        return x * np.power(scale, negative_beta), scale
    return _by_image(body, (x,), x.size * (size * size + 8))


def lrn_within_channel_backward(dy, x, y, scale, size=5, alpha=1.0, beta=0.75):
    """Exact gradient of :func:`lrn_within_channel_forward` w.r.t. ``x``."""
    size = _check(x, size)
    pre = (size - 1) // 2
    dt = x.dtype
    negative_beta = _scalar(-beta, dt)
    cache_ratio = _scalar(2.0 * alpha * beta, dt)
    if is_cupy_array(x):
        ratio = elementwise_kernel("T dy, T y, T scale", "T r", "r = dy * y / scale",
                                   "mc_lrn_within_ratio")(dy, y, scale)
        back = ave_pool_backward(ratio, x.shape, size, 1, pre)
        return elementwise_kernel(
            "T dy, T x, T scale, T back, T negbeta, T cache", "T dx",
            "dx = dy * pow(scale, negbeta) - cache * x * back",
            "mc_lrn_within_bwd")(dy, x, scale, back, negative_beta, cache_ratio)

    def body(dy, x, y, scale):
        back = ave_pool_backward(dy * y / scale, x.shape, size, 1, pre)
        return (dy * np.power(scale, negative_beta) - cache_ratio * x * back,)
    return _by_image(body, (dy, x, y, scale), x.size * (size * size + 8))[0]


# --------------------------------------------------------------------------
# CuPy bodies
# --------------------------------------------------------------------------
_ACROSS_FWD_SRC = r"""
extern "C" __global__ void mc_lrn_across_fwd(
    const long long nthreads, const T* __restrict__ in,
    const int C, const int HW, const int size,
    const T alpha_over_size, const T negative_beta, const T k,
    T* __restrict__ scale, T* __restrict__ out) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    const long long pix = index % HW;
    const int c = (int)((index / HW) % C);
    const long long n = index / ((long long)HW * C);
    const T* base = in + n * C * HW + pix;
    const int pre_pad = (size - 1) / 2;
    T accum = 0;
    for (int o = 0; o < size; ++o) {
      const int cc = c - pre_pad + o;
      if (cc >= 0 && cc < C) {
        const T v = base[(long long)cc * HW];
        accum += v * v;
      }
    }
    const T s = k + accum * alpha_over_size;
    scale[index] = s;
    out[index] = in[index] * pow(s, negative_beta);
  }
}
"""

_ACROSS_BWD_SRC = r"""
extern "C" __global__ void mc_lrn_across_bwd(
    const long long nthreads, const T* __restrict__ bottom_data,
    const T* __restrict__ top_data, const T* __restrict__ scale,
    const T* __restrict__ top_diff,
    const int C, const int HW, const int size,
    const T negative_beta, const T cache_ratio, T* __restrict__ bottom_diff) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    const long long pix = index % HW;
    const int c = (int)((index / HW) % C);
    const long long off = (index / ((long long)HW * C)) * C * HW + pix;
    const int pre_pad = (size - 1) / 2;   // size is odd: window is symmetric
    T accum_ratio = 0;
    for (int o = 0; o < size; ++o) {
      const int cc = c - pre_pad + o;
      if (cc >= 0 && cc < C) {
        const long long j = off + (long long)cc * HW;
        accum_ratio += top_diff[j] * top_data[j] / scale[j];
      }
    }
    bottom_diff[index] = top_diff[index] * pow(scale[index], negative_beta)
                         - cache_ratio * bottom_data[index] * accum_ratio;
  }
}
"""


def _sq_cupy(x):
    return elementwise_kernel("T x", "T y", "y = x * x", "mc_square")(x)


def _across_fwd_cupy(x, size, alpha_over_size, negative_beta, k):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    N, C, H, W = x.shape
    y = cp.empty_like(x)
    scale = cp.empty_like(x)
    kern = raw_kernel(_ACROSS_FWD_SRC, "mc_lrn_across_fwd", cuda_type(x.dtype))
    launch(kern, x.size, (np.int64(x.size), x, np.int32(C), np.int32(H * W), np.int32(size),
                          alpha_over_size, negative_beta, k, scale, y))
    return y, scale


def _across_bwd_cupy(dy, x, y, scale, size, negative_beta, cache_ratio):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    y = cp.ascontiguousarray(y, dtype=x.dtype)
    scale = cp.ascontiguousarray(scale, dtype=x.dtype)
    dy = cp.ascontiguousarray(dy, dtype=x.dtype)
    N, C, H, W = x.shape
    dx = cp.empty_like(x)
    kern = raw_kernel(_ACROSS_BWD_SRC, "mc_lrn_across_bwd", cuda_type(x.dtype))
    launch(kern, x.size, (np.int64(x.size), x, y, scale, dy, np.int32(C), np.int32(H * W),
                          np.int32(size), negative_beta, cache_ratio, dx))
    return dx
