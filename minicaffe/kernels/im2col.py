"""im2col / col2im for convolution, numpy and CuPy bodies.

Column layout (whole batch, one GEMM)
-------------------------------------
``im2col(x, kernel, pad, stride, dilation)`` takes ``x`` of shape
``(N, C, H, W)`` and returns ``col`` of shape ``(C*kh*kw, N*OH*OW)``::

    row    r = (c * kh + i) * kw + j          (Caffe's row order)
    column q = (n * OH + oh) * OW + ow
    col[r, q] = x[n, c, oh*sh - ph + i*dh, ow*sw - pw + j*dw]   (0 outside)

so that, with ``W2 = weight.reshape(Cout, C*kh*kw)``::

    y2 = W2 @ col                                   # (Cout, N*OH*OW)
    y  = y2.reshape(Cout, N, OH, OW).transpose(1, 0, 2, 3)

is the whole-batch convolution in ONE GEMM; likewise the weight gradient is
``dy2 @ col.T`` and the data gradient ``col2im(W2.T @ dy2, x.shape, ...)``
with ``dy2 = dy.transpose(1, 0, 2, 3).reshape(Cout, N*OH*OW)``.  For
``N == 1`` the layout is exactly Caffe's per-image ``col_buffer``.  To bound
memory a layer may call ``im2col`` on batch slices ``x[n0:n1]``.

Grouped convolution (``group = G``, ``Cg = C // G``): the rows are ordered
channel-major, so rows ``[g*Cg*kh*kw, (g+1)*Cg*kh*kw)`` of the full ``col``
are exactly ``im2col(x[:, g*Cg:(g+1)*Cg])``.  Build ``col`` once and do one
GEMM per group on that row block, ``W2[g*Coutg:(g+1)*Coutg] @ col[rows_g]``;
the inverse direction concatenates the per-group ``dcol`` row blocks (or
calls ``col2im`` per channel slice, the result being the channel slice of the
data gradient).

Output size (Caffe's ConvolutionLayer)::

    OH = (H + 2*ph - (dh*(kh-1) + 1)) // sh + 1

``col2im`` is the exact adjoint (transpose) of ``im2col``: overlapping
contributions are summed and contributions that land in the padding are
dropped.  The CuPy ``col2im`` is a deterministic gather (one thread per image
pixel, no atomics) like Caffe's ``col2im_gpu_kernel``; its summation order
(i ascending, then j ascending) is the same as the numpy body's, so both give
the same rounding.

``im2col_nd``/``col2im_nd`` generalise the layout to any number of spatial
axes (1-D, 3-D, ...); they are array-module generic (the same strided-slice
code runs on numpy or CuPy arrays).
"""
from __future__ import annotations

import itertools
import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ._backend import as_pair, cuda_type, is_cupy_array, launch, raw_kernel, _cupy

__all__ = [
    "conv_output_shape", "im2col", "col2im", "im2col_nd", "col2im_nd",
    "conv_output_shape_nd",
]


def _out_size(size, k, p, s, d):
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def conv_output_shape(H, W, kernel, pad=0, stride=1, dilation=1):
    """``(OH, OW)`` of a 2-D convolution, Caffe's formula (floor rounding)."""
    kh, kw = as_pair(kernel, "kernel")
    ph, pw = as_pair(pad, "pad")
    sh, sw = as_pair(stride, "stride")
    dh, dw = as_pair(dilation, "dilation")
    return _out_size(H, kh, ph, sh, dh), _out_size(W, kw, pw, sw, dw)


def _params(kernel, pad, stride, dilation):
    kh, kw = as_pair(kernel, "kernel")
    ph, pw = as_pair(pad, "pad")
    sh, sw = as_pair(stride, "stride")
    dh, dw = as_pair(dilation, "dilation")
    if min(kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw) < 0:
        raise ValueError("kernel/stride/dilation must be >= 1 and pad >= 0")
    return kh, kw, ph, pw, sh, sw, dh, dw


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------
def im2col(x, kernel, pad=0, stride=1, dilation=1):
    """(N, C, H, W) -> col (C*kh*kw, N*OH*OW); see the module docstring."""
    if x.ndim != 4:
        raise ValueError(f"im2col expects (N, C, H, W), got shape {x.shape}")
    p = _params(kernel, pad, stride, dilation)
    N, C, H, W = x.shape
    OH = _out_size(H, p[0], p[2], p[4], p[6])
    OW = _out_size(W, p[1], p[3], p[5], p[7])
    if OH <= 0 or OW <= 0:
        raise ValueError(f"empty convolution output ({OH}, {OW}) for input {x.shape}")
    if is_cupy_array(x):
        return _im2col_cupy(x, N, C, H, W, OH, OW, *p)
    return _im2col_numpy(x, N, C, H, W, OH, OW, *p)


