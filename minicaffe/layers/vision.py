"""Vision layers: Convolution, Deconvolution, Im2col, Pooling, LRN, SPP, Crop.

Convolution is Caffe's engine, im2col + GEMM, run over a bounded chunk of the
batch at a time with one GEMM per group (``ConvEngine``):

* numpy, 2-D: per-layer workspaces (padded input, column matrix, GEMM output)
  are allocated once and reused, so no call pays for fresh pages.  The column
  matrix is built channel-last, one row per output pixel, by a single strided
  copy, and the GEMMs put that long axis first (faster in OpenBLAS than the
  transposed formulation for these channel counts).  With stride 1 the data
  gradient is computed as a full convolution of dy with the flipped kernel (an
  im2col copy instead of col2im's accumulation per kernel offset).  Layers with
  few input channels use Caffe's channel-major columns instead; a 1x1 kernel
  with stride 1 and no padding skips im2col (the input is the column matrix).
* CuPy, or N-D: the kernels package's whole-chunk ``im2col``/``col2im``
  (CUDA kernels on the GPU, strided slicing for N-D) and ``xp.matmul``.

docs/vision.md has the measured figures.

Shapes (Caffe's): convolution output ``(H + 2p - (d(k-1)+1)) // s + 1``;
deconvolution output ``s(H - 1) + d(k-1) + 1 - 2p``; pooling output
``ceil((H + 2p - k) / s) + 1`` (CEIL, Caffe's default; FLOOR when
``round_mode: FLOOR``), one less when the last window would start in the
padding.
"""
import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import context
from .. import kernels as K
from ..blas import gemm_batched
from ..blob import Blob
from ..filler import fill
from ..layer import Layer
from ..proto import caffe_pb2
from ..registry import register_layer

# Largest column buffer one chunk of the batch may use.  On the CPU a column
# matrix that stays in the core's cache (L2 1.25 MiB, L3 48 MiB on the
# project's machine) between the im2col copy and the GEMM that reads it is
# faster: 1 MiB chunks took CIFAR-10 conv2's forward+backward from 122 to 71 ms
# against 8 MiB (docs/vision.md, "CPU speed").  On the GPU bigger is better.
COL_BUFFER_BYTES = {"cpu": 1 << 20, "gpu": 1 << 30}
# A CPU chunk keeps at least this many output columns per GEMM (tiny GEMMs
# are slow), even if that exceeds the byte budget.
MIN_GEMM_COLUMNS = 512
# Stride-1 data gradients are computed as a full convolution of dy when dy's
# patches are at most this many times larger than x's (see _full_conv_ok).
FULL_CONV_RATIO = 3
# Below this many input channels per group the numpy engine builds Caffe's
# channel-major columns instead of channel-last patches.
NHWC_MIN_CHANNELS = 8


def _per_axis(repeated, h_field, w_field, param, n_spatial, default, name, layer):
    """Caffe's kernel/stride/pad/dilation: either ``X_h``/``X_w`` (2-D only) or a
    repeated field with 0, 1 or n_spatial values."""
    fields = param.DESCRIPTOR.fields_by_name
    if h_field in fields and (param.HasField(h_field) or param.HasField(w_field)):
        if n_spatial != 2:
            raise layer.error(f"{name}_h & {name}_w can only be used for 2D convolution "
                              f"({n_spatial} spatial axes)")
        if not (param.HasField(h_field) and param.HasField(w_field)):
            raise layer.error(f"both {name}_h and {name}_w are required")
        if len(repeated):
            raise layer.error(f"either {name}_size or {name}_h/w should be specified; not both")
        return [getattr(param, h_field), getattr(param, w_field)]
    vals = list(repeated)
    if len(vals) == 0:
        if default is None:
            raise layer.error(f"{name}_size must be specified")
        return [default] * n_spatial
    if len(vals) not in (1, n_spatial):
        raise layer.error(f"{name} must be specified once, or once per spatial dimension "
                          f"({name} specified {len(vals)} times; {n_spatial} spatial dims)")
    return vals * n_spatial if len(vals) == 1 else vals


