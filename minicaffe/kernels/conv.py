"""Caffe's convolution engine, im2col + GEMM, for one geometry (``ConvEngine``), forward
and backward, over a bounded chunk of the batch at a time with one GEMM per group:
what layers/vision.py's Convolution, Deconvolution and (through the same calls)
Im2col layers run.  Caffe counterpart: ``base_conv_layer.cpp``'s forward_cpu_gemm /
backward_cpu_gemm / weight_cpu_gemm with ``im2col.cpp``.

* numpy, 2-D: per-layer workspaces (padded input, column matrix, GEMM output) are
  allocated once and reused.  The column matrix is built channel-last, one row per output
  pixel, by a single strided copy; with stride 1 the data gradient is a full convolution
  of dy with the flipped kernel; layers with few input channels use Caffe's channel-major
  columns; a 1x1 kernel with stride 1 and no padding skips im2col.  5x5 stride-1
  one-group layers with enough channels take Winograd's F(4x4, 5x5) instead when the
  layer asks (``winograd=True``: engine DEFAULT; kernels/winograd.py).
* numpy with a kernel pool (core/threads.py: ``--threads N``, N > 1): the chunks of the
  batch run in the pool's threads, each with its own workspace; each chunk writes its
  weight-gradient partial into its own row of one kept array, summed in chunk order as
  the serial loop sums them, so the results are bit-identical to one thread.
* CuPy, or N-D: the whole-chunk ``im2col``/``col2im`` of kernels/im2col.py (CUDA kernels
  on the GPU, strided slicing for N-D) and batched GEMMs (blas.py).

docs/vision.md has the measured figures.
"""
import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..core import threads as _threads
from . import winograd
from .blas import gemm_batched
from .im2col import (col2im, col2im_nd, col2im_padded_into, im2col, im2col_nd,
                     im2col_padded_into)

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
# ... and their weight gradient takes one product per chunk against dy as rows when a
# kernel row holds at least this many values (kernel width x channels per group;
# below, per-image products against dy in place: LeNet's conv1).
CN_DW_ROWS_RUN = 8
# Winograd F(4x4, 5x5) chunks: the tile matrix (64 points x tiles x channels) of one
# chunk within this many bytes.
WINO_BUFFER_BYTES = 1 << 20
# ``forward(..., keep=True)`` keeps what it made of the input (the Winograd path's
# transformed tiles) for the weight gradient of a ``backward`` on the same input, when
# they take at most this many bytes.
KEEP_BYTES = 64 << 20


def _off_4k(count, itemsize):
    """A row length for ``count`` values: one cache line longer when the row would be a
    multiple of 4 KiB (successive rows' loads then fall on the same cache sets)."""
    return count + 64 // itemsize if (count * itemsize) % 4096 == 0 else count