def col2im(col, x_shape, kernel, pad=0, stride=1, dilation=1):
    """Adjoint of :func:`im2col`: col (C*kh*kw, N*OH*OW) -> (N, C, H, W)."""
    N, C, H, W = (int(v) for v in x_shape)
    p = _params(kernel, pad, stride, dilation)
    OH = _out_size(H, p[0], p[2], p[4], p[6])
    OW = _out_size(W, p[1], p[3], p[5], p[7])
    expect = (C * p[0] * p[1], N * OH * OW)
    if tuple(col.shape) != expect:
        raise ValueError(f"col has shape {col.shape}, expected {expect}")
    if is_cupy_array(col):
        return _col2im_cupy(col, N, C, H, W, OH, OW, *p)
    return _col2im_numpy(col, N, C, H, W, OH, OW, *p)


# --------------------------------------------------------------------------
# numpy bodies, on a padded channel-first batch (C, N, H + 2ph, W + 2pw): the one
# im2col/col2im of the package's CPU mode (kernels/conv.py's ConvEngine calls the
# ``_padded_into`` forms on its workspaces)
# --------------------------------------------------------------------------
def im2col_padded_into(xpad, col, kh, kw, sh, sw, dh, dw, OH, OW):
    """col (C*kh*kw, n*OH*OW), written into ``col`` (C*kh*kw*n*OH*OW elements), from
    ``xpad`` (C, n, Hp, Wp: the zero-padded input, channel first) in one strided copy."""
    C, n = xpad.shape[:2]
    st = xpad.strides
    view = as_strided(xpad, (C, kh, kw, n, OH, OW),
                      (st[0], dh * st[2], dw * st[3], st[1], sh * st[2], sw * st[3]),
                      writeable=False)
    np.copyto(col.reshape(C, kh, kw, n, OH, OW), view)
    return col.reshape(C * kh * kw, n * OH * OW)


def col2im_padded_into(col, dpad, kh, kw, sh, sw, dh, dw, OH, OW):
    """The adjoint: ``dpad`` (C, n, Hp, Wp) zeroed, then every column added back to the
    pixel it came from, kernel offset by offset (i ascending, then j: the CuPy body's
    order, so both round alike).  Returns ``dpad``."""
    C, n = dpad.shape[:2]
    dpad[...] = 0
    col6 = col.reshape(C, kh, kw, n, OH, OW)
    for i in range(kh):
        hs = slice(i * dh, i * dh + sh * (OH - 1) + 1, sh)
        for j in range(kw):
            ws = slice(j * dw, j * dw + sw * (OW - 1) + 1, sw)
            # one kernel offset never hits the same pixel twice -> plain +=
            dpad[:, :, hs, ws] += col6[:, i, j]
    return dpad


def _im2col_numpy(x, N, C, H, W, OH, OW, kh, kw, ph, pw, sh, sw, dh, dw):
    xpad = np.zeros((C, N, H + 2 * ph, W + 2 * pw), dtype=x.dtype)
    xpad[:, :, ph:ph + H, pw:pw + W] = x.transpose(1, 0, 2, 3)
    col = np.empty(C * kh * kw * N * OH * OW, dtype=x.dtype)
    return im2col_padded_into(xpad, col, kh, kw, sh, sw, dh, dw, OH, OW)


def _col2im_numpy(col, N, C, H, W, OH, OW, kh, kw, ph, pw, sh, sw, dh, dw):
    dpad = np.empty((C, N, H + 2 * ph, W + 2 * pw), dtype=col.dtype)
    col2im_padded_into(col, dpad, kh, kw, sh, sw, dh, dw, OH, OW)
    return np.ascontiguousarray(dpad[:, :, ph:ph + H, pw:pw + W].transpose(1, 0, 2, 3))


