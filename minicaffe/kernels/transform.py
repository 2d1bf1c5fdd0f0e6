"""Caffe's DataTransformer for a whole batch in one CUDA kernel (data_transformer.cu has
none: Caffe transforms on the CPU).

``transform_batch(images, out, mirror, hoff, woff, mean, mean_values, scale)``: ``images``
(N, C, H, W) uint8 or float32 on the device, ``out`` (N, C, h, w) float32; per output
element, in Caffe's order: read the pixel of the crop window at (hoff[n], woff[n]) (the
column reversed where mirror[n]), subtract the mean file at that same unmirrored pixel or
the channel's mean value, multiply by ``scale``.  Computed in fp32 with no multiply-add
contraction, so it equals the numpy path (``DataTransformer.apply``) bit for bit.  The
draws (mirror, offsets) are made on the host and passed in.
"""
import functools

import numpy as np

from ._backend import _cupy, launch, raw_kernel

_SRC = r"""
typedef IN_T In;
extern "C" __global__ void mc_transform(const In* in, float* out, long long n, int C, int H,
                                        int W, int h, int w, const int* hoff, const int* woff,
                                        const unsigned char* mirror, const float* mean,
                                        int mean_mode, const float* mv, int n_mv, float scale) {
  CUDA_KERNEL_LOOP(i, n) {
    long long t = i;
    const int x = (int)(t % w); t /= w;
    const int y = (int)(t % h); t /= h;
    const int c = (int)(t % C);
    const long long k = t / C;
    const int sh = hoff[k] + y;
    const int sw = woff[k] + (mirror[k] ? (w - 1 - x) : x);
    float v = (float)in[((k * C + c) * (long long)H + sh) * W + sw];
    if (mean_mode == 1) {
      v = v - mean[((long long)c * H + sh) * W + sw];
    } else if (mean_mode == 2) {
      v = v - mv[n_mv == 1 ? 0 : c];
    }
    if (scale != 1.0f) v = v * scale;
    out[i] = v;
  }
}
"""


@functools.lru_cache(maxsize=None)
def _kernel(in_dtype):
    in_t = {np.dtype(np.uint8): "unsigned char", np.dtype(np.float32): "float"}[np.dtype(in_dtype)]
    return raw_kernel(_SRC.replace("IN_T", in_t), "mc_transform", "float")


_consts = {}


def _device_const(key, array):
    """A small constant array on the device, uploaded once per (key, device)."""
    from ..core import backend
    cp = _cupy()
    k = (key, backend.current_device())
    a = _consts.get(k)
    if a is None or a[0] is not array:
        a = _consts[k] = (array, cp.asarray(np.ascontiguousarray(array, dtype=np.float32)))
    return a[1]


def transform_batch(images, out, mirror, hoff, woff, mean=None, mean_values=None, scale=1.0):
    cp = _cupy()
    n, C, H, W = images.shape
    h, w = out.shape[2:]
    if out.dtype != np.float32:
        raise TypeError(f"transform_batch writes float32, got {out.dtype}")
    if images.dtype not in (np.uint8, np.float32):
        images = images.astype(np.float32)
    draws = np.empty((3, n), dtype=np.int32)
    draws[0], draws[1], draws[2] = hoff, woff, np.asarray(mirror, dtype=np.int32)
    d = cp.asarray(draws)
    mirror_u8 = d[2].astype(np.uint8)
    mean_mode, mean_dev, mv_dev, n_mv = 0, None, None, 1
    if mean is not None:
        mean_mode, mean_dev = 1, _device_const(("mean", id(mean)), mean)
    elif mean_values is not None:
        mean_mode, mv_dev, n_mv = 2, _device_const(("mv", id(mean_values)), mean_values), \
            len(mean_values)
    dummy = d[0]  # a valid pointer for the unused mean arguments
    launch(_kernel(images.dtype), out.size,
           (cp.ascontiguousarray(images), out, np.int64(out.size), np.int32(C), np.int32(H),
            np.int32(W), np.int32(h), np.int32(w), d[0], d[1], mirror_u8,
            mean_dev if mean_dev is not None else dummy, np.int32(mean_mode),
            mv_dev if mv_dev is not None else dummy, np.int32(n_mv), np.float32(scale)))
    return out