# ---------------------------------------------------------------------------
# the convolution engine
# ---------------------------------------------------------------------------
class ConvEngine:
    """im2col + GEMM convolution of one geometry, forward and backward.

    ``x`` is (N, C, *in_spatial), ``w`` is (O, C/G, *kernel), ``y`` is
    (N, O, *out_spatial).  ``forward`` writes ``y``; ``backward`` accumulates
    the weight gradient into ``dw`` (when given) and overwrites ``dx`` (when
    given).  Deconvolution uses the same engine with the roles swapped.
    """

    def __init__(self, channels, num_output, group, kernel, pad, stride, dilation,
                 in_spatial, out_spatial):
        self.C, self.O, self.G = channels, num_output, group
        self.kernel, self.pad = tuple(kernel), tuple(pad)
        self.stride, self.dilation = tuple(stride), tuple(dilation)
        self.in_spatial, self.out_spatial = tuple(in_spatial), tuple(out_spatial)
        self.ksize = math.prod(self.kernel)
        self.P = math.prod(self.out_spatial)
        self.ns = len(self.kernel)
        self.is_1x1 = (all(k == 1 for k in self.kernel) and all(s == 1 for s in self.stride)
                       and all(p == 0 for p in self.pad))
        self._ws = None  # numpy workspace: (dtype, chunk) -> buffers
        self.tf32 = None  # cuBLAS math of the GEMMs (the layer's run setting; None: default)

    # -- chunking ----------------------------------------------------------------
    def chunk(self, N, itemsize, budget, min_columns=0):
        """Images per chunk: the column buffer within ``budget`` bytes, but at
        least ``min_columns`` GEMM columns."""
        per_sample = self.C * self.ksize * self.P * itemsize
        n = max(1, budget // max(per_sample, 1), -(-min_columns // self.P))
        return int(min(N, n))

    # -- public ------------------------------------------------------------------
    def forward(self, xp, x, w, y, budget):
        if xp is np and self.is_1x1:
            return self._fwd_1x1(x, w, y)
        if xp is np and self.ns == 2:
            if self.C // self.G < NHWC_MIN_CHANNELS:
                return self._fwd_cn(x, w, y, budget)
            return self._fwd_nhwc(x, w, y, budget)
        return self.forward_generic(xp, x, w, y, budget)

    def backward(self, xp, x, w, dy, budget, dw=None, dx=None):
        """``x`` may be None when only ``dx`` is wanted."""
        if dw is None and dx is None:
            return
        if xp is np and self.is_1x1:
            return self._bwd_1x1(x, w, dy, dw, dx)
        if xp is np and self.ns == 2:
            if self.C // self.G < NHWC_MIN_CHANNELS:
                return self._bwd_cn(x, w, dy, dw, dx, budget)
            return self._bwd_nhwc(x, w, dy, dw, dx, budget)
        return self.backward_generic(xp, x, w, dy, dw, dx, budget)

    # -- 1x1, stride 1, no pad: the input is the column matrix ----------------------
    def _fwd_1x1(self, x, w, y):
        N, G = x.shape[0], self.G
        x4 = x.reshape(N, G, self.C // G, self.P)
        w3 = w.reshape(G, self.O // G, self.C // G)
        np.matmul(w3, x4, out=y.reshape(N, G, self.O // G, self.P))

    def _bwd_1x1(self, x, w, dy, dw, dx):
        N, G = dy.shape[0], self.G
        Cg, Og = self.C // G, self.O // G
        dy4 = dy.reshape(N, G, Og, self.P)
        if dw is not None:
            x4 = x.reshape(N, G, Cg, self.P)
            dw3 = dw.reshape(G, Og, Cg)
            for g in range(G):
                dw3[g] += np.tensordot(dy4[:, g], x4[:, g], axes=([0, 2], [0, 2]))
        if dx is not None:
            w3 = w.reshape(G, Og, Cg)
            np.matmul(w3.transpose(0, 2, 1), dy4, out=dx.reshape(N, G, Cg, self.P))

    # -- numpy 2-D: channel-last (NHWC) patches ------------------------------------------
    # The column matrix is built as (n*OH*OW, G*kh*kw*Cg): one row per output pixel,
    # columns ordered (group, kernel row, kernel column, channel).  The copy that
    # builds it moves contiguous runs of channels, and the GEMMs put the long axis
    # (n*OH*OW) first, which OpenBLAS ran 2-3.7x faster than the transposed
    # formulation for the channel counts of LeNet and CIFAR-10 (docs/vision.md).
    def _workspace(self, dtype, n):
        key = (np.dtype(dtype), n)
        if self._ws is None or self._ws["key"] != key:
            self._ws = {"key": key}
        return self._ws

    def _buffer(self, ws, name, shape, dtype, zero=False):
        """A workspace array made on first use (zero-filled if asked)."""
        if name not in ws:
            ws[name] = (np.zeros if zero else np.empty)(shape, dtype)
        return ws[name]

    def _nhwc_padded(self, ws, name, a, pad, n):
        """``a`` (n, C, H, W) written channel-last into the interior of a
        zero-bordered workspace array (step, H+2ph, W+2pw, C)."""
        step, C, H, W = ws["key"][1], a.shape[1], a.shape[2], a.shape[3]
        (ph, pw) = pad
        buf = self._buffer(ws, name, (step, H + 2 * ph, W + 2 * pw, C), a.dtype, zero=True)[:n]
        buf[:, ph:ph + H, pw:pw + W, :] = a.transpose(0, 2, 3, 1)
        return buf

    def _patches(self, ws, name, src, groups, out_spatial, stride):
        """im2col of a padded channel-last ``src`` (n, Hp, Wp, C) into a workspace
        matrix (n*OH*OW, G*kh*kw*Cg), as one strided copy."""
        n, C = src.shape[0], src.shape[3]
        (kh, kw), (dh, dw), (sh, sw) = self.kernel, self.dilation, stride
        OH, OW = out_spatial
        Cg = C // groups
        st = src.strides
        view = as_strided(src, (n, OH, OW, groups, kh, kw, Cg),
                          (st[0], sh * st[1], sw * st[2], Cg * st[3], dh * st[1], dw * st[2],
                           st[3]), writeable=False)
        step = ws["key"][1]
        size = OH * OW * groups * kh * kw * Cg
        buf = self._buffer(ws, name, step * size, src.dtype)[:n * size]
        np.copyto(buf.reshape(n, OH, OW, groups, kh, kw, Cg), view)
        return buf.reshape(n * OH * OW, groups * kh * kw * Cg)

    def _w_rows(self, w):
        """Weights as (G, Og, kh*kw*Cg), columns in the patches' order."""
        G, O = self.G, self.O
        return w.transpose(0, 2, 3, 1).reshape(G, O // G, -1)

    def _fwd_nhwc(self, x, w, y, budget):
        N, G, P, O = x.shape[0], self.G, self.P, self.O
        Og = O // G
        wr = self._w_rows(w)
        step = self.chunk(N, x.dtype.itemsize, budget, MIN_GEMM_COLUMNS)
        ws = self._workspace(x.dtype, step)
        for n0 in range(0, N, step):
            n = min(N, n0 + step) - n0
            xh = self._nhwc_padded(ws, "xh", x[n0:n0 + n], self.pad, n)
            col = self._patches(ws, "col", xh, G, self.out_spatial, self.stride)
            kc = col.shape[1] // G
            out = self._buffer(ws, "out", (step * P, Og), x.dtype)[:n * P]
            for g in range(G):
                np.matmul(col[:, g * kc:(g + 1) * kc], wr[g].T, out=out)
                y[n0:n0 + n, g * Og:(g + 1) * Og] = out.reshape(
                    n, *self.out_spatial, Og).transpose(0, 3, 1, 2)

    def _full_conv_ok(self):
        """With stride 1 the data gradient is itself a convolution: dy padded by
        extent-1-pad, correlated with the flipped, transposed kernel: an im2col
        copy of dy and a GEMM instead of a GEMM and col2im's accumulation per
        kernel offset.  Worth it unless dy is much larger than x."""
        if not all(s == 1 for s in self.stride) or not all(
                d * (k - 1) - p >= 0 for k, d, p in zip(self.kernel, self.dilation, self.pad)):
            return False
        return self.O * math.prod(self.in_spatial) <= FULL_CONV_RATIO * self.C * self.P

    def _bwd_nhwc(self, x, w, dy, dw, dx, budget):
        N, G, P, O, C = dy.shape[0], self.G, self.P, self.O, self.C
        Og, Cg = O // G, C // G
        (kh, kw) = self.kernel
        step = self.chunk(N, dy.dtype.itemsize, budget, MIN_GEMM_COLUMNS)
        ws = self._workspace(dy.dtype, step)
        full = dx is not None and self._full_conv_ok()
        if dx is not None:
            if full:  # wf[g][(i, j, o), c] = w[g*Og + o, c, kh-1-i, kw-1-j]
                wf = w.reshape(G, Og, Cg, kh, kw)[:, :, :, ::-1, ::-1]
                wf = wf.transpose(0, 3, 4, 1, 2).reshape(G, -1, Cg)
            else:
                wr = self._w_rows(w)
        if dw is not None:
            dwr = np.zeros((G, Og, kh * kw * Cg), dw.dtype)
        for n0 in range(0, N, step):
            n = min(N, n0 + step) - n0
            if dw is not None or not full:
                dyr = self._buffer(ws, "dyr", (step * P, O), dy.dtype)[:n * P]
                dyr.reshape(n, *self.out_spatial, O)[...] = dy[n0:n0 + n].transpose(0, 2, 3, 1)
            if dw is not None:
                xh = self._nhwc_padded(ws, "xh", x[n0:n0 + n], self.pad, n)
                col = self._patches(ws, "col", xh, G, self.out_spatial, self.stride)
                kc = col.shape[1] // G
                for g in range(G):
                    dwr[g] += dyr[:, g * Og:(g + 1) * Og].T @ col[:, g * kc:(g + 1) * kc]
            if dx is None:
                continue
            if full:
                self._dx_full_conv(ws, wf, dy[n0:n0 + n], dx[n0:n0 + n], n)
            else:
                self._dx_col2im(ws, wr, dyr, dx[n0:n0 + n], n)
        if dw is not None:
            dw += dwr.reshape(O, kh, kw, Cg).transpose(0, 3, 1, 2)

    def _dx_full_conv(self, ws, wf, dy, dx, n):
        G, O, C = self.G, self.O, self.C
        Cg = C // G
        H, W = self.in_spatial
        q = [d * (k - 1) - p for k, d, p in zip(self.kernel, self.dilation, self.pad)]
        dyh = self._nhwc_padded(ws, "dyh", dy, q, n)
        col = self._patches(ws, "dycol", dyh, G, self.in_spatial, (1, 1))
        kc = col.shape[1] // G
        step = ws["key"][1]
        out = self._buffer(ws, "dxout", (step * H * W, Cg), dy.dtype)[:n * H * W]
        for g in range(G):
            np.matmul(col[:, g * kc:(g + 1) * kc], wf[g], out=out)
            dx[:, g * Cg:(g + 1) * Cg] = out.reshape(n, H, W, Cg).transpose(0, 3, 1, 2)

    def _dx_col2im(self, ws, wr, dyr, dx, n):
        G, O, C = self.G, self.O, self.C
        Og, Cg = O // G, C // G
        (H, W), (ph, pw) = self.in_spatial, self.pad
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        OH, OW = self.out_spatial
        step = ws["key"][1]
        dcol = self._buffer(ws, "col", step * self.P * kh * kw * C, dyr.dtype)
        dcol = dcol[:n * self.P * kh * kw * C].reshape(n * self.P, G, kh * kw * Cg)
        for g in range(G):
            dcol[:, g] = dyr[:, g * Og:(g + 1) * Og] @ wr[g]
        d7 = dcol.reshape(n, OH, OW, G, kh, kw, Cg)
        dpad = self._buffer(ws, "dpad", (step, H + 2 * ph, W + 2 * pw, G, Cg), dyr.dtype)[:n]
        dpad[...] = 0
        for i in range(kh):
            hs = slice(i * dh, i * dh + sh * (OH - 1) + 1, sh)
            for j in range(kw):
                wsl = slice(j * dw, j * dw + sw * (OW - 1) + 1, sw)
                dpad[:, hs, wsl] += d7[:, :, :, :, i, j]  # one offset never repeats a pixel
        dx[...] = dpad[:, ph:ph + H, pw:pw + W].reshape(n, H, W, C).transpose(0, 3, 1, 2)

    # -- numpy 2-D, few input channels: channel-major columns -----------------------------
    # With 1-3 channels a channel-last copy moves runs of only kw*C values; the
    # classic layout (C*kh*kw, n*OH*OW) (Caffe's rows) copies whole output rows.
    def _cn_padded(self, ws, x, n):
        (H, W), (ph, pw) = self.in_spatial, self.pad
        step = ws["key"][1]
        xpad = self._buffer(ws, "xpad", (self.C, step, H + 2 * ph, W + 2 * pw), x.dtype,
                            zero=True)[:, :n]
        xpad[:, :, ph:ph + H, pw:pw + W] = x.transpose(1, 0, 2, 3)
        return xpad

    def _cn_im2col(self, ws, x, n):
        """col (C*kh*kw, n*OH*OW) of the n images ``x``, one strided copy."""
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        OH, OW = self.out_spatial
        xpad = self._cn_padded(ws, x, n)
        st = xpad.strides
        view = as_strided(xpad, (self.C, kh, kw, n, OH, OW),
                          (st[0], dh * st[2], dw * st[3], st[1], sh * st[2], sw * st[3]),
                          writeable=False)
        size = self.C * self.ksize * self.P
        col = self._buffer(ws, "col", ws["key"][1] * size, x.dtype)[:n * size]
        np.copyto(col.reshape(self.C, kh, kw, n, OH, OW), view)
        return col.reshape(self.C * self.ksize, n * self.P)

    def _cn_col2im(self, ws, col, dx, n):
        """dx (n, C, H, W) = col2im(col (C*kh*kw, n*OH*OW))."""
        (H, W), (ph, pw) = self.in_spatial, self.pad
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        OH, OW = self.out_spatial
        dpad = self._buffer(ws, "cn_dpad", (self.C, ws["key"][1], H + 2 * ph, W + 2 * pw),
                            col.dtype)[:, :n]
        dpad[...] = 0
        col6 = col.reshape(self.C, kh, kw, n, OH, OW)
        for i in range(kh):
            hs = slice(i * dh, i * dh + sh * (OH - 1) + 1, sh)
            for j in range(kw):
                wsl = slice(j * dw, j * dw + sw * (OW - 1) + 1, sw)
                dpad[:, :, hs, wsl] += col6[:, i, j]
        dx[...] = dpad[:, :, ph:ph + H, pw:pw + W].transpose(1, 0, 2, 3)

    # The GEMMs run per image on the image's columns (a strided (C*kh*kw, OH*OW)
    # slice of the chunk's matrix), so the output is written in place and dy is
    # read in place: no (O, n*P) <-> (n, O, P) transposing copies (conv1 of
    # CIFAR-10: 13.7 -> 11.5 ms forward, 18.9 -> 15.8 ms weight gradient).
    def _fwd_cn(self, x, w, y, budget):
        N, G, P, O = x.shape[0], self.G, self.P, self.O
        Og = O // G
        w3 = w.reshape(G, Og, -1)
        step = self.chunk(N, x.dtype.itemsize, budget, MIN_GEMM_COLUMNS)
        ws = self._workspace(x.dtype, step)
        direct = y.flags.c_contiguous
        for n0 in range(0, N, step):
            n = min(N, n0 + step) - n0
            col = self._cn_im2col(ws, x[n0:n0 + n], n)
            if direct:
                col4 = col.reshape(G, -1, n, P)
                for s in range(n):
                    ys = y[n0 + s].reshape(G, Og, P)
                    for g in range(G):
                        np.matmul(w3[g], col4[g, :, s], out=ys[g])
                continue
            out = self._buffer(ws, "cn_out", O * step * P, x.dtype)[:O * n * P]
            np.matmul(w3, col.reshape(G, -1, n * P), out=out.reshape(G, Og, n * P))
            y[n0:n0 + n] = out.reshape(O, n, *self.out_spatial).transpose(1, 0, 2, 3)

    def _bwd_cn(self, x, w, dy, dw, dx, budget):
        N, G, P, O = dy.shape[0], self.G, self.P, self.O
        Og = O // G
        w3 = w.reshape(G, Og, -1)
        dw3 = None if dw is None else np.zeros((G, Og, w3.shape[2]), dw.dtype)
        step = self.chunk(N, dy.dtype.itemsize, budget, MIN_GEMM_COLUMNS)
        ws = self._workspace(dy.dtype, step)
        for n0 in range(0, N, step):
            n = min(N, n0 + step) - n0
            if dw3 is not None:
                col4 = self._cn_im2col(ws, x[n0:n0 + n], n).reshape(G, -1, n, P)
                for s in range(n):
                    d = dy[n0 + s].reshape(G, Og, P)
                    for g in range(G):
                        dw3[g] += d[g] @ col4[g, :, s].T
            if dx is not None:
                dy2 = self._buffer(ws, "cn_out", O * step * P, dy.dtype)[:O * n * P]
                dy2.reshape(O, n, *self.out_spatial)[...] = dy[n0:n0 + n].transpose(1, 0, 2, 3)
                dy3 = dy2.reshape(G, Og, n * P)
                size = self.C * self.ksize * self.P
                dcol = self._buffer(ws, "col", step * size, dy.dtype)[:n * size]
                dcol = dcol.reshape(G, -1, n * P)
                np.matmul(w3.transpose(0, 2, 1), dy3, out=dcol)
                self._cn_col2im(ws, dcol, dx[n0:n0 + n], n)
        if dw3 is not None:
            dw += dw3.reshape(dw.shape)

    # -- generic (CuPy, N-D) ------------------------------------------------------------
    def _im2col(self, x):
        a = (self.kernel, self.pad, self.stride, self.dilation)
        return K.im2col(x, *a) if self.ns == 2 else K.im2col_nd(x, *a)

    def _col2im(self, col, shape):
        a = (self.kernel, self.pad, self.stride, self.dilation)
        return K.col2im(col, shape, *a) if self.ns == 2 else K.col2im_nd(col, shape, *a)

    def forward_generic(self, xp, x, w, y, budget):
        """The reference path every shape and array module can take: im2col from the
        kernels package and one batched GEMM per chunk of images (``forward`` picks a
        faster numpy path where one applies)."""
        N, G, P, O = x.shape[0], self.G, self.P, self.O
        w3 = w.reshape(G, O // G, -1)
        step = self.chunk(N, x.dtype.itemsize, budget)
        for n0 in range(0, N, step):
            n = min(N, n0 + step) - n0
            col = self._im2col(x[n0:n0 + n]).reshape(G, -1, n * P)
            out = gemm_batched(xp, w3, col, xp.empty((G, O // G, n * P), dtype=y.dtype),
                               tf32=self.tf32)
            y[n0:n0 + n] = out.reshape(O, n, *self.out_spatial).swapaxes(0, 1)

    def backward_generic(self, xp, x, w, dy, dw, dx, budget):
        """The reference backward (im2col/col2im and batched GEMMs), as ``forward_generic``."""
        N, G, P, O = dy.shape[0], self.G, self.P, self.O
        w3 = w.reshape(G, O // G, -1)
        dw3 = None if dw is None else dw.reshape(G, O // G, -1)
        step = self.chunk(N, dy.dtype.itemsize, budget)
        for n0 in range(0, N, step):
            n = min(N, n0 + step) - n0
            dy3 = dy[n0:n0 + n].swapaxes(0, 1).reshape(G, O // G, n * P)
            if dw3 is not None:
                col = self._im2col(x[n0:n0 + n]).reshape(G, -1, n * P)
                gemm_batched(xp, dy3, col, dw3, trans_b=True, beta=1.0, tf32=self.tf32)
            if dx is not None:
                dcol = gemm_batched(xp, w3, dy3, xp.empty((G, w3.shape[2], n * P), dy.dtype),
                                    trans_a=True, tf32=self.tf32).reshape(self.C * self.ksize,
                                                                          n * P)
                dx[n0:n0 + n] = self._col2im(dcol, dx[n0:n0 + n].shape)


def _budget(xp):
    return COL_BUFFER_BYTES["cpu" if xp is np else "gpu"]


# ---------------------------------------------------------------------------
# Convolution, Deconvolution, Im2col
# ---------------------------------------------------------------------------
class _ConvGeometry(Layer):
    """Reads ConvolutionParameter's geometry (kernel, stride, pad, dilation,
    axis) as Caffe's BaseConvolutionLayer does."""
    allow_in_place = False

    def read_geometry(self, bottom):
        p = self.layer_param.convolution_param
        try:
            self.channel_axis = bottom[0].canonical_axis_index(p.axis)
        except IndexError:
            raise self.error(f"axis {p.axis} is out of range for bottom shape "
                             f"{bottom[0].shape}: no spatial axes") from None
        ns = bottom[0].num_axes - self.channel_axis - 1
        if ns < 1:
            raise self.error(f"bottom shape {bottom[0].shape} has no spatial axes after "
                             f"axis {p.axis}")
        self.num_spatial = ns
        self.kernel = _per_axis(p.kernel_size, "kernel_h", "kernel_w", p, ns, None, "kernel", self)
        self.stride = _per_axis(p.stride, "stride_h", "stride_w", p, ns, 1, "stride", self)
        self.pad = _per_axis(p.pad, "pad_h", "pad_w", p, ns, 0, "pad", self)
        self.dilation = _per_axis(p.dilation, "dilation_h", "dilation_w", p, ns, 1,
                                  "dilation", self)
        for name, vals in (("kernel", self.kernel), ("stride", self.stride),
                           ("dilation", self.dilation)):
            if min(vals) <= 0:
                raise self.error(f"{name} dimensions must be positive, got {vals}")
        self.channels = bottom[0].shape[self.channel_axis]

    def conv_out_spatial(self, in_spatial):
        """Convolution output size per spatial axis; one-line error when the
        (dilated) kernel does not fit the padded input."""
        out = []
        for i, size in enumerate(in_spatial):
            ext = self.dilation[i] * (self.kernel[i] - 1) + 1
            if size + 2 * self.pad[i] < ext:
                raise self.error(f"kernel extent {ext} (kernel_size {self.kernel[i]}, dilation "
                                 f"{self.dilation[i]}) is larger than the padded input "
                                 f"{size} + 2*pad {self.pad[i]} on spatial axis {i} "
                                 f"(bottom spatial shape {tuple(in_spatial)})")
            out.append((size + 2 * self.pad[i] - ext) // self.stride[i] + 1)
        return out

    def _nd(self, a, channels, spatial):
        """View of a blob array as (num, channels, *spatial), leading axes merged."""
        return a.reshape((-1, channels) + tuple(spatial))


class BaseConvolutionLayer(_ConvGeometry):
    capturable = True
    min_bottom_blobs = 1
    min_top_blobs = 1
    equal_num_bottom_top_blobs = True
    reverse_dimensions = False

    def layer_setup(self, bottom, top):
        p = self.layer_param.convolution_param
        self.read_geometry(bottom)
        self.num_output = p.num_output
        if self.num_output <= 0:
            raise self.error(f"num_output must be positive, got {self.num_output}")
        self.group = p.group
        if self.group <= 0 or self.channels % self.group or self.num_output % self.group:
            raise self.error(f"group ({self.group}) must divide both the input channels "
                             f"({self.channels}, bottom shape {bottom[0].shape}) and "
                             f"num_output ({self.num_output})")
        if self.reverse_dimensions:
            self.conv_out, self.conv_in = self.channels, self.num_output
        else:
            self.conv_out, self.conv_in = self.num_output, self.channels
        self.bias_term = p.bias_term
        wshape = (self.conv_out, self.conv_in // self.group) + tuple(self.kernel)
        if self.blobs:
            n = 1 + int(self.bias_term)
            if len(self.blobs) != n:
                raise self.error(f"incorrect number of weight blobs ({len(self.blobs)}, "
                                 f"expected {n})")
            if self.blobs[0].shape != wshape:
                raise self.error(f"incorrect weight shape: expected {wshape}; instead, shape "
                                 f"was {self.blobs[0].shape}")
            if self.bias_term and self.blobs[1].shape != (self.num_output,):
                raise self.error(f"incorrect bias shape: expected ({self.num_output},); "
                                 f"instead, shape was {self.blobs[1].shape}")
        else:
            dtype = bottom[0].dtype
            self.blobs = [Blob(wshape, dtype)]
            fill(self.blobs[0], p.weight_filler)
            if self.bias_term:
                self.blobs.append(Blob((self.num_output,), dtype))
                fill(self.blobs[1], p.bias_filler)
        self.param_propagate_down = [True] * len(self.blobs)
        self.engine = None

    def reshape(self, bottom, top):
        first = bottom[0].shape
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != first:
                raise self.error(f"all inputs must have the same shape: bottom 0 {first}, "
                                 f"bottom {i} {b.shape}")
        if len(first) != self.channel_axis + 1 + self.num_spatial:
            raise self.error(f"bottom shape {first} does not have the {self.num_spatial} "
                             f"spatial axes the layer was set up for")
        if first[self.channel_axis] != self.channels:
            raise self.error(f"input has {first[self.channel_axis]} channels (bottom shape "
                             f"{first}), the layer was set up for {self.channels}")
        self.in_spatial = first[self.channel_axis + 1:]
        self.out_spatial = self.compute_output_shape()
        for t in top:
            t.reshape(first[:self.channel_axis] + (self.num_output,) + tuple(self.out_spatial))
        # the engine sees a convolution: input (conv_in, in) -> output (conv_out, out)
        if self.reverse_dimensions:
            geo = (self.num_output, self.channels, self.out_spatial, self.in_spatial)
        else:
            geo = (self.channels, self.num_output, self.in_spatial, self.out_spatial)
        cin, cout, sin, sout = geo
        e = self.engine
        if (e is None or (e.C, e.O, e.in_spatial, e.out_spatial)
                != (cin, cout, tuple(sin), tuple(sout))):
            self.engine = ConvEngine(cin, cout, self.group, self.kernel, self.pad, self.stride,
                                     self.dilation, sin, sout)
        self.engine.tf32 = self.config.tf32

    retain_inputs, retain_outputs = None, ()

    def _add_bias(self, xp, y):
        y += self.blobs[1].data_for(xp).reshape((1, -1) + (1,) * self.num_spatial)

    def _bias_grad(self, xp, dy):
        if self.bias_term and self.get_param_propagate_down(1):
            s = dy.reshape(dy.shape[0], self.num_output, -1).sum(axis=2).sum(axis=0)
            self.blobs[1].mutable_diff_for(xp)[...] += s


@register_layer("Convolution")
class ConvolutionLayer(BaseConvolutionLayer):
    """y = W * x + b over the spatial axes after ``axis`` (groups, stride, pad,
    dilation, N-D).  Bottoms (num, C, *S) -> tops (num, num_output, *S');
    weights (num_output, C/group, *kernel), bias (num_output,).  Backward:
    dW += dy (x) x, db += sum dy, dx = W^T (x) dy (col2im)."""

    def compute_output_shape(self):
        return self.conv_out_spatial(self.in_spatial)

    def forward_xp(self, xp, bottom, top):
        w = self.blobs[0].data_for(xp)
        for b, t in zip(bottom, top):
            x = self._nd(b.data_for(xp), self.channels, self.in_spatial)
            y = self._nd(t.mutable_data_for(xp), self.num_output, self.out_spatial)
            self.engine.forward(xp, x, w, y, _budget(xp))
            if self.bias_term:
                self._add_bias(xp, y)

    def backward_xp(self, xp, top, propagate_down, bottom):
        w = self.blobs[0].data_for(xp)
        dw = self.blobs[0].mutable_diff_for(xp) if self.get_param_propagate_down(0) else None
        for i, (b, t) in enumerate(zip(bottom, top)):
            dy = self._nd(t.diff_for(xp), self.num_output, self.out_spatial)
            self._bias_grad(xp, dy)
            dx = None
            if propagate_down[i]:
                dx = self._nd(b.mutable_diff_for(xp), self.channels, self.in_spatial)
            x = self._nd(b.data_for(xp), self.channels, self.in_spatial)
            self.engine.backward(xp, x, w, dy, _budget(xp), dw=dw, dx=dx)


@register_layer("Deconvolution")
class DeconvolutionLayer(BaseConvolutionLayer):
    """The transpose of Convolution: forward is convolution's data gradient.
    Output size s(H - 1) + d(k-1) + 1 - 2p.  Weights (C, num_output/group, *k)."""
    reverse_dimensions = True

    def compute_output_shape(self):
        out = []
        for i, size in enumerate(self.in_spatial):
            ext = self.dilation[i] * (self.kernel[i] - 1) + 1
            o = self.stride[i] * (size - 1) + ext - 2 * self.pad[i]
            if o <= 0:
                raise self.error(f"output size {o} on spatial axis {i} is not positive "
                                 f"(input {size}, kernel_size {self.kernel[i]}, stride "
                                 f"{self.stride[i]}, pad {self.pad[i]})")
            out.append(o)
        return out

    def forward_xp(self, xp, bottom, top):
        w = self.blobs[0].data_for(xp)
        for b, t in zip(bottom, top):
            x = self._nd(b.data_for(xp), self.channels, self.in_spatial)
            y = self._nd(t.mutable_data_for(xp), self.num_output, self.out_spatial)
            self.engine.backward(xp, None, w, x, _budget(xp), dx=y)
            if self.bias_term:
                self._add_bias(xp, y)

    def backward_xp(self, xp, top, propagate_down, bottom):
        w = self.blobs[0].data_for(xp)
        dw = self.blobs[0].mutable_diff_for(xp) if self.get_param_propagate_down(0) else None
        for i, (b, t) in enumerate(zip(bottom, top)):
            dy = self._nd(t.diff_for(xp), self.num_output, self.out_spatial)
            self._bias_grad(xp, dy)
            x = self._nd(b.data_for(xp), self.channels, self.in_spatial)
            if dw is not None:
                # as a convolution the "input" is dy and the "output gradient" is x
                self.engine.backward(xp, dy, w, x, _budget(xp), dw=dw)
            if propagate_down[i]:
                dx = self._nd(b.mutable_diff_for(xp), self.channels, self.in_spatial)
                self.engine.forward(xp, dy, w, dx, _budget(xp))


@register_layer("Im2col")
class Im2colLayer(_ConvGeometry):
    """Caffe's Im2col layer: bottom (num, C, *S) -> top (num, C*prod(kernel), *S'),
    each output position holding its receptive field (rows channel-major, then
    kernel offsets).  Backward is col2im (overlaps summed)."""
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        self.read_geometry(bottom)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != self.channel_axis + 1 + self.num_spatial:
            raise self.error(f"bottom shape {shape} does not have the {self.num_spatial} "
                             f"spatial axes the layer was set up for")
        if shape[self.channel_axis] != self.channels:
            raise self.error(f"input has {shape[self.channel_axis]} channels (bottom shape "
                             f"{shape}), the layer was set up for {self.channels}")
        self.in_spatial = shape[self.channel_axis + 1:]
        self.out_spatial = self.conv_out_spatial(self.in_spatial)
        self.ksize = math.prod(self.kernel)
        top[0].reshape(shape[:self.channel_axis] + (self.channels * self.ksize,)
                       + tuple(self.out_spatial))

    def _geo(self):
        return (self.kernel, self.pad, self.stride, self.dilation)

    def forward_xp(self, xp, bottom, top):
        x = self._nd(bottom[0].data_for(xp), self.channels, self.in_spatial)
        N, CK, P = x.shape[0], self.channels * self.ksize, math.prod(self.out_spatial)
        col = (K.im2col(x, *self._geo()) if self.num_spatial == 2
               else K.im2col_nd(x, *self._geo()))
        y = top[0].mutable_data_for(xp).reshape(N, CK, P)
        y[...] = col.reshape(CK, N, P).swapaxes(0, 1)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        N = bottom[0].count() // bottom[0].count(self.channel_axis)
        CK, P = self.channels * self.ksize, math.prod(self.out_spatial)
        dy = top[0].diff_for(xp).reshape(N, CK, P)
        col = xp.ascontiguousarray(dy.swapaxes(0, 1)).reshape(CK, N * P)
        shape = (N, self.channels) + tuple(self.in_spatial)
        dx = (K.col2im(col, shape, *self._geo()) if self.num_spatial == 2
              else K.col2im_nd(col, shape, *self._geo()))
        bottom[0].mutable_diff_for(xp)[...] = dx.reshape(bottom[0].shape)


# ---------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------
_Pool = caffe_pb2.PoolingParameter


def pooled_size(size, kernel, stride, pad, round_mode=_Pool.CEIL):
    """Caffe's pooled output size on one axis (CEIL or FLOOR, then the padding
    correction: the last window must start inside the image or left padding)."""
    r = math.ceil if round_mode == _Pool.CEIL else math.floor
    out = int(r((size + 2 * pad - kernel) / stride)) + 1
    if pad > 0 and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@register_layer("Pooling")
class PoolingLayer(Layer):
    """MAX, AVE or STOCHASTIC pooling over (H, W) of a (N, C, H, W) bottom.
    Caffe's CEIL output rounding (or FLOOR) and padding rules (see
    kernels/pooling.py: AVE divides by the window clipped to the padded
    input); optional second top: the MAX argmax mask (flat h*W+w, as float).
    Backward routes dy to the argmax (MAX), the sampled element (STOCHASTIC)
    or spreads dy/pool_size over the window (AVE)."""
    allow_in_place = False

    @property
    def capturable(self):
        """STOCHASTIC pooling in TRAIN draws from CuPy's generator (cuRAND): not capturable."""
        return not (self.method == _Pool.STOCHASTIC and self.phase == caffe_pb2.TRAIN)

    exact_num_bottom_blobs = 1
    min_top_blobs = 1
    max_top_blobs = 2

    def layer_setup(self, bottom, top):
        p = self.layer_param.pooling_param
        self.global_pooling = p.global_pooling
        has_kh = p.HasField("kernel_h") or p.HasField("kernel_w")
        if self.global_pooling:
            if p.HasField("kernel_size") or has_kh:
                raise self.error("with global_pooling: true filter size cannot be specified")
        else:
            if p.HasField("kernel_size") and has_kh:
                raise self.error("filter size is kernel_size OR kernel_h and kernel_w; not both")
            if not p.HasField("kernel_size") and not (p.HasField("kernel_h")
                                                       and p.HasField("kernel_w")):
                raise self.error("for non-square filters both kernel_h and kernel_w are required"
                                 if has_kh else "kernel_size (or kernel_h and kernel_w) must "
                                 "be specified")
        if p.HasField("pad") and (p.HasField("pad_h") or p.HasField("pad_w")):
            raise self.error("pad is pad OR pad_h and pad_w; not both")
        if p.HasField("pad_h") != p.HasField("pad_w"):
            raise self.error("both pad_h and pad_w are required")
        if p.HasField("stride") and (p.HasField("stride_h") or p.HasField("stride_w")):
            raise self.error("stride is stride OR stride_h and stride_w; not both")
        if p.HasField("stride_h") != p.HasField("stride_w"):
            raise self.error("both stride_h and stride_w are required")
        if p.HasField("kernel_size"):
            self.kernel = [p.kernel_size] * 2
        elif not self.global_pooling:
            self.kernel = [p.kernel_h, p.kernel_w]
        self.pad = [p.pad_h, p.pad_w] if p.HasField("pad_h") else [p.pad] * 2
        self.stride = [p.stride_h, p.stride_w] if p.HasField("stride_h") else [p.stride] * 2
        if self.global_pooling and (max(self.pad) != 0 or max(self.stride) != 1):
            raise self.error(f"with global_pooling: true only pad = 0 and stride = 1 are "
                             f"allowed (pad {self.pad}, stride {self.stride})")
        if min(self.stride) <= 0:
            raise self.error(f"stride must be positive, got {self.stride}")
        if max(self.pad) > 0 and p.pool not in (_Pool.AVE, _Pool.MAX):
            raise self.error("padding implemented only for average and max pooling")
        if not self.global_pooling:
            if min(self.kernel) <= 0:
                raise self.error(f"filter dimensions must be greater than zero, got "
                                 f"{self.kernel}")
            if self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]:
                raise self.error(f"pad {self.pad} must be smaller than kernel_size "
                                 f"{self.kernel}")
        if len(top) > 1 and p.pool != _Pool.MAX:
            raise self.error("a second (mask) top is only produced by MAX pooling")
        self.method = p.pool
        self.round_mode = p.round_mode
        self.mask = None

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got "
                             f"shape {bottom[0].shape}")
        N, C, H, W = bottom[0].shape
        if self.global_pooling:
            self.kernel = [H, W]
        # the kernels compute Caffe's CEIL geometry; FLOOR keeps its leading windows.  A
        # kernel larger than the padded input gives Caffe's one clipped window (CEIL).
        self.ceil_shape = K.pool_output_shape(H, W, self.kernel, self.stride, self.pad)
        self.out_shape = tuple(pooled_size(s, k, st, p, self.round_mode) for s, k, st, p
                               in zip((H, W), self.kernel, self.stride, self.pad))
        if min(self.out_shape) <= 0:
            raise self.error(f"kernel_size {self.kernel} leaves no output on the padded input "
                             f"{H}x{W} + 2*pad {self.pad} (bottom shape {bottom[0].shape})")
        for t in top:
            t.reshape((N, C) + self.out_shape)

    # MAX keeps its own mask, AVE needs nothing; STOCHASTIC reads what it saw
    @property
    def retain_inputs(self):
        return () if self.method in (_Pool.MAX, _Pool.AVE) else None

    @property
    def retain_outputs(self):
        return () if self.method in (_Pool.MAX, _Pool.AVE) else None

    def state_bytes(self, bottom, top):
        if self.method == _Pool.MAX:   # the int32 argmax mask (Caffe's ceil geometry)
            return top[0].count() * 4
        return 0

    def _crop(self, a):
        PH, PW = self.out_shape
        return a if self.out_shape == tuple(self.ceil_shape) else a[:, :, :PH, :PW]

    def _uncrop(self, xp, dy):
        if self.out_shape == tuple(self.ceil_shape):
            return dy
        full = xp.zeros(dy.shape[:2] + tuple(self.ceil_shape), dtype=dy.dtype)
        full[:, :, :dy.shape[2], :dy.shape[3]] = dy
        return full

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        geo = (self.kernel, self.stride, self.pad)
        # CEIL geometry (the usual case): the kernels write straight into the top
        out = top[0].mutable_data_for(xp) if self.out_shape == tuple(self.ceil_shape) else None
        if self.method == _Pool.MAX:
            mask_out = None
            if xp is not np:   # one mask buffer for the layer's life (fixed address)
                shape = x.shape[:2] + tuple(self.ceil_shape)
                if getattr(self, "_mask_buf", None) is None or self._mask_buf.shape != shape:
                    self._mask_buf = xp.empty(shape, dtype=np.int32)
                mask_out = self._mask_buf
            y, self.mask = K.max_pool_forward(x, *geo, out=out, mask_out=mask_out)
            if len(top) > 1:
                top[1].mutable_data_for(xp)[...] = self._crop(self.mask)
        elif self.method == _Pool.AVE:
            y = K.ave_pool_forward(x, *geo, out=out)
        elif self.phase == caffe_pb2.TRAIN:
            shape = x.shape[:2] + tuple(self.ceil_shape)
            u = (context.rng().uniform(0, 1, size=shape).astype(x.dtype) if xp is np
                 else context.gpu_rng().uniform(0, 1, size=shape, dtype=x.dtype))
            y, self.mask = K.stochastic_pool_forward_train(x, u, *geo)
        else:
            y = K.stochastic_pool_forward_test(x, *geo)
        if y is not out:
            top[0].mutable_data_for(xp)[...] = self._crop(y)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = self._uncrop(xp, top[0].diff_for(xp))
        shape = bottom[0].shape
        geo = (self.kernel, self.stride, self.pad)
        out = bottom[0].mutable_diff_for(xp)   # the kernels write the gradient into it
        if self.method == _Pool.MAX:
            mask = self.mask
            if mask is None:  # backward without a forward: the mask top has it
                mask = self._uncrop(xp, top[1].data_for(xp).astype(np.int32) + 1) - 1
            K.max_pool_backward(dy, mask, shape, *geo, out=out)
        elif self.method == _Pool.AVE:
            K.ave_pool_backward(dy, shape, *geo, out=out)
        else:
            if self.mask is None:
                raise self.error("stochastic pooling backward needs a TRAIN forward first")
            K.stochastic_pool_backward(dy, self.mask, shape, *geo, out=out)


# ---------------------------------------------------------------------------
# LRN
# ---------------------------------------------------------------------------
_LRN = caffe_pb2.LRNParameter


@register_layer("LRN")
class LRNLayer(Layer):
    """Local response normalisation of a (N, C, H, W) bottom.
    ACROSS_CHANNELS: y = x (k + alpha/n sum_{window of n channels} x^2)^-beta;
    WITHIN_CHANNEL: y = x (1 + alpha/n^2 sum_{n x n window} x^2)^-beta (Caffe's
    composition of pooling and power layers: k is not used).  Backward is the
    exact gradient (kernels/lrn.py)."""
    capturable = True
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.lrn_param
        self.size = p.local_size
        if self.size % 2 != 1:
            raise self.error(f"LRN only supports odd values for local_size, got {self.size}")
        self.alpha, self.beta, self.k = p.alpha, p.beta, p.k
        self.region = p.norm_region
        self.scale = self.x_saved = None

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got "
                             f"shape {bottom[0].shape}")
        top[0].reshape(bottom[0].shape)

    def state_bytes(self, bottom, top):
        n = bottom[0].count() * bottom[0].dtype.itemsize
        return n * (2 if top[0] is bottom[0] else 1)   # the scale, and x when in place

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        # in place, backward still needs the input: keep a copy
        self.x_saved = x.copy() if top[0] is bottom[0] else None
        if self.region == _LRN.ACROSS_CHANNELS:
            y, self.scale = K.lrn_across_channels_forward(x, self.size, self.alpha, self.beta,
                                                          self.k)
        else:
            y, self.scale = K.lrn_within_channel_forward(x, self.size, self.alpha, self.beta)
        top[0].mutable_data_for(xp)[...] = y

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = self.x_saved if self.x_saved is not None else bottom[0].data_for(xp)
        args = (top[0].diff_for(xp), x, top[0].data_for(xp), self.scale,
                self.size, self.alpha, self.beta)
        if self.region == _LRN.ACROSS_CHANNELS:
            dx = K.lrn_across_channels_backward(*args)
        else:
            dx = K.lrn_within_channel_backward(*args)
        bottom[0].mutable_diff_for(xp)[...] = dx


# ---------------------------------------------------------------------------
# SPP
# ---------------------------------------------------------------------------
@register_layer("SPP")
class SPPLayer(Layer):
    """Spatial pyramid pooling: for level l < pyramid_height, pool the
    (N, C, H, W) bottom into about 2^l x 2^l bins (kernel ceil(H/2^l), stride =
    kernel, pad (kernel*2^l - H + 1)/2, Caffe's Pooling rules), flatten each
    level and concatenate: top (N, C * sum_l bins_l).  pyramid_height 1 gives
    the single pooling's 4-D top (N, C, 1, 1), as in Caffe."""
    allow_in_place = False
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.spp_param
        self.pyramid_height = p.pyramid_height
        if self.pyramid_height < 1:
            raise self.error(f"pyramid_height must be at least 1, got {self.pyramid_height}")
        self.pool = p.pool
        self.in_shape = None

    def _pool_param(self, level, H, W):
        bins = 2 ** level
        lp = caffe_pb2.LayerParameter(name=f"{self.name} (pyramid level {level})",
                                      type="Pooling", phase=self.phase)
        pp = lp.pooling_param
        kh, kw = -(-H // bins), -(-W // bins)
        pp.kernel_h, pp.kernel_w = kh, kw
        pp.stride_h, pp.stride_w = kh, kw
        pp.pad_h, pp.pad_w = (kh * bins - H + 1) // 2, (kw * bins - W + 1) // 2
        pp.pool = self.pool
        return lp

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got "
                             f"shape {bottom[0].shape}")
        N, C, H, W = bottom[0].shape
        if H <= 0 or W <= 0:
            raise self.error(f"input dimensions cannot be zero (bottom shape {bottom[0].shape})")
        if self.in_shape != (N, C, H, W):
            self.in_shape = (N, C, H, W)
            self.pools, self.pool_tops = [], []
            for level in range(self.pyramid_height):
                layer = PoolingLayer(self._pool_param(level, H, W))
                t = Blob(dtype=bottom[0].dtype)
                layer.setup(bottom, [t])
                self.pools.append(layer)
                self.pool_tops.append(t)
        for layer, t in zip(self.pools, self.pool_tops):
            layer.reshape(bottom, [t])
        if self.pyramid_height == 1:
            top[0].reshape(self.pool_tops[0].shape)
        else:
            top[0].reshape((N, sum(t.count(1) for t in self.pool_tops)))

    def forward_xp(self, xp, bottom, top):
        y = top[0].mutable_data_for(xp).reshape(self.in_shape[0], -1)
        off = 0
        for layer, t in zip(self.pools, self.pool_tops):
            layer.forward_xp(xp, bottom, [t])
            n = t.count(1)
            y[:, off:off + n] = t.data_for(xp).reshape(self.in_shape[0], n)
            off += n

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff_for(xp).reshape(self.in_shape[0], -1)
        total = None
        off = 0
        for layer, t in zip(self.pools, self.pool_tops):
            n = t.count(1)
            t.mutable_diff_for(xp)[...] = dy[:, off:off + n].reshape(t.shape)
            off += n
            layer.backward_xp(xp, [t], [True], bottom)
            d = bottom[0].diff_for(xp)
            total = d.copy() if total is None else total + d
        bottom[0].mutable_diff_for(xp)[...] = total


# ---------------------------------------------------------------------------
# Crop
# ---------------------------------------------------------------------------
@register_layer("Crop")
class CropLayer(Layer):
    """Crop bottom 0 to the shape of bottom 1 on the axes from ``axis`` on,
    starting at ``offset`` (none: 0; one value: every cropped axis; else one
    per cropped axis).  Backward: bottom 0's diff is top's diff inside the
    crop and 0 outside; bottom 1 gets no gradient."""
    capturable = True
    exact_num_bottom_blobs = 2
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.crop_param
        nd = bottom[0].num_axes
        try:
            self.start_axis = bottom[0].canonical_axis_index(p.axis)
        except IndexError:
            raise self.error(f"crop axis {p.axis} is out of range for bottom shape "
                             f"{bottom[0].shape}") from None
        if len(p.offset) > 1 and self.start_axis + len(p.offset) != nd:
            raise self.error(f"number of offset values specified ({len(p.offset)}) must be "
                             f"equal to the number of dimensions following axis "
                             f"{self.start_axis} ({nd - self.start_axis}; bottom shape "
                             f"{bottom[0].shape})")
        self.offset_param = list(p.offset)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom, top):
        a, b = bottom[0].shape, bottom[1].shape
        if len(a) != len(b):
            raise self.error(f"bottoms must have the same number of axes: {a} and {b}")
        shape, self.offsets = [], []
        for i in range(len(a)):
            off, size = 0, a[i]
            if i >= self.start_axis:
                size = b[i]
                if len(self.offset_param) == 1:
                    off = self.offset_param[0]
                elif len(self.offset_param) > 1:
                    off = self.offset_param[i - self.start_axis]
                if a[i] - off < b[i]:
                    raise self.error(f"the crop for dimension {i} is out-of-bounds with size "
                                     f"{b[i]} and offset {off} (bottom 0 shape {a}, bottom 1 "
                                     f"shape {b})")
            shape.append(size)
            self.offsets.append(off)
        top[0].reshape(tuple(shape))
        self.region = tuple(slice(o, o + s) for o, s in zip(self.offsets, shape))

    def forward_xp(self, xp, bottom, top):
        top[0].mutable_data_for(xp)[...] = bottom[0].data_for(xp)[self.region]

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].mutable_diff_for(xp)
        dx[...] = 0
        dx[self.region] = top[0].diff_for(xp)