# --------------------------------------------------------------------------
# CuPy bodies
# --------------------------------------------------------------------------
_IM2COL_SRC = r"""
extern "C" __global__ void mc_im2col(
    const long long nthreads, const T* __restrict__ data_im,
    const int N, const int C, const int H, const int W,
    const int kh, const int kw, const int ph, const int pw,
    const int sh, const int sw, const int dh, const int dw,
    const int OH, const int OW, T* __restrict__ data_col) {
  // one thread per col element; col[(c*kh+i)*kw+j][(n*OH+oh)*OW+ow]
  CUDA_KERNEL_LOOP(index, nthreads) {
    const int ow = (int)(index % OW);
    long long t = index / OW;
    const int oh = (int)(t % OH); t /= OH;
    const int n = (int)(t % N); t /= N;
    const int j = (int)(t % kw); t /= kw;
    const int i = (int)(t % kh);
    const int c = (int)(t / kh);
    const int h = oh * sh - ph + i * dh;
    const int w = ow * sw - pw + j * dw;
    T v = 0;
    if (h >= 0 && h < H && w >= 0 && w < W) {
      v = data_im[(((long long)n * C + c) * H + h) * W + w];
    }
    data_col[index] = v;
  }
}
"""

_COL2IM_SRC = r"""
extern "C" __global__ void mc_col2im(
    const long long nthreads, const T* __restrict__ data_col,
    const int N, const int C, const int H, const int W,
    const int kh, const int kw, const int ph, const int pw,
    const int sh, const int sw, const int dh, const int dw,
    const int OH, const int OW, T* __restrict__ data_im) {
  // one thread per image pixel, gathering its contributions (no atomics),
  // as Caffe's col2im_gpu_kernel.  The output positions are visited with
  // h_col/w_col DEcreasing so that the kernel offsets (i, j) increase: the
  // same summation order as the numpy body.
  const long long NOHW = (long long)N * OH * OW;
  CUDA_KERNEL_LOOP(index, nthreads) {
    const int w_im = (int)(index % W) + pw;
    const int h_im = (int)((index / W) % H) + ph;
    const int c_im = (int)((index / ((long long)W * H)) % C);
    const int n = (int)(index / ((long long)W * H * C));
    const int ext_w = (kw - 1) * dw + 1;
    const int ext_h = (kh - 1) * dh + 1;
    const int w_col_start = (w_im < ext_w) ? 0 : (w_im - ext_w) / sw + 1;
    const int w_col_end = min(w_im / sw + 1, OW);
    const int h_col_start = (h_im < ext_h) ? 0 : (h_im - ext_h) / sh + 1;
    const int h_col_end = min(h_im / sh + 1, OH);
    T val = 0;
    for (int h_col = h_col_end - 1; h_col >= h_col_start; --h_col) {
      int h_k = h_im - h_col * sh;
      if (h_k % dh != 0) continue;
      h_k /= dh;
      for (int w_col = w_col_end - 1; w_col >= w_col_start; --w_col) {
        int w_k = w_im - w_col * sw;
        if (w_k % dw != 0) continue;
        w_k /= dw;
        const long long row = ((long long)c_im * kh + h_k) * kw + w_k;
        val += data_col[row * NOHW + ((long long)n * OH + h_col) * OW + w_col];
      }
    }
    data_im[index] = val;
  }
}
"""


def _i32(*vals):
    return tuple(np.int32(v) for v in vals)


def _im2col_cupy(x, N, C, H, W, OH, OW, kh, kw, ph, pw, sh, sw, dh, dw):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    ctype = cuda_type(x.dtype)
    col = cp.empty((C * kh * kw, N * OH * OW), dtype=x.dtype)
    n = col.size
    k = raw_kernel(_IM2COL_SRC, "mc_im2col", ctype)
    launch(k, n, (np.int64(n), x) + _i32(N, C, H, W, kh, kw, ph, pw, sh, sw, dh, dw, OH, OW)
           + (col,))
    return col


def _col2im_cupy(col, N, C, H, W, OH, OW, kh, kw, ph, pw, sh, sw, dh, dw):
    cp = _cupy()
    col = cp.ascontiguousarray(col)
    ctype = cuda_type(col.dtype)
    x = cp.empty((N, C, H, W), dtype=col.dtype)
    n = x.size
    k = raw_kernel(_COL2IM_SRC, "mc_col2im", ctype)
    launch(k, n, (np.int64(n), col) + _i32(N, C, H, W, kh, kw, ph, pw, sh, sw, dh, dw, OH, OW)
           + (x,))
    return x