class ConvEngine:
    """im2col + GEMM convolution of one geometry, forward and backward.

    ``x`` is (N, C, *in_spatial), ``w`` is (O, C/G, *kernel), ``y`` is
    (N, O, *out_spatial).  ``forward`` writes ``y`` (plus ``bias`` (O,), when given);
    ``backward`` accumulates the weight gradient into ``dw`` and the bias gradient (dy
    summed over images and pixels) into ``db`` (when given) and overwrites ``dx`` (when
    given).  The numpy 2-D paths add the bias and sum its gradient chunk by chunk, while
    the chunk is in cache (and in the kernel pool's threads).  Deconvolution uses the
    same engine with the roles swapped.
    """

    def __init__(self, channels, num_output, group, kernel, pad, stride, dilation,
                 in_spatial, out_spatial, winograd=False):
        self.C, self.O, self.G = channels, num_output, group
        self.kernel, self.pad = tuple(kernel), tuple(pad)
        self.stride, self.dilation = tuple(stride), tuple(dilation)
        self.in_spatial, self.out_spatial = tuple(in_spatial), tuple(out_spatial)
        self.ksize = math.prod(self.kernel)
        self.P = math.prod(self.out_spatial)
        self.ns = len(self.kernel)
        self.is_1x1 = (all(k == 1 for k in self.kernel) and all(s == 1 for s in self.stride)
                       and all(p == 0 for p in self.pad))
        self._ws = {}  # numpy workspaces: worker slot -> {key: (dtype, chunk), buffers}
        self._dw_buf = None  # numpy: the weight-gradient partials, one row per chunk
        self._kept = None    # numpy Winograd: (the input it was made from, its tiles' V)
        self._epilogue = None  # numpy 2-D: a fused ReLU's work per chunk, during a call
        self.tf32 = None  # cuBLAS math of the GEMMs (the layer's run setting; None: default)
        # numpy: 5x5, stride 1, one group through Winograd's F(4x4, 5x5) when asked
        self.winograd = bool(winograd) and (
            self.ns == 2 and self.G == 1 and self.kernel == (5, 5) and self.stride == (1, 1)
            and self.dilation == (1, 1) and all(p <= 4 for p in self.pad)
            and self.C >= NHWC_MIN_CHANNELS)

    # -- chunking ----------------------------------------------------------------
    def chunk(self, N, itemsize, budget, min_columns=0):
        """Images per chunk: the column buffer within ``budget`` bytes, but at
        least ``min_columns`` GEMM columns; then evened out over the same number of
        chunks (LeNet's conv1: 16+16+16+16 images rather than 18+18+18+10, so that two
        pool threads take 32 each; the count of chunks, and so a run's bits, does not
        depend on the threads)."""
        per_sample = self.C * self.ksize * self.P * itemsize
        n = int(min(N, max(1, budget // max(per_sample, 1), -(-min_columns // self.P))))
        return -(-N // -(-N // n))

    # -- public ------------------------------------------------------------------
    def forward(self, xp, x, w, y, budget, bias=None, keep=False, relu=False):
        """``keep``: a later ``backward`` on the same ``x`` (unchanged) may reuse what the
        forward made of it (the Winograd path's transformed input tiles), as MAX pooling's backward uses its forward's mask.
        ``relu``: then y = max(y, 0) (a plain in-place ReLU after the layer: on the numpy
        2-D paths chunk by chunk, in the chunk's part while it is in cache)."""
        if xp is np and self.ns == 2 and not self.is_1x1:
            self._epilogue = ("relu", y) if relu else None
            try:
                if self.winograd:
                    return self._fwd_wino(x, w, y, bias, keep)
                if self.C // self.G < NHWC_MIN_CHANNELS:
                    return self._fwd_cn(x, w, y, budget, bias)
                return self._fwd_nhwc(x, w, y, budget, bias)
            finally:
                self._epilogue = None
        if xp is np and self.is_1x1:
            self._fwd_1x1(x, w, y)
            if bias is not None:
                y += bias.reshape((1, -1) + (1,) * self.ns)
        else:
            self.forward_generic(xp, x, w, y, budget, bias)
        if relu:
            xp.maximum(y, 0, out=y)

    def backward(self, xp, x, w, dy, budget, dw=None, dx=None, db=None, relu_y=None):
        """``x`` may be None when only ``dx`` is wanted.  ``relu_y``: the output of a
        forward with ``relu``: dy is first masked in place, dy *= (relu_y > 0) (the
        in-place ReLU's backward; on the numpy 2-D paths chunk by chunk)."""
        if xp is np and self.ns == 2 and not self.is_1x1 and (
                dw is not None or dx is not None or db is not None):
            self._epilogue = ("relu_mask", relu_y, dy) if relu_y is not None else None
            try:
                if self.winograd:
                    return self._bwd_wino(x, w, dy, dw, dx, db)
                if self.C // self.G < NHWC_MIN_CHANNELS:
                    return self._bwd_cn(x, w, dy, dw, dx, budget, db)
                return self._bwd_nhwc(x, w, dy, dw, dx, budget, db)
            finally:
                self._epilogue = None
        if relu_y is not None:
            xp.multiply(dy, relu_y > 0, out=dy)
        if xp is np and self.ns == 2 and not self.is_1x1:
            return
        if xp is np and self.is_1x1:
            if db is not None:
                db += self._bias_part(dy)
            if dw is not None or dx is not None:
                self._bwd_1x1(x, w, dy, dw, dx)
            return
        return self.backward_generic(xp, x, w, dy, dw, dx, budget, db)

    @staticmethod
    def _bias_part(dy):
        """A chunk's share of the bias gradient: dy (n, O, *S) summed as the layer sums
        it (pixels, then images)."""
        return dy.reshape(dy.shape[0], dy.shape[1], -1).sum(axis=2).sum(axis=0)

    @staticmethod
    def _sum_in_order(acc, parts):
        """acc += each of ``parts`` in order (chunk order: the serial loop's)."""
        if not parts:
            return
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        acc += total

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
    def _workspace(self, dtype, n, slot=0):
        """The buffers of one worker (``slot``) for chunks of ``n`` images."""
        key = (np.dtype(dtype), n)
        ws = self._ws.get(slot)
        if ws is None or ws["key"] != key:
            ws = self._ws[slot] = {"key": key}
        return ws

    def _chunks(self, N, step, dtype, body):
        """``body(ws, n0, n)`` for each chunk of ``step`` images, in order; with a CPU
        kernel pool (threads.kernel_pool) the chunks run in its threads, each with its
        own workspace, and the results come back in chunk order (so what is summed
        over chunks is summed in the serial order: bit-identical results)."""
        starts = list(range(0, N, step))
        epi = self._epilogue   # a fused in-place ReLU (``forward``/``backward``'s relu)

        def part(slot, i):
            n0 = starts[i]
            n1 = min(N, n0 + step)
            if epi is not None and epi[0] == "relu_mask":   # the ReLU's backward first
                np.multiply(epi[2][n0:n1], epi[1][n0:n1] > 0, out=epi[2][n0:n1])
            out = body(self._workspace(dtype, step, slot), n0, n1 - n0)
            if epi is not None and epi[0] == "relu":        # the ReLU's forward after
                np.maximum(epi[1][n0:n1], 0, out=epi[1][n0:n1])
            return out
        if _threads.kernel_pool() is None or len(starts) < 2 or _threads.in_kernel_pool():
            return [part(0, i) for i in range(len(starts))]
        with _threads.single_blas():   # the pool's threads, each with one BLAS thread
            return _threads.run_parts(len(starts), part)

    def _buffer(self, ws, name, shape, dtype, zero=False):
        """A workspace array made on first use (zero-filled if asked)."""
        if name not in ws:
            ws[name] = (np.zeros if zero else np.empty)(shape, dtype)
        return ws[name]

    def _dw_parts(self, chunks, shape, dtype):
        """(chunks, *shape) array that the chunks write their weight-gradient partials
        into, kept between calls: fresh arrays per chunk (50 of 100 KiB a step for
        CIFAR-10 quick's conv2) cost their page faults on every step, 2.7 ms there."""
        shape = (chunks,) + tuple(shape)
        buf = self._dw_buf
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._dw_buf = np.empty(shape, dtype)
        return buf

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

    def _fwd_nhwc(self, x, w, y, budget, bias=None):
        N, G, P, O = x.shape[0], self.G, self.P, self.O
        Og = O // G
        # (G, kh*kw*Cg, Og), contiguous: OpenBLAS ran col @ wt[g] 3% faster than
        # against the transposed view of the rows (CIFAR-10 quick's conv2)
        wt = np.ascontiguousarray(self._w_rows(w).transpose(0, 2, 1))
        step = self.chunk(N, x.dtype.itemsize, budget, MIN_GEMM_COLUMNS)

        def chunk(ws, n0, n):
            xh = self._nhwc_padded(ws, "xh", x[n0:n0 + n], self.pad, n)
            col = self._patches(ws, "col", xh, G, self.out_spatial, self.stride)
            kc = col.shape[1] // G
            out = self._buffer(ws, "out", (step * P, Og), x.dtype)[:n * P]
            for g in range(G):
                np.matmul(col[:, g * kc:(g + 1) * kc], wt[g], out=out)
                o4 = out.reshape(n, *self.out_spatial, Og).transpose(0, 3, 1, 2)
                if bias is None:
                    y[n0:n0 + n, g * Og:(g + 1) * Og] = o4
                else:   # the bias added in the copy to NCHW: one pass instead of two
                    np.add(o4, bias[g * Og:(g + 1) * Og, None, None],
                           out=y[n0:n0 + n, g * Og:(g + 1) * Og])
        self._chunks(N, step, x.dtype, chunk)

    def _full_conv_ok(self):
        """With stride 1 the data gradient is itself a convolution: dy padded by
        extent-1-pad, correlated with the flipped, transposed kernel: an im2col
        copy of dy and a GEMM instead of a GEMM and col2im's accumulation per
        kernel offset.  Worth it unless dy is much larger than x."""
        if not all(s == 1 for s in self.stride) or not all(
                d * (k - 1) - p >= 0 for k, d, p in zip(self.kernel, self.dilation, self.pad)):
            return False
        return self.O * math.prod(self.in_spatial) <= FULL_CONV_RATIO * self.C * self.P

    def _bwd_nhwc(self, x, w, dy, dw, dx, budget, db=None):
        N, G, P, O, C = dy.shape[0], self.G, self.P, self.O, self.C
        Og, Cg = O // G, C // G
        (kh, kw) = self.kernel
        step = self.chunk(N, dy.dtype.itemsize, budget, MIN_GEMM_COLUMNS)
        full = dx is not None and self._full_conv_ok()
        if dx is not None:
            if full:  # wf[g][(i, j, o), c] = w[g*Og + o, c, kh-1-i, kw-1-j]
                wf = w.reshape(G, Og, Cg, kh, kw)[:, :, :, ::-1, ::-1]
                wf = wf.transpose(0, 3, 4, 1, 2).reshape(G, -1, Cg)
            else:   # wk[g][i*kw + j] = w[g*Og:(g+1)*Og, :, i, j]  (Og, Cg)
                wk = np.ascontiguousarray(
                    w.reshape(G, Og, Cg, kh * kw).transpose(0, 3, 1, 2))
        if dw is not None:   # chunk i's partial (G, Og, kh*kw*Cg) in dwp[i]
            dwp = self._dw_parts(-(-N // step), (G, Og, kh * kw * Cg),
                                 np.result_type(dy.dtype, x.dtype))

        def chunk(ws, n0, n):
            bias = None if db is None else self._bias_part(dy[n0:n0 + n])
            if dw is not None or (dx is not None and not full):
                dyr = self._buffer(ws, "dyr", (step * P, O), dy.dtype)[:n * P]
                dyr.reshape(n, *self.out_spatial, O)[...] = dy[n0:n0 + n].transpose(0, 2, 3, 1)
            if dw is not None:
                xh = self._nhwc_padded(ws, "xh", x[n0:n0 + n], self.pad, n)
                col = self._patches(ws, "col", xh, G, self.out_spatial, self.stride)
                kc = col.shape[1] // G
                for g in range(G):
                    np.matmul(dyr[:, g * Og:(g + 1) * Og].T, col[:, g * kc:(g + 1) * kc],
                              out=dwp[n0 // step, g])
            if dx is not None:
                if full:
                    self._dx_full_conv(ws, wf, dy[n0:n0 + n], dx[n0:n0 + n], n)
                else:
                    self._dx_col2im(ws, wk, dyr, dx[n0:n0 + n], n)
            return bias
        results = self._chunks(N, step, dy.dtype, chunk)
        if db is not None:
            self._sum_in_order(db, results)
        if dw is not None:
            dwr = np.zeros((G, Og, kh * kw * Cg), dw.dtype)
            for part in dwp:      # in chunk order, as the serial loop
                dwr += part
            dw += dwr.reshape(O, kh, kw, Cg).transpose(0, 3, 1, 2)

    def _dx_full_conv(self, ws, wf, dy, dx, n):
        G, C = self.G, self.C
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

    def _dx_col2im(self, ws, wk, dyr, dx, n):
        """dx of the chunk from dyr (n*P, O): per group, one stacked product gives each
        kernel offset's columns as a contiguous (n, OH, OW, Cg) block (``wk``: the
        weights as (G, kh*kw, Og, Cg)), added to the padded gradient offset by offset
        (i, then j): runs of OW*Cg values, where one product for all offsets left runs of
        Cg (col2im took half the time: LeNet's conv2)."""
        G, O, C = self.G, self.O, self.C
        Og, Cg = O // G, C // G
        (H, W), (ph, pw) = self.in_spatial, self.pad
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        OH, OW = self.out_spatial
        step = ws["key"][1]
        dcol = self._buffer(ws, "col", step * self.P * kh * kw * C, dyr.dtype)
        dcol = dcol[:kh * kw * n * self.P * Cg].reshape(kh * kw, n * self.P, Cg)
        dpad = self._buffer(ws, "dpad", (step, H + 2 * ph, W + 2 * pw, G, Cg), dyr.dtype)[:n]
        dpad[...] = 0
        for g in range(G):
            np.matmul(dyr[:, g * Og:(g + 1) * Og], wk[g], out=dcol)
            d6 = dcol.reshape(kh, kw, n, OH, OW, Cg)
            for i in range(kh):
                hs = slice(i * dh, i * dh + sh * (OH - 1) + 1, sh)
                for j in range(kw):
                    wsl = slice(j * dw, j * dw + sw * (OW - 1) + 1, sw)
                    dpad[:, hs, wsl, g] += d6[i, j]  # one offset never repeats a pixel
        dx[...] = dpad[:, ph:ph + H, pw:pw + W].reshape(n, H, W, C).transpose(0, 3, 1, 2)

    # -- numpy 2-D, 5x5, stride 1: Winograd F(4x4, 5x5) (kernels/winograd.py) -------------
    # The output in 4x4 tiles, each from an 8x8 input tile: the tile matrix (8, 8, tiles
    # x channels) is one strided copy of the padded channel-last input (a sixth of
    # im2col's 25 values per output pixel), transformed by two 8x8 GEMMs; the 64 tile
    # points' (tiles, C) x (C, O) products are one stacked matmul; two 4x8 GEMMs give
    # the output tiles.  The backward transforms dy's 4x4 tiles once (A dy A^T): the
    # weight gradient multiplies them with x's transformed tiles per point (summed over
    # the chunks in chunk order, then G^T . G), the data gradient is the forward's
    # adjoint (products with U^T, B . B^T per tile, the overlapping tiles added back).
    def _wino_chunk(self, N, itemsize):
        """Images per chunk: the largest tile matrix within WINO_BUFFER_BYTES, evened
        out over the chunks (as ``chunk``)."""
        tiles = max(math.prod(-(-s // 4) for s in self.out_spatial),
                    math.prod(-(-s // 4) for s in self.in_spatial))
        per_image = 64 * tiles * max(self.C, self.O) * itemsize
        n = int(min(N, max(1, WINO_BUFFER_BYTES // per_image)))
        return -(-N // -(-N // n))

    def _wino_padded(self, ws, name, a, pad, shape, n):
        """``a`` (n, C, H, W) channel-last at offset ``pad`` in a zero-bordered workspace
        array (step, *shape, C)."""
        step, C, H, W = ws["key"][1], a.shape[1], a.shape[2], a.shape[3]
        buf = self._buffer(ws, name, (step,) + tuple(shape) + (C,), a.dtype, zero=True)[:n]
        buf[:, pad[0]:pad[0] + H, pad[1]:pad[1] + W, :] = a.transpose(0, 2, 3, 1)
        return buf

    def _wino_tiles(self, ws, name, src, tiles, size, n, at=(0, 0), out=None):
        """(size, size, n*th*tw*C) copy of the size x size tiles at stride 4 of the
        channel-last ``src`` (n, Hp, Wp, C), starting at row and column ``at`` (into
        ``out`` when given)."""
        (th, tw), C, st = tiles, src.shape[3], src.strides
        view = as_strided(src[:, at[0]:, at[1]:], (size, size, n, th, tw, C),
                          (st[1], st[2], st[0], 4 * st[1], 4 * st[2], st[3]), writeable=False)
        count = n * size * size * th * tw * C
        buf = self._wino_scratch(ws, name, count, src.dtype) if out is None else out[:count]
        np.copyto(buf.reshape(size, size, n, th, tw, C), view)
        return buf.reshape(size, size, -1)

    def _wino_scratch(self, ws, name, count, dtype):
        """A flat workspace array of at least ``count`` values (the chunk's largest)."""
        return self._buffer(ws, name, ws["key"][1] * self._wino_cap, dtype)[:count]

    def _wino_input(self, ws, name, src, tiles, n, out=None):
        """V (64, n*th*tw, C): B^T d B of src's 8x8 tiles (in the tile copy's buffer, or
        in ``out``)."""
        x8 = self._wino_tiles(ws, name, src, tiles, 8, n, out=out)
        z = self._wino_scratch(ws, "wz", x8.size, x8.dtype).reshape(x8.shape)
        winograd.input_tiles(x8, z, x8)
        return x8.reshape(64, -1, src.shape[3])

    def _wino_conv(self, ws, src, u, dst, n, bias=None, keep=None):
        """dst (n, Co, OH, OW) = the 5x5 correlation of the channel-last ``src`` with the
        transformed weights ``u`` (64, Ci, Co), plus ``bias`` (src's V into ``keep``)."""
        Co = u.shape[2]
        OH, OW = dst.shape[2:]
        th, tw = -(-OH // 4), -(-OW // 4)
        v = self._wino_input(ws, "wx", src, (th, tw), n, out=keep)
        T = v.shape[1]
        m = self._wino_scratch(ws, "wm", 64 * T * Co, v.dtype).reshape(64, T, Co)
        np.matmul(v, u, out=m)
        if bias is not None:     # A^T's column of the point 1 is all ones: the bias
            m[winograd.ONES] += bias    # there reaches every output of the tile
        z = self._wino_scratch(ws, "wz", 32 * T * Co, v.dtype).reshape(4, 8, T * Co)
        y4 = self._wino_scratch(ws, "wy", 16 * T * Co, v.dtype).reshape(4, 4, T * Co)
        winograd.output_tiles(m.reshape(64, T * Co), z, y4)
        y6 = y4.reshape(4, 4, n, th, tw, Co).transpose(2, 5, 3, 0, 4, 1)
        if OH == 4 * th and OW == 4 * tw and dst.flags.c_contiguous:
            dst.reshape(n, Co, th, 4, tw, 4)[...] = y6
        else:
            out = self._wino_scratch(ws, "wo", 16 * T * Co, v.dtype).reshape(n, Co, th, 4, tw, 4)
            out[...] = y6
            dst[...] = out.reshape(n, Co, 4 * th, 4 * tw)[:, :, :OH, :OW]

    @property
    def _wino_cap(self):
        """Values per image of the largest Winograd workspace array."""
        tiles = max(math.prod(-(-s // 4) for s in self.out_spatial),
                    math.prod(-(-s // 4) for s in self.in_spatial))
        return 64 * tiles * max(self.C, self.O)

    # -- what the forward keeps for the weight gradient (forward(..., keep=True)) -------
    @staticmethod
    def _identity(x):
        return (x.__array_interface__["data"][0], x.shape, x.strides, x.dtype)

    def _keep_array(self, keep, shape, dtype):
        """The array a forward keeps its input's transformed tiles in, when ``keep``
        and they fit in KEEP_BYTES (the last one reused); drops what was kept."""
        old, self._kept = self._kept, None
        if not keep or math.prod(shape) * np.dtype(dtype).itemsize > KEEP_BYTES:
            return None
        if old is not None and old[1].shape == tuple(shape) and old[1].dtype == dtype:
            return old[1]
        return np.empty(shape, dtype)

    def _kept_from(self, x, kept):
        if kept is not None:
            self._kept = (self._identity(x), kept)

    def _kept_for(self, x, shape):
        """What the last forward kept, if it was made from this ``x`` in this shape."""
        k = self._kept
        if k is not None and k[0] == self._identity(x) and k[1].shape == tuple(shape):
            return k[1]
        return None

    def _fwd_wino(self, x, w, y, bias=None, keep=False):
        N = x.shape[0]
        u = winograd.weights(w)
        step = self._wino_chunk(N, x.dtype.itemsize)
        th, tw = (-(-s // 4) for s in self.out_spatial)
        shape = (4 * th + 4, 4 * tw + 4)
        per = 64 * th * tw * self.C          # V's values per image
        kept = self._keep_array(keep, (N * per,), x.dtype)

        def chunk(ws, n0, n):
            xh = self._wino_padded(ws, "wxh", x[n0:n0 + n], self.pad, shape, n)
            self._wino_conv(ws, xh, u, y[n0:n0 + n], n, bias,
                            None if kept is None else kept[n0 * per:(n0 + n) * per])
        self._chunks(N, step, x.dtype, chunk)
        self._kept_from(x, kept)

    def _bwd_wino(self, x, w, dy, dw, dx, db=None):
        """Both gradients from dy's transformed tiles A dy A^T (64, tiles, O): the weight
        gradient against x's tiles, the data gradient as the forward's adjoint (each
        point's product with U^T, then B . B^T per tile, the 8x8 tiles added back where
        they overlap)."""
        N, C, O = dy.shape[0], self.C, self.O
        (H, W), (OH, OW), (ph, pw) = self.in_spatial, self.out_spatial, self.pad
        th, tw = -(-OH // 4), -(-OW // 4)
        xshape = (4 * th + 4, 4 * tw + 4)
        step = self._wino_chunk(N, dy.dtype.itemsize)
        if dx is not None:
            u = winograd.weights(w)
        if dw is not None:   # chunk i's partial dU (64, C, O) in dwp[i]
            dwp = self._dw_parts(-(-N // step), (64, C, O), np.result_type(dy.dtype, x.dtype))
            per = 64 * th * tw * C   # V of x from the forward, if made from this x
            kept = self._kept_for(x, (N * per,))

        def chunk(ws, n0, n):
            bias = None if db is None else self._bias_part(dy[n0:n0 + n])
            dyh = self._wino_padded(ws, "wdyh", dy[n0:n0 + n], (0, 0), (4 * th, 4 * tw), n)
            d4 = self._wino_tiles(ws, "wd4", dyh, (th, tw), 4, n)
            T = n * th * tw
            z = self._wino_scratch(ws, "wz", 32 * T * O, dy.dtype)
            mdy = self._wino_scratch(ws, "wm", 64 * T * O, dy.dtype).reshape(64, T, O)
            winograd.grad_tiles(d4, z.reshape(8, 4, -1), mdy.reshape(64, -1))
            if dw is not None:
                if kept is None:
                    xh = self._wino_padded(ws, "wxh", x[n0:n0 + n], self.pad, xshape, n)
                    v = self._wino_input(ws, "wv", xh, (th, tw), n)
                else:
                    v = kept[n0 * per:(n0 + n) * per].reshape(64, -1, C)
                np.matmul(v.transpose(0, 2, 1), mdy, out=dwp[n0 // step])
            if dx is not None:
                dv = self._wino_scratch(ws, "wv", 64 * T * C, dy.dtype).reshape(64, T, C)
                np.matmul(mdy, u.transpose(0, 2, 1), out=dv)
                z = self._wino_scratch(ws, "wz", 64 * T * C, dy.dtype).reshape(8, 8, -1)
                dd = self._wino_scratch(ws, "wx", 64 * T * C, dy.dtype).reshape(8, 8, -1)
                winograd.input_tiles_adjoint(dv.reshape(8, 8, -1), z, dd)
                dpad = self._buffer(ws, "wdxh", (ws["key"][1],) + xshape + (C,), dy.dtype)[:n]
                d6 = dpad.reshape(n, th + 1, 4, tw + 1, 4, C)
                d6[:, th] = 0                     # what the first quarters do not cover
                d6[:, :th, :, tw] = 0
                dd8 = dd.reshape(2, 4, 2, 4, n, th, tw, C)
                for bi, bj in ((0, 0), (0, 1), (1, 0), (1, 1)):   # the tiles' 4x4 quarters
                    q = dd8[bi, :, bj].transpose(2, 3, 0, 4, 1, 5)
                    if bi == bj == 0:
                        d6[:, :th, :, :tw] = q
                    else:
                        d6[:, bi:bi + th, :, bj:bj + tw] += q
                dx[n0:n0 + n] = dpad[:, ph:ph + H, pw:pw + W].transpose(0, 3, 1, 2)
            return bias
        results = self._chunks(N, step, dy.dtype, chunk)
        if db is not None:
            self._sum_in_order(db, results)
        if dw is not None:
            dur = np.zeros(dwp.shape[1:], dwp.dtype)
            for part in dwp:      # in chunk order, as the serial loop
                dur += part
            dw += winograd.weight_grad(dur)

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

    def _cn_im2col(self, ws, x, n, ones=False):
        """col (C*kh*kw, n*OH*OW) of the n images ``x``: kernels/im2col.py's numpy
        im2col, into this layer's workspace; with ``ones`` a last row of ones under it
        (one group: the bias as one more weight column, its gradient as one more row of
        the weight gradient's product).  Rows whose length in bytes is a multiple
        of 4 KiB get a cache line of padding after them (a strided view): otherwise
        the GEMMs' loads of successive rows fall on the same cache sets (CIFAR-10
        quick's conv1 chunks of 3 images, rows of 12 KiB: its forward products took
        8.7 ms a step against 6.6 ms with padded rows)."""
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        xpad = self._cn_padded(ws, x, n)
        step, rows, cols = ws["key"][1], self.C * self.ksize, n * self.P
        ld = _off_4k(step * self.P, x.dtype.itemsize)
        if "cn_col" not in ws:
            ws["cn_col"] = np.empty((rows + 1, ld), x.dtype)
            ws["cn_col"][rows] = 1
        col = ws["cn_col"][:rows + bool(ones), :cols]
        im2col_padded_into(xpad, col[:rows], kh, kw, sh, sw, dh, dw, *self.out_spatial)
        return col

    def _cn_col2im(self, ws, col, dx, n):
        """dx (n, C, H, W) = col2im(col (C*kh*kw, n*OH*OW)): kernels/im2col.py's."""
        (H, W), (ph, pw) = self.in_spatial, self.pad
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        dpad = self._buffer(ws, "cn_dpad", (self.C, ws["key"][1], H + 2 * ph, W + 2 * pw),
                            col.dtype)[:, :n]
        col2im_padded_into(col, dpad, kh, kw, sh, sw, dh, dw, *self.out_spatial)
        dx[...] = dpad[:, :, ph:ph + H, pw:pw + W].transpose(1, 0, 2, 3)

    # The GEMMs run per image on the image's columns (a strided (C*kh*kw, OH*OW)
    # slice of the chunk's matrix), so the output is written in place and dy is
    # read in place: no (O, n*P) <-> (n, O, P) transposing copies (conv1 of
    # CIFAR-10: 13.7 -> 11.5 ms forward, 18.9 -> 15.8 ms weight gradient).
    def _fwd_cn(self, x, w, y, budget, bias=None):
        N, G, P, O = x.shape[0], self.G, self.P, self.O
        Og = O // G
        w3 = w.reshape(G, Og, -1)
        step = self.chunk(N, x.dtype.itemsize, budget, MIN_GEMM_COLUMNS)
        direct = y.flags.c_contiguous
        ones = bias is not None and G == 1    # the bias in the product (a pass fewer)
        if ones:
            w3 = np.concatenate([w3, bias.reshape(1, O, 1).astype(w3.dtype)], axis=2)
            bias = None

        def chunk(ws, n0, n):
            col = self._cn_im2col(ws, x[n0:n0 + n], n, ones)
            if direct:    # one stacked matmul per group: numpy loops the images in C
                col4 = col.reshape(G, -1, n, P)
                y4 = y[n0:n0 + n].reshape(n, G, Og, P)
                for g in range(G):
                    np.matmul(w3[g], col4[g].transpose(1, 0, 2), out=y4[:, g])
                    if bias is not None:
                        y4[:, g] += bias[g * Og:(g + 1) * Og, None]
                return
            out = self._buffer(ws, "cn_out", O * step * P, x.dtype)[:O * n * P]
            np.matmul(w3, col.reshape(G, -1, n * P), out=out.reshape(G, Og, n * P))
            y[n0:n0 + n] = out.reshape(O, n, *self.out_spatial).transpose(1, 0, 2, 3)
            if bias is not None:
                y[n0:n0 + n] += bias[:, None, None]
        self._chunks(N, step, x.dtype, chunk)

    def _bwd_cn(self, x, w, dy, dw, dx, budget, db=None):
        N, G, P, O = dy.shape[0], self.G, self.P, self.O
        Og = O // G
        w3 = w.reshape(G, Og, -1)
        step = self.chunk(N, dy.dtype.itemsize, budget, MIN_GEMM_COLUMNS)
        # chunk i's weight-gradient partial in dwp[i]: (G, Og, C/G*kh*kw), or with
        # ``rows`` transposed, (G, C/G*kh*kw, Og)
        rows = self.kernel[1] * (self.C // G) >= CN_DW_ROWS_RUN
        # one group: the bias gradient as the product's row against a row of ones
        ones = db is not None and dw is not None and G == 1
        if dw is not None:
            K = w3.shape[2] + ones
            shape = (G, K, Og) if rows else (G, Og, K)
            dwp = self._dw_parts(-(-N // step), shape, np.result_type(dy.dtype, x.dtype))
        isz = dy.dtype.itemsize

        def chunk(ws, n0, n):
            bias = None if db is None or ones else self._bias_part(dy[n0:n0 + n])
            if dw is not None and not rows:
                # one product per image and group, dy (Og, P) in place against the
                # image's columns, summed over the chunk's images (LeNet's conv1: one
                # channel, rows of 5 values)
                d4 = dy[n0:n0 + n].reshape(n, G, Og, P)
                c4 = self._cn_im2col(ws, x[n0:n0 + n], n, ones).reshape(G, -1, n, P)
                c4 = c4.transpose(0, 2, 3, 1)
                for g in range(G):
                    np.add.reduce(np.matmul(d4[:, g], c4[g]), axis=0, out=dwp[n0 // step, g])
            elif dw is not None:
                # per group one product over the chunk: the columns (Kg, n*P) against dy
                # as rows (n*P, Og), giving the weight gradient transposed.  OpenBLAS ran
                # it 1.3x faster than per-image products against channel-last patches
                # (CIFAR-10 quick's conv1: 3 channels, 75 x 32 out of 3072-long sums).
                # dy reaches rows through a padded copy when its planes are a multiple of
                # 4 KiB (conv1's 32x32): the transposing copy's reads otherwise fall on
                # the same cache sets (6.3 ms a step against 1.5 ms with the copy)
                src = dy[n0:n0 + n].reshape(n, O, P)
                if _off_4k(P, isz) != P:
                    pad = self._buffer(ws, "dy_pad", (step, O, _off_4k(P, isz)), dy.dtype)
                    pad = pad[:n, :, :P]
                    pad[...] = src
                    src = pad
                dyr = self._buffer(ws, "dyr", (step * P, O), dy.dtype)[:n * P]
                dyr.reshape(n, P, O)[...] = src.transpose(0, 2, 1)
                c3 = self._cn_im2col(ws, x[n0:n0 + n], n, ones).reshape(G, -1, n * P)
                for g in range(G):
                    np.matmul(c3[g], dyr[:, g * Og:(g + 1) * Og], out=dwp[n0 // step, g])
            if dx is not None:
                dy2 = self._buffer(ws, "cn_out", O * step * P, dy.dtype)[:O * n * P]
                dy2.reshape(O, n, *self.out_spatial)[...] = dy[n0:n0 + n].transpose(1, 0, 2, 3)
                dy3 = dy2.reshape(G, Og, n * P)
                size = self.C * self.ksize * self.P
                dcol = self._buffer(ws, "col", step * size, dy.dtype)[:n * size]
                dcol = dcol.reshape(G, -1, n * P)
                np.matmul(w3.transpose(0, 2, 1), dy3, out=dcol)
                self._cn_col2im(ws, dcol, dx[n0:n0 + n], n)
            return bias
        results = self._chunks(N, step, dy.dtype, chunk)
        if db is not None and not ones:
            self._sum_in_order(db, results)
        if dw is not None:
            dwr = np.zeros(dwp.shape[1:], dw.dtype)
            for part in dwp:       # in chunk order, as the serial loop
                dwr += part
            dwr = dwr.transpose(0, 2, 1) if rows else dwr     # (G, Og, K)
            if ones:
                db += dwr[0, :, -1]
                dwr = dwr[:, :, :-1]
            dw += dwr.reshape(dw.shape)

    # -- generic (CuPy, N-D) ------------------------------------------------------------
    def _im2col(self, x):
        a = (self.kernel, self.pad, self.stride, self.dilation)
        return im2col(x, *a) if self.ns == 2 else im2col_nd(x, *a)

    def _col2im(self, col, shape):
        a = (self.kernel, self.pad, self.stride, self.dilation)
        return col2im(col, shape, *a) if self.ns == 2 else col2im_nd(col, shape, *a)

    def forward_generic(self, xp, x, w, y, budget, bias=None, keep=False):
        """The reference path every shape and array module can take: im2col from the
        kernels package and one batched GEMM per chunk of images, then the bias over
        the whole output (``forward`` picks a faster numpy path where one applies).
        It keeps nothing for the backward (``keep`` is accepted as ``forward``'s)."""
        N, G, P, O = x.shape[0], self.G, self.P, self.O
        w3 = w.reshape(G, O // G, -1)
        step = self.chunk(N, x.dtype.itemsize, budget)
        for n0 in range(0, N, step):
            n = min(N, n0 + step) - n0
            col = self._im2col(x[n0:n0 + n]).reshape(G, -1, n * P)
            out = gemm_batched(xp, w3, col, xp.empty((G, O // G, n * P), dtype=y.dtype),
                               tf32=self.tf32)
            y[n0:n0 + n] = out.reshape(O, n, *self.out_spatial).swapaxes(0, 1)
        if bias is not None:
            y += bias.reshape((1, -1) + (1,) * self.ns)

    def backward_generic(self, xp, x, w, dy, dw, dx, budget, db=None):
        """The reference backward (im2col/col2im and batched GEMMs), as ``forward_generic``."""
        if db is not None:
            db += self._bias_part(dy)
        if dw is None and dx is None:
            return
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


def conv_budget(xp):
    """Bytes of column buffer one chunk may use with array module ``xp``."""
    return COL_BUFFER_BYTES["cpu" if xp is np else "gpu"]