# --------------------------------------------------------------------------
# N-D versions (array-module generic strided slicing)
# --------------------------------------------------------------------------
def _nd_params(nsp, kernel, pad, stride, dilation):
    def tup(v, name, lo):
        if isinstance(v, (int, np.integer)):
            t = (int(v),) * nsp
        else:
            t = tuple(int(e) for e in v)
            if len(t) == 1:
                t = t * nsp
        if len(t) != nsp or min(t) < lo:
            raise ValueError(f"bad {name} {v!r} for {nsp} spatial axes")
        return t
    return (tup(kernel, "kernel", 1), tup(pad, "pad", 0),
            tup(stride, "stride", 1), tup(dilation, "dilation", 1))


def conv_output_shape_nd(spatial, kernel, pad=0, stride=1, dilation=1):
    """Output spatial shape of an N-D convolution (Caffe's formula)."""
    k, p, s, d = _nd_params(len(spatial), kernel, pad, stride, dilation)
    return tuple(_out_size(n, *a) for n, *a in zip(spatial, k, p, s, d))


def _xp(a):
    return _cupy() if is_cupy_array(a) else np


def im2col_nd(x, kernel, pad=0, stride=1, dilation=1):
    """(N, C, *S) -> col (C*prod(K), N*prod(O)), rows ``(c, k0, k1, ...)``
    row-major and columns ``(n, o0, o1, ...)`` row-major (same layout as
    :func:`im2col`, which it equals for two spatial axes)."""
    xp = _xp(x)
    N, C = x.shape[:2]
    S = tuple(x.shape[2:])
    nsp = len(S)
    k, p, s, d = _nd_params(nsp, kernel, pad, stride, dilation)
    O = conv_output_shape_nd(S, k, p, s, d)
    if min(O) <= 0:
        raise ValueError(f"empty convolution output {O} for input {x.shape}")
    if any(p):
        xpad = xp.zeros((N, C) + tuple(n + 2 * q for n, q in zip(S, p)), dtype=x.dtype)
        xpad[(slice(None), slice(None)) + tuple(slice(q, q + n) for q, n in zip(p, S))] = x
    else:
        xpad = x
    col = xp.empty((C,) + k + (N,) + O, dtype=x.dtype)
    perm = (1, 0) + tuple(range(2, 2 + nsp))
    for offs in itertools.product(*(range(kk) for kk in k)):
        sl = tuple(slice(o * dd, o * dd + ss * (oo - 1) + 1, ss)
                   for o, dd, ss, oo in zip(offs, d, s, O))
        col[(slice(None),) + offs] = xpad[(slice(None), slice(None)) + sl].transpose(perm)
    return col.reshape(C * math.prod(k), N * math.prod(O))


def col2im_nd(col, x_shape, kernel, pad=0, stride=1, dilation=1):
    """Adjoint of :func:`im2col_nd`."""
    xp = _xp(col)
    N, C = (int(v) for v in x_shape[:2])
    S = tuple(int(v) for v in x_shape[2:])
    nsp = len(S)
    k, p, s, d = _nd_params(nsp, kernel, pad, stride, dilation)
    O = conv_output_shape_nd(S, k, p, s, d)
    expect = (C * math.prod(k), N * math.prod(O))
    if tuple(col.shape) != expect:
        raise ValueError(f"col has shape {col.shape}, expected {expect}")
    colr = col.reshape((C,) + k + (N,) + O)
    xpad = xp.zeros((N, C) + tuple(n + 2 * q for n, q in zip(S, p)), dtype=col.dtype)
    perm = (1, 0) + tuple(range(2, 2 + nsp))
    for offs in itertools.product(*(range(kk) for kk in k)):
        sl = tuple(slice(o * dd, o * dd + ss * (oo - 1) + 1, ss)
                   for o, dd, ss, oo in zip(offs, d, s, O))
        xpad[(slice(None), slice(None)) + sl] += colr[(slice(None),) + offs].transpose(perm)
    return xp.ascontiguousarray(
        xpad[(slice(None), slice(None)) + tuple(slice(q, q + n) for q, n in zip(p, S))])
