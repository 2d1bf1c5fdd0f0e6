"""Vision layers: Convolution, Deconvolution, Im2col, Pooling, LRN, SPP, Crop.

Shapes, forward against PyTorch (when importable) or a naive loop of Caffe's
formulas, float64 finite-difference gradients over every bottom and param,
propagate_down, param-diff accumulation, one-line setup errors, engine
fallback, and CPU/GPU parity (marked gpu).
"""
import logging
import math

import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.blob import Blob
from minicaffe.core.errors import LayerError
from minicaffe.kernels import conv as conv_engine
from minicaffe.layers import vision
from minicaffe.proto import caffe_pb2
from minicaffe.compat.testing import check_gradient, make_blob, make_layer

FLT_MAX = float(np.finfo(np.float32).max)


def conv_text(typ="Convolution", num_output=4, kernel=3, stride=1, pad=0, dilation=1,
              group=1, bias=True, extra=""):
    return (f'name: "c" type: "{typ}" convolution_param {{ num_output: {num_output} '
            f'kernel_size: {kernel} stride: {stride} pad: {pad} dilation: {dilation} '
            f'group: {group} bias_term: {str(bias).lower()} {extra} '
            f'weight_filler {{ type: "gaussian" std: 0.5 }} '
            f'bias_filler {{ type: "gaussian" std: 0.5 }} }}')


def setup(layer, *bottoms, ntop=1):
    tops = [Blob(dtype=bottoms[0].dtype) for _ in range(ntop)]
    layer.setup(list(bottoms), tops)
    return tops


def forward(layer, *bottoms, ntop=1):
    tops = setup(layer, *bottoms, ntop=ntop)
    layer.forward(list(bottoms), tops)
    return tops


def rand_blob(shape, seed=0, dtype=np.float64):
    return make_blob(shape, dtype=dtype, values=np.random.RandomState(seed).randn(*shape))


def distinct_blob(shape, seed=0):
    """Values 0.1 apart: no ties and no argmax flip under the gradient step."""
    n = int(np.prod(shape))
    v = np.random.RandomState(seed).permutation(n).reshape(shape) * 0.1 - 0.05 * n
    return make_blob(shape, values=v)


# ---------------------------------------------------------------------------
# naive references (Caffe's formulas, loops)
# ---------------------------------------------------------------------------
def naive_conv2d(x, w, b, stride, pad, dilation, group):
    N, C, H, W = x.shape
    O, Cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    OH = (H + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    OW = (W + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    y = np.zeros((N, O, OH, OW))
    Og = O // group
    for n in range(N):
        for o in range(O):
            g = o // Og
            for i in range(OH):
                for j in range(OW):
                    patch = xp[n, g * Cg:(g + 1) * Cg, i * sh:i * sh + dh * (kh - 1) + 1:dh,
                               j * sw:j * sw + dw * (kw - 1) + 1:dw]
                    y[n, o, i, j] = (patch * w[o]).sum() + (b[o] if b is not None else 0)
    return y


def naive_pool(x, kernel, stride, pad, method, out_shape):
    """Caffe's pooling_layer.cpp loops (MAX and AVE)."""
    N, C, H, W = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad
    PH, PW = out_shape
    y = np.zeros((N, C, PH, PW))
    for n in range(N):
        for c in range(C):
            for i in range(PH):
                for j in range(PW):
                    hs, ws = i * sh - ph, j * sw - pw
                    if method == "MAX":
                        he, we = min(hs + kh, H), min(ws + kw, W)
                        hs, ws = max(hs, 0), max(ws, 0)
                        win = x[n, c, hs:he, ws:we]
                        y[n, c, i, j] = win.max() if win.size else -FLT_MAX
                    else:
                        he, we = min(hs + kh, H + ph), min(ws + kw, W + pw)
                        size = (he - hs) * (we - ws)
                        hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, H), min(we, W)
                        y[n, c, i, j] = x[n, c, hs:he, ws:we].sum() / size
    return y


def naive_lrn_within(x, size, alpha, beta):
    N, C, H, W = x.shape
    pre = (size - 1) // 2
    y = np.zeros_like(x)
    for n in range(N):
        for c in range(C):
            for h in range(H):
                for w in range(W):
                    win = x[n, c, max(h - pre, 0):h - pre + size, max(w - pre, 0):w - pre + size]
                    scale = 1 + alpha * (win ** 2).sum() / size ** 2
                    y[n, c, h, w] = x[n, c, h, w] * scale ** -beta
    return y


# ---------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("H,k,s,p,d,expect", [
    (28, 5, 1, 0, 1, 24), (32, 5, 1, 2, 1, 32), (7, 3, 2, 1, 1, 4), (8, 3, 3, 0, 1, 2),
    (9, 3, 1, 0, 2, 5), (5, 5, 1, 0, 1, 1), (4, 1, 2, 0, 1, 2), (6, 3, 2, 2, 3, 2),
])
def test_convolution_output_size(H, k, s, p, d, expect):
    top, = setup(make_layer(conv_text(kernel=k, stride=s, pad=p, dilation=d)),
                 rand_blob((2, 3, H, H + 1)))
    ow = (H + 1 + 2 * p - (d * (k - 1) + 1)) // s + 1
    assert top.shape == (2, 4, expect, ow)


def test_convolution_per_axis_geometry_and_axis():
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_h: 3 '
                       'kernel_w: 1 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 }')
    top, = setup(layer, rand_blob((2, 3, 9, 5)))
    assert top.shape == (2, 2, 5, 5)
    # repeated fields, one value per spatial axis, 3-D, channel axis 1
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 '
                       'kernel_size: 2 kernel_size: 1 stride: 1 stride: 2 stride: 1 pad: 1 }')
    top, = setup(layer, rand_blob((1, 2, 5, 6, 4)))
    assert top.shape == (1, 2, 5, 4, 6)
    assert layer.blobs[0].shape == (2, 2, 3, 2, 1)
    # axis 2: leading axes (2, 3) are all "num"
    layer = make_layer('type: "Convolution" convolution_param { num_output: 5 kernel_size: 3 '
                       'axis: 2 }')
    top, = setup(layer, rand_blob((2, 3, 4, 6, 6)))
    assert top.shape == (2, 3, 5, 4, 4)


@pytest.mark.parametrize("H,k,s,p,d", [(4, 3, 1, 0, 1), (4, 3, 2, 1, 1), (5, 4, 2, 1, 1),
                                       (3, 3, 3, 0, 2), (6, 2, 2, 0, 1)])
def test_deconvolution_output_size(H, k, s, p, d):
    top, = setup(make_layer(conv_text("Deconvolution", kernel=k, stride=s, pad=p, dilation=d)),
                 rand_blob((2, 3, H, H)))
    o = s * (H - 1) + d * (k - 1) + 1 - 2 * p
    assert top.shape == (2, 4, o, o)


@pytest.mark.parametrize("H,k,s,p,ceil,floor", [
    (7, 3, 2, 1, 4, 4),      # padded, no correction
    (5, 2, 2, 1, 3, 3),      # CEIL gives 4, the padding correction drops the last
    (6, 3, 2, 0, 3, 2),      # CEIL rounds up where FLOOR does not
    (24, 2, 2, 0, 12, 12),   # LeNet
    (32, 3, 2, 0, 16, 15),   # CIFAR-10 quick
    (13, 3, 2, 1, 7, 7),
])
def test_pooling_output_size(H, k, s, p, ceil, floor):
    assert vision.pooled_size(H, k, s, p) == ceil
    assert vision.pooled_size(H, k, s, p, caffe_pb2.PoolingParameter.FLOOR) == floor
    for mode, expect in (("CEIL", ceil), ("FLOOR", floor)):
        layer = make_layer(f'type: "Pooling" pooling_param {{ pool: AVE kernel_size: {k} '
                           f'stride: {s} pad: {p} round_mode: {mode} }}')
        top, = setup(layer, rand_blob((1, 2, H, H)))
        assert top.shape == (1, 2, expect, expect)


@pytest.mark.parametrize("method", ["AVE", "MAX"])
@pytest.mark.parametrize("k,s,p", [(5, 3, 0), (7, 3, 1)])
def test_kernel_larger_than_the_padded_input_pools_the_clipped_window(method, k, s, p):
    """A published GoogLeNet variant pools a 4x4 map with a 5x5 window, stride 3: Caffe's
    CEIL geometry gives one output over the clipped window."""
    x = rand_blob((2, 3, 4, 4))
    layer = make_layer(f'type: "Pooling" pooling_param {{ pool: {method} kernel_size: {k} '
                       f'stride: {s} pad: {p} }}')
    top, = forward(layer, x)
    assert top.shape == (2, 3, 1, 1)
    np.testing.assert_allclose(top.data, naive_pool(x.data, (k, k), (s, s), (p, p), method,
                                                    (1, 1)), rtol=1e-12)
    floor = make_layer(f'type: "Pooling" pooling_param {{ pool: {method} kernel_size: {k} '
                       f'stride: {s} pad: {p} round_mode: FLOOR }}')
    with pytest.raises(LayerError, match="leaves no output"):
        setup(floor, x)


def test_global_pooling_shape():
    top, = setup(make_layer('type: "Pooling" pooling_param { pool: AVE global_pooling: true }'),
                 rand_blob((2, 3, 5, 7)))
    assert top.shape == (2, 3, 1, 1)


# ---------------------------------------------------------------------------
# Convolution / Deconvolution against torch and a naive loop
# ---------------------------------------------------------------------------
CONV_CASES = [  # kernel, stride, pad, dilation, group
    (3, 1, 0, 1, 1), (3, 2, 1, 1, 1), (3, 1, 1, 2, 1), (1, 1, 0, 1, 1), (1, 2, 0, 1, 2),
    (2, 2, 0, 1, 2), (3, 2, 2, 2, 4), (5, 1, 2, 1, 1), (1, 1, 1, 1, 1), (1, 1, 0, 1, 2),
]


@pytest.mark.parametrize("k,s,p,d,g", CONV_CASES)
def test_convolution_forward_backward_matches_torch(k, s, p, d, g):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    layer = make_layer(conv_text(num_output=8, kernel=k, stride=s, pad=p, dilation=d, group=g))
    x = rand_blob((3, 4, 9, 8))
    top, = forward(layer, x)
    w, b = layer.blobs[0].data, layer.blobs[1].data
    tx = torch.tensor(x.data, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True)
    ty = F.conv2d(tx, tw, tb, s, p, d, g)
    np.testing.assert_allclose(top.data, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    dy = np.random.RandomState(5).randn(*top.shape)
    top.diff[...] = dy
    layer.backward([top], [True], [x])
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(x.diff, tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(layer.blobs[0].diff, tw.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(layer.blobs[1].diff, tb.grad.numpy(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("k,s,p,d,g", [(3, 2, 1, 1, 1), (1, 1, 0, 1, 2), (2, 1, 1, 2, 2)])
def test_convolution_forward_matches_naive_loop(k, s, p, d, g):
    layer = make_layer(conv_text(num_output=4, kernel=k, stride=s, pad=p, dilation=d, group=g))
    x = rand_blob((2, 4, 6, 7))
    top, = forward(layer, x)
    ref = naive_conv2d(x.data, layer.blobs[0].data, layer.blobs[1].data, (s, s), (p, p),
                       (d, d), g)
    np.testing.assert_allclose(top.data, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k,s,p,d,g", CONV_CASES[:7])
def test_deconvolution_forward_backward_matches_torch(k, s, p, d, g):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    layer = make_layer(conv_text("Deconvolution", num_output=8, kernel=k, stride=s, pad=p,
                                 dilation=d, group=g))
    x = rand_blob((3, 4, 5, 6))
    top, = forward(layer, x)
    w, b = layer.blobs[0].data, layer.blobs[1].data
    assert w.shape == (4, 8 // g, k, k)
    tx = torch.tensor(x.data, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True)
    ty = F.conv_transpose2d(tx, tw, tb, s, p, 0, g, d)
    np.testing.assert_allclose(top.data, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    dy = np.random.RandomState(5).randn(*top.shape)
    top.diff[...] = dy
    layer.backward([top], [True], [x])
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(x.diff, tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(layer.blobs[0].diff, tw.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(layer.blobs[1].diff, tb.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_convolution_3d_matches_torch():
    torch = pytest.importorskip("torch")
    layer = make_layer('type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 '
                       'kernel_size: 2 kernel_size: 2 stride: 2 stride: 1 stride: 1 pad: 1 '
                       'group: 1 weight_filler { type: "gaussian" } bias_filler { type: '
                       '"gaussian" } }')
    x = rand_blob((2, 2, 5, 4, 6))
    top, = forward(layer, x)
    ty = torch.nn.functional.conv3d(torch.tensor(x.data), torch.tensor(layer.blobs[0].data),
                                    torch.tensor(layer.blobs[1].data), (2, 1, 1), 1)
    np.testing.assert_allclose(top.data, ty.numpy(), rtol=1e-10, atol=1e-10)


def test_deconvolution_3d_matches_torch():
    torch = pytest.importorskip("torch")
    layer = make_layer('type: "Deconvolution" convolution_param { num_output: 4 kernel_size: 2 '
                       'stride: 2 stride: 1 stride: 1 pad: 0 pad: 1 pad: 0 group: 2 '
                       'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }')
    x = rand_blob((2, 2, 3, 4, 3))
    top, = forward(layer, x)
    tx = torch.tensor(x.data, requires_grad=True)
    tw = torch.tensor(layer.blobs[0].data, requires_grad=True)
    ty = torch.nn.functional.conv_transpose3d(tx, tw, torch.tensor(layer.blobs[1].data),
                                              (2, 1, 1), (0, 1, 0), 0, 2)
    np.testing.assert_allclose(top.data, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    dy = np.random.RandomState(1).randn(*top.shape)
    top.diff[...] = dy
    layer.backward([top], [True], [x])
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(x.diff, tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(layer.blobs[0].diff, tw.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_convolution_float32_matches_float64():
    layer = make_layer(conv_text(num_output=6, kernel=3, pad=1))
    x64 = rand_blob((4, 4, 8, 8))
    top64, = forward(layer, x64)
    layer32 = make_layer(conv_text(num_output=6, kernel=3, pad=1))
    x32 = make_blob(x64.shape, dtype=np.float32, values=x64.data)
    top32 = setup(layer32, x32)[0]
    for b32, b64 in zip(layer32.blobs, layer.blobs):
        b32.data[...] = b64.data
    layer32.forward([x32], [top32])
    assert top32.data.dtype == np.float32
    np.testing.assert_allclose(top32.data, top64.data, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("typ", ["Convolution", "Deconvolution"])
def test_chunked_batch_matches_one_chunk(monkeypatch, typ):
    """Small column budgets split the batch into chunks (a partial last one too)."""
    layer = make_layer(conv_text(typ, num_output=6, kernel=3, stride=2, pad=1, group=2))
    x = rand_blob((5, 4, 7, 6))
    top, = forward(layer, x)
    top.diff[...] = np.random.RandomState(3).randn(*top.shape)
    layer.backward([top], [True], [x])
    ref = (top.data.copy(), x.diff.copy(), layer.blobs[0].diff.copy())
    monkeypatch.setitem(conv_engine.COL_BUFFER_BYTES, "cpu", 1)
    monkeypatch.setattr(conv_engine, "MIN_GEMM_COLUMNS", 0)
    for step in (1, 2):
        monkeypatch.setitem(conv_engine.COL_BUFFER_BYTES, "cpu",
                            step * layer.engine.C * layer.engine.ksize * layer.engine.P * 8)
        layer2 = make_layer(conv_text(typ, num_output=6, kernel=3, stride=2, pad=1, group=2))
        top2, = setup(layer2, x)
        for a, b in zip(layer2.blobs, layer.blobs):
            a.data[...] = b.data
        layer2.forward([x], [top2])
        assert layer2.engine.chunk(5, 8, conv_engine.COL_BUFFER_BYTES["cpu"]) == step
        top2.diff[...] = top.diff
        layer2.backward([top2], [True], [x])
        np.testing.assert_allclose(top2.data, ref[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(x.diff, ref[1], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(layer2.blobs[0].diff, ref[2], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["channel_major", "channel_last"])
@pytest.mark.parametrize("dx_path", ["full_conv", "col2im"])
@pytest.mark.parametrize("k,s,p,d,g", [(3, 1, 1, 1, 1), (3, 1, 0, 2, 2), (2, 1, 1, 1, 2),
                                       (3, 2, 1, 1, 1), (1, 1, 1, 1, 1)])
def test_numpy_engine_paths_agree_with_naive(monkeypatch, layout, dx_path, k, s, p, d, g):
    """Both column layouts and both data-gradient algorithms (a stride-1 full
    convolution or col2im) give the same forward, data and weight gradients."""
    monkeypatch.setattr(conv_engine, "NHWC_MIN_CHANNELS", 1000 if layout == "channel_major" else 0)
    monkeypatch.setattr(conv_engine, "FULL_CONV_RATIO", 1000 if dx_path == "full_conv" else 0)
    x = rand_blob((3, 4, 6, 7))
    ref = []
    for typ in ("Convolution", "Deconvolution"):
        layer = make_layer(conv_text(typ, num_output=6, kernel=k, stride=s, pad=p, dilation=d,
                                     group=g))
        top, = forward(layer, x)
        if typ == "Convolution":
            naive = naive_conv2d(x.data, layer.blobs[0].data, layer.blobs[1].data, (s, s),
                                 (p, p), (d, d), g)
            np.testing.assert_allclose(top.data, naive, rtol=1e-12, atol=1e-12)
        top.diff[...] = np.random.RandomState(7).randn(*top.shape)
        layer.backward([top], [True], [x])
        ref.append((layer, top.data.copy(), x.diff.copy(), layer.blobs[0].diff.copy()))
    # the same layers through the generic engine (the kernels package's im2col/col2im)
    monkeypatch.setattr(conv_engine.ConvEngine, "forward",
                        lambda self, xp, *a, **k: self.forward_generic(xp, *a, **k))
    monkeypatch.setattr(conv_engine.ConvEngine, "backward",
                        lambda self, xp, x, w, dy, budget, dw=None, dx=None, db=None:
                        self.backward_generic(xp, x, w, dy, dw, dx, budget, db))
    for layer, y, dx, dw in ref:
        top, = forward(layer, x)
        np.testing.assert_allclose(top.data, y, rtol=1e-11, atol=1e-11)
        top.diff[...] = np.random.RandomState(7).randn(*top.shape)
        layer.blobs[0].diff[...] = 0
        layer.backward([top], [True], [x])
        np.testing.assert_allclose(x.diff, dx, rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(layer.blobs[0].diff, dw, rtol=1e-11, atol=1e-11)


def test_convolution_reshape_to_new_batch_and_size():
    layer = make_layer(conv_text(num_output=3, kernel=3, pad=1))
    x = rand_blob((2, 2, 6, 6))
    top, = forward(layer, x)
    x2 = rand_blob((3, 2, 4, 5), seed=1)
    layer.forward([x2], [top])
    assert top.shape == (3, 3, 4, 5)
    ref = naive_conv2d(x2.data, layer.blobs[0].data, layer.blobs[1].data, (1, 1), (1, 1),
                       (1, 1), 1)
    np.testing.assert_allclose(top.data, ref, rtol=1e-12, atol=1e-12)


def test_convolution_multiple_bottoms_share_weights():
    layer = make_layer(conv_text(num_output=3, kernel=3))
    a, b = rand_blob((2, 2, 5, 5)), rand_blob((2, 2, 5, 5), seed=1)
    ta, tb = forward(layer, a, b, ntop=2)
    for x, t in ((a, ta), (b, tb)):
        ref = naive_conv2d(x.data, layer.blobs[0].data, layer.blobs[1].data, (1, 1), (0, 0),
                           (1, 1), 1)
        np.testing.assert_allclose(t.data, ref, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------
# gradients (float64, Caffe's checker)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("text,shape", [
    (conv_text(num_output=3, kernel=3, stride=2, pad=1), (2, 2, 5, 5)),
    (conv_text(num_output=4, kernel=2, dilation=2, group=2), (2, 4, 5, 4)),
    (conv_text(num_output=2, kernel=1), (2, 3, 3, 3)),
    (conv_text(num_output=2, kernel=1, stride=2, group=2, bias=False), (2, 2, 4, 4)),
    (conv_text("Deconvolution", num_output=3, kernel=3, stride=2, pad=1), (2, 2, 3, 3)),
    (conv_text("Deconvolution", num_output=4, kernel=2, group=2, dilation=2), (1, 4, 3, 3)),
    ('type: "Convolution" convolution_param { num_output: 2 kernel_size: 2 pad: 1 '
     'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }', (1, 2, 3, 2, 3)),
])
def test_convolution_gradients(text, shape):
    layer = make_layer(text)
    assert check_gradient(layer, [rand_blob(shape)], [Blob(dtype=np.float64)]) > 0


def test_im2col_forward_and_gradient():
    layer = make_layer('type: "Im2col" convolution_param { kernel_size: 3 stride: 2 pad: 1 }')
    x = rand_blob((2, 3, 5, 6))
    top, = forward(layer, x)
    assert top.shape == (2, 27, 3, 3)
    xp = np.pad(x.data, ((0, 0), (0, 0), (1, 1), (1, 1)))
    for n in range(2):
        for c in range(3):
            for i in range(3):
                for j in range(3):
                    np.testing.assert_array_equal(top.data[n, (c * 3 + i) * 3 + j],
                                                  xp[n, c, i:i + 5:2, j:j + 5:2])
    check_gradient(make_layer('type: "Im2col" convolution_param { kernel_size: 2 '
                              'dilation: 2 }'), [rand_blob((2, 2, 4, 4))], [Blob(dtype=np.float64)])


def test_im2col_nd():
    layer = make_layer('type: "Im2col" convolution_param { kernel_size: 2 }')
    top, = forward(layer, rand_blob((1, 2, 3, 3, 3)))
    assert top.shape == (1, 16, 2, 2, 2)
    check_gradient(make_layer('type: "Im2col" convolution_param { kernel_size: 2 }'),
                   [rand_blob((1, 1, 3, 2, 3))], [Blob(dtype=np.float64)])


# ---------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------
POOL_CASES = [  # H, W, kernel, stride, pad
    (6, 6, 2, 2, 0), (7, 5, 3, 2, 0), (7, 7, 3, 2, 1), (5, 5, 2, 2, 1), (8, 6, 3, 3, 1),
    (6, 7, 3, 1, 1), (4, 4, 4, 1, 0), (9, 9, 5, 3, 2),
]


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("mode", ["CEIL", "FLOOR"])
@pytest.mark.parametrize("H,W,k,s,p", POOL_CASES)
def test_pooling_forward_matches_naive_and_torch(method, mode, H, W, k, s, p):
    layer = make_layer(f'type: "Pooling" pooling_param {{ pool: {method} kernel_size: {k} '
                       f'stride: {s} pad: {p} round_mode: {mode} }}')
    x = rand_blob((2, 3, H, W))
    top, = forward(layer, x)
    ref = naive_pool(x.data, (k, k), (s, s), (p, p), method, top.shape[2:])
    np.testing.assert_allclose(top.data, ref, rtol=1e-12, atol=1e-12)
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    if 2 * p > k:
        return  # torch requires pad <= kernel / 2
    tx = torch.tensor(x.data)
    ceil = mode == "CEIL"
    ty = (F.max_pool2d(tx, k, s, p, ceil_mode=ceil) if method == "MAX"
          else F.avg_pool2d(tx, k, s, p, ceil_mode=ceil, count_include_pad=True))
    if tuple(ty.shape) != top.shape:
        return  # torch's ceil_mode corrects the size without padding too
    np.testing.assert_allclose(top.data, ty.numpy(), rtol=1e-12, atol=1e-12)


def test_pooling_torch_agrees_at_clipped_borders():
    """Caffe's CEIL windows that run past the image: AVE divides by the window
    clipped to the padded input, as torch's count_include_pad does."""
    torch = pytest.importorskip("torch")
    x = rand_blob((1, 2, 7, 7))
    for method in ("MAX", "AVE"):
        layer = make_layer(f'type: "Pooling" pooling_param {{ pool: {method} kernel_size: 3 '
                           f'stride: 2 pad: 1 }}')
        top, = forward(layer, x)
        tx = torch.tensor(x.data)
        ty = (torch.nn.functional.max_pool2d(tx, 3, 2, 1, ceil_mode=True) if method == "MAX"
              else torch.nn.functional.avg_pool2d(tx, 3, 2, 1, ceil_mode=True))
        np.testing.assert_allclose(top.data, ty.numpy(), rtol=1e-12, atol=1e-12)


def test_pooling_ceil_windows_past_image_without_pad():
    """kernel < stride without padding: Caffe keeps a last window that starts
    past the image (MAX gives -FLT_MAX there, AVE 0); torch drops it."""
    x = rand_blob((1, 1, 5, 5))
    layer = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 1 stride: 3 }')
    top, = forward(layer, x)
    assert top.shape == (1, 1, 3, 3)
    np.testing.assert_allclose(top.data, naive_pool(x.data, (1, 1), (3, 3), (0, 0), "MAX",
                                                    (3, 3)))
    assert top.data[0, 0, 2, 0] == -FLT_MAX


def test_pooling_rectangular_and_global():
    x = rand_blob((2, 2, 7, 6))
    layer = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_h: 3 kernel_w: 2 '
                       'stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 }')
    top, = forward(layer, x)
    np.testing.assert_allclose(top.data, naive_pool(x.data, (3, 2), (2, 1), (1, 0), "MAX",
                                                    top.shape[2:]))
    layer = make_layer('type: "Pooling" pooling_param { pool: AVE global_pooling: true }')
    top, = forward(layer, x)
    np.testing.assert_allclose(top.data[..., 0, 0], x.data.mean(axis=(2, 3)), rtol=1e-12)


@pytest.mark.parametrize("mode", ["CEIL", "FLOOR"])
def test_max_pooling_mask_top(mode):
    x = distinct_blob((2, 2, 5, 5))
    layer = make_layer(f'type: "Pooling" pooling_param {{ pool: MAX kernel_size: 2 stride: 2 '
                       f'round_mode: {mode} }}')
    top, mask = forward(layer, x, ntop=2)
    assert mask.shape == top.shape
    flat = x.data.reshape(2, 2, -1)
    picked = np.take_along_axis(flat, mask.data.astype(int).reshape(2, 2, -1), axis=2)
    np.testing.assert_array_equal(picked.reshape(top.shape), top.data)
    # backward through the mask-top layer routes dy to the argmax
    top.diff[...] = 1.0
    layer.backward([top, mask], [True], [x])
    assert x.diff.sum() == top.count()
    assert set(np.flatnonzero(x.diff.reshape(2, 2, -1)[0, 0])) == set(
        mask.data[0, 0].astype(int).ravel())


@pytest.mark.parametrize("text,values", [
    ('pool: MAX kernel_size: 3 stride: 2', "distinct"),
    ('pool: MAX kernel_size: 3 stride: 2 pad: 1', "distinct"),
    ('pool: MAX kernel_size: 2 stride: 2 round_mode: FLOOR', "distinct"),
    ('pool: AVE kernel_size: 3 stride: 2 pad: 1', "random"),
    ('pool: AVE kernel_size: 3 stride: 2 pad: 1 round_mode: FLOOR', "random"),
    ('pool: AVE kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2', "random"),
    ('pool: AVE global_pooling: true', "random"),
])
def test_pooling_gradients(text, values):
    layer = make_layer(f'type: "Pooling" pooling_param {{ {text} }}')
    shape = (2, 2, 5, 6)
    x = distinct_blob(shape) if values == "distinct" else rand_blob(shape)
    assert check_gradient(layer, [x], [Blob(dtype=np.float64)]) > 0


def test_stochastic_pooling_train_and_test():
    x = make_blob((2, 2, 6, 6), values=np.random.RandomState(0).uniform(0.1, 1, (2, 2, 6, 6)))
    layer = make_layer('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 '
                       'stride: 2 }', phase=caffe_pb2.TRAIN)
    top, = forward(layer, x)
    assert top.shape == (2, 2, 3, 3)
    # each output is an element of its (clipped) window, chosen by the sampled index
    idx = layer.mask
    for n, c, i, j in np.ndindex(*top.shape):
        h, w = divmod(int(idx[n, c, i, j]), 6)
        assert 2 * i <= h < 2 * i + 3 and 2 * j <= w < 2 * j + 3
        assert top.data[n, c, i, j] == x.data[n, c, h, w]
    top.diff[...] = 1.0
    layer.backward([top], [True], [x])
    assert x.diff.sum() == pytest.approx(top.count())
    # same seed, same samples
    context.set_random_seed(1701)
    again, = forward(make_layer('type: "Pooling" pooling_param { pool: STOCHASTIC '
                                'kernel_size: 3 stride: 2 }'), x)
    context.set_random_seed(1701)
    again2, = forward(make_layer('type: "Pooling" pooling_param { pool: STOCHASTIC '
                                 'kernel_size: 3 stride: 2 }'), x)
    np.testing.assert_array_equal(again.data, again2.data)
    # TEST: sum(x^2) / sum(x) over each window
    test_layer = make_layer('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 '
                            'stride: 2 }', phase=caffe_pb2.TEST)
    top, = forward(test_layer, x)
    for n, c, i, j in np.ndindex(*top.shape):
        win = x.data[n, c, 2 * i:2 * i + 3, 2 * j:2 * j + 3]
        assert top.data[n, c, i, j] == pytest.approx((win ** 2).sum() / win.sum(), rel=1e-6)


# ---------------------------------------------------------------------------
# LRN
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("size,alpha,beta,k", [(5, 1e-4, 0.75, 1.0), (3, 0.5, 0.6, 2.0),
                                               (1, 1.0, 0.75, 1.0), (7, 2.0, 1.3, 0.5)])
def test_lrn_across_channels_matches_torch(size, alpha, beta, k):
    torch = pytest.importorskip("torch")
    layer = make_layer(f'type: "LRN" lrn_param {{ local_size: {size} alpha: {alpha} '
                       f'beta: {beta} k: {k} }}')
    x = rand_blob((2, 7, 3, 4))
    top, = forward(layer, x)
    tx = torch.tensor(x.data, requires_grad=True)
    ty = torch.nn.functional.local_response_norm(tx, size, float(np.float32(alpha)),
                                                 float(np.float32(beta)), float(np.float32(k)))
    np.testing.assert_allclose(top.data, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    dy = np.random.RandomState(2).randn(*top.shape)
    top.diff[...] = dy
    layer.backward([top], [True], [x])
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(x.diff, tx.grad.numpy(), rtol=1e-9, atol=1e-10)


def test_lrn_within_channel_matches_naive_loop():
    layer = make_layer('type: "LRN" lrn_param { local_size: 3 alpha: 0.8 beta: 0.7 '
                       'norm_region: WITHIN_CHANNEL }')
    x = rand_blob((2, 2, 5, 4))
    top, = forward(layer, x)
    ref = naive_lrn_within(x.data, 3, float(np.float32(0.8)), float(np.float32(0.7)))
    np.testing.assert_allclose(top.data, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("region", ["ACROSS_CHANNELS", "WITHIN_CHANNEL"])
def test_lrn_gradients(region):
    layer = make_layer(f'type: "LRN" lrn_param {{ local_size: 3 alpha: 0.9 beta: 0.75 '
                       f'norm_region: {region} }}')
    assert check_gradient(layer, [rand_blob((2, 4, 3, 3))], [Blob(dtype=np.float64)]) > 0


def test_lrn_in_place_keeps_its_input_for_backward():
    x = rand_blob((1, 5, 2, 2))
    ref_layer = make_layer('type: "LRN" lrn_param { local_size: 3 alpha: 0.9 }')
    x_copy = make_blob(x.shape, values=x.data)
    top, = forward(ref_layer, x_copy)
    top.diff[...] = 1.0
    ref_layer.backward([top], [True], [x_copy])
    layer = make_layer('type: "LRN" lrn_param { local_size: 3 alpha: 0.9 }')
    layer.setup([x], [x])
    layer.forward([x], [x])
    np.testing.assert_allclose(x.data, top.data)
    x.diff[...] = 1.0
    layer.backward([x], [True], [x])
    np.testing.assert_allclose(x.diff, x_copy.diff, rtol=1e-12)


# ---------------------------------------------------------------------------
# SPP, Crop
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_spp_matches_pyramid_of_poolings(pool):
    H, W = 13, 10
    x = distinct_blob((2, 3, H, W))
    layer = make_layer(f'type: "SPP" spp_param {{ pyramid_height: 3 pool: {pool} }}')
    top, = forward(layer, x)
    parts = []
    for level in range(3):
        bins = 2 ** level
        kh, kw = math.ceil(H / bins), math.ceil(W / bins)
        ph, pw = (kh * bins - H + 1) // 2, (kw * bins - W + 1) // 2
        out = (vision.pooled_size(H, kh, kh, ph), vision.pooled_size(W, kw, kw, pw))
        parts.append(naive_pool(x.data, (kh, kw), (kh, kw), (ph, pw), pool, out).reshape(2, -1))
    ref = np.concatenate(parts, axis=1)
    assert top.shape == ref.shape == (2, 3 * (1 + 4 + 16))
    np.testing.assert_allclose(top.data, ref, rtol=1e-12)
    layer = make_layer(f'type: "SPP" spp_param {{ pyramid_height: 3 pool: {pool} }}')
    check_gradient(layer, [distinct_blob((1, 2, 8, 6))], [Blob(dtype=np.float64)])


def test_spp_pyramid_height_one_is_a_4d_global_pooling():
    x = rand_blob((2, 3, 5, 4))
    top, = forward(make_layer('type: "SPP" spp_param { pyramid_height: 1 pool: AVE }'), x)
    assert top.shape == (2, 3, 1, 1)
    np.testing.assert_allclose(top.data[..., 0, 0], x.data.mean(axis=(2, 3)), rtol=1e-12)


@pytest.mark.parametrize("params,shape_b,region", [
    ("axis: 2 offset: 1 offset: 2", (2, 3, 4, 3), (slice(None), slice(None), slice(1, 5),
                                                  slice(2, 5))),
    ("axis: 1 offset: 1", (2, 2, 4, 3), (slice(None), slice(1, 3), slice(1, 5), slice(1, 4))),
    ("axis: -1", (2, 3, 6, 2), (Ellipsis, slice(0, 2))),
    ("axis: 0 offset: 0 offset: 1 offset: 2 offset: 3", (1, 2, 3, 2),
     (slice(0, 1), slice(1, 3), slice(2, 5), slice(3, 5))),
])
def test_crop(params, shape_b, region):
    a = rand_blob((2, 3, 6, 5))
    b = rand_blob(shape_b, seed=1)
    layer = make_layer(f'type: "Crop" crop_param {{ {params} }}')
    top, = forward(layer, a, b)
    np.testing.assert_array_equal(top.data, a.data[region])
    check_gradient(layer, [a, b], [Blob(dtype=np.float64)], check_bottom=[0])
    top.diff[...] = 1.0
    layer.backward([top], [True, False], [a, b])
    expect = np.zeros(a.shape)
    expect[region] = 1.0
    np.testing.assert_array_equal(a.diff, expect)


# ---------------------------------------------------------------------------
# propagate_down, accumulation
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("text,nb", [
    (conv_text(kernel=3, pad=1), 1),
    (conv_text("Deconvolution", kernel=3, stride=2), 1),
    ('type: "Im2col" convolution_param { kernel_size: 2 }', 1),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }', 1),
    ('type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }', 1),
    ('type: "LRN" lrn_param { local_size: 3 }', 1),
    ('type: "LRN" lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL }', 1),
    ('type: "SPP" spp_param { pyramid_height: 2 }', 1),
    ('type: "Crop" crop_param { axis: 2 offset: 1 }', 2),
])
def test_propagate_down_false_leaves_bottom_diff(text, nb):
    layer = make_layer(text)
    bottoms = [rand_blob((2, 4, 6, 6))] + [rand_blob((2, 4, 3, 3))] * (nb - 1)
    top, = forward(layer, *bottoms)
    top.diff[...] = 1.0
    for b in bottoms:
        b.diff[...] = 7.0
    layer.backward([top], [False] * nb, bottoms)
    for b in bottoms:
        assert np.all(b.diff == 7.0)


@pytest.mark.parametrize("typ", ["Convolution", "Deconvolution"])
def test_param_diffs_accumulate_and_param_propagate_down(typ):
    layer = make_layer(conv_text(typ, kernel=3, stride=2, pad=1))
    x = rand_blob((2, 2, 5, 5))
    top, = forward(layer, x)
    top.diff[...] = np.random.RandomState(4).randn(*top.shape)
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward([top], [True], [x])
    once = [b.diff.copy() for b in layer.blobs]
    dx_once = x.diff.copy()
    layer.backward([top], [True], [x])
    for b, d in zip(layer.blobs, once):
        np.testing.assert_allclose(b.diff, 2 * d, rtol=1e-12)
    np.testing.assert_allclose(x.diff, dx_once, rtol=1e-12)  # bottom diff overwritten
    layer.set_param_propagate_down(0, False)
    layer.set_param_propagate_down(1, False)
    layer.backward([top], [True], [x])
    for b, d in zip(layer.blobs, once):
        np.testing.assert_allclose(b.diff, 2 * d, rtol=1e-12)


# ---------------------------------------------------------------------------
# user errors: one line naming layer, parameter and shapes
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("text,shape,words", [
    (conv_text(kernel=7), (1, 3, 5, 5), ["'c'", "kernel", "padded input", "(5, 5)"]),
    (conv_text(kernel=3, dilation=3), (1, 3, 6, 6), ["kernel extent 7", "dilation 3"]),
    (conv_text(num_output=4, group=2), (1, 3, 5, 5), ["group (2)", "channels (3", "(1, 3, 5, 5)"]),
    (conv_text(num_output=3, group=2), (1, 4, 5, 5), ["group (2)", "num_output (3)"]),
    (conv_text(num_output=0), (1, 3, 5, 5), ["num_output must be positive"]),
    (conv_text("Deconvolution", kernel=2, pad=3), (1, 3, 2, 2), ["output size", "pad 3"]),
    ('name: "c" type: "Convolution" convolution_param { num_output: 2 }', (1, 3, 5, 5),
     ["kernel_size must be specified"]),
    ('name: "c" type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 '
     'kernel_size: 3 kernel_size: 3 }', (1, 3, 5, 5), ["kernel", "3 times"]),
    ('name: "c" type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 }',
     (4,), ["no spatial axes"]),
    ('name: "p" type: "Pooling" pooling_param { kernel_size: 6 }', (1, 1, 4, 4),
     ["'p'", "kernel_size [6, 6]", "padded input 4x4", "(1, 1, 4, 4)"]),
    ('name: "p" type: "Pooling" pooling_param { kernel_size: 2 pad: 2 }', (1, 1, 4, 4),
     ["pad [2, 2]", "kernel_size [2, 2]"]),
    ('name: "p" type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 pad: 1 }',
     (1, 1, 4, 4), ["padding implemented only for average and max"]),
    ('name: "p" type: "Pooling" pooling_param { global_pooling: true kernel_size: 2 }',
     (1, 1, 4, 4), ["global_pooling"]),
    ('name: "p" type: "Pooling" pooling_param { pool: AVE }', (1, 1, 4, 4),
     ["kernel_size"]),
    ('name: "p" type: "Pooling" pooling_param { kernel_size: 2 }', (1, 4, 4),
     ["4 axes", "(1, 4, 4)"]),
    ('name: "l" type: "LRN" lrn_param { local_size: 4 }', (1, 4, 4, 4), ["odd", "local_size"]),
    ('name: "s" type: "SPP" spp_param { pyramid_height: 0 }', (1, 2, 4, 4), ["pyramid_height"]),
])
def test_setup_errors_are_one_line(text, shape, words):
    layer = make_layer(text)
    with pytest.raises(LayerError) as e:
        setup(layer, rand_blob(shape))
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_pooling_mask_top_needs_max():
    layer = make_layer('name: "p" type: "Pooling" pooling_param { pool: AVE kernel_size: 2 }')
    with pytest.raises(LayerError, match="only produced by MAX"):
        setup(layer, rand_blob((1, 1, 4, 4)), ntop=2)


def test_crop_errors():
    with pytest.raises(LayerError, match=r"crop for dimension 3 is out-of-bounds.*offset 3"):
        setup(make_layer('name: "k" type: "Crop" crop_param { axis: 2 offset: 3 }'),
              rand_blob((1, 1, 6, 5)), rand_blob((1, 1, 3, 3)))
    with pytest.raises(LayerError, match="number of offset values"):
        setup(make_layer('name: "k" type: "Crop" crop_param { axis: 2 offset: 1 offset: 1 '
                         'offset: 1 }'), rand_blob((1, 1, 6, 5)), rand_blob((1, 1, 3, 3)))


def test_convolution_input_channel_change_is_an_error():
    layer = make_layer(conv_text(kernel=3))
    top, = setup(layer, rand_blob((1, 3, 5, 5)))
    with pytest.raises(LayerError, match="input has 2 channels"):
        layer.forward([rand_blob((1, 2, 5, 5))], [top])


# ---------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------
class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("text,shape", [
    ('name: "x" type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 '
     'engine: CUDNN }', (1, 2, 5, 5)),
    ('name: "x" type: "Pooling" pooling_param { kernel_size: 2 engine: CUDNN }', (1, 2, 5, 5)),
    ('name: "x" type: "LRN" lrn_param { engine: CUDNN }', (1, 2, 5, 5)),
    ('name: "x" type: "SPP" spp_param { pyramid_height: 2 engine: CUDNN }', (1, 2, 5, 5)),
])
def test_unavailable_engine_falls_back_with_one_log_line(text, shape):
    cap = _Capture()
    logger = logging.getLogger("minicaffe")
    logger.addHandler(cap)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        setup(make_layer(text), rand_blob(shape))
        setup(make_layer(text.replace("CUDNN", "CAFFE")), rand_blob(shape))
    finally:
        logger.removeHandler(cap)
        logger.setLevel(level)
    notes = [m for m in cap.lines if "engine" in m]
    assert len(notes) == 1 and "CUDNN" in notes[0] and "'x'" in notes[0]


# ---------------------------------------------------------------------------
# CPU / GPU parity
# ---------------------------------------------------------------------------
GPU_CASES = [
    conv_text(num_output=8, kernel=3, stride=2, pad=1),
    conv_text(num_output=8, kernel=3, dilation=2, group=2),
    conv_text(num_output=8, kernel=1),
    conv_text("Deconvolution", num_output=6, kernel=3, stride=2, pad=1, group=2),
    'type: "Im2col" convolution_param { kernel_size: 3 stride: 2 pad: 1 }',
    'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }',
    'type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }',
    'type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 round_mode: FLOOR }',
    'type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 stride: 2 }',
    'type: "LRN" lrn_param { local_size: 5 alpha: 0.5 }',
    'type: "LRN" lrn_param { local_size: 3 alpha: 0.5 norm_region: WITHIN_CHANNEL }',
    'type: "SPP" spp_param { pyramid_height: 3 }',
]


def _run_mode(text, gpu, x_values, dy_seed, phase=caffe_pb2.TEST, extra_bottoms=()):
    if gpu:
        context.set_mode_gpu()
    else:
        context.set_mode_cpu()
    context.set_random_seed(1701)
    layer = make_layer(text, phase=phase)
    x = make_blob(x_values.shape, dtype=np.float32, values=x_values)
    others = [make_blob(v.shape, dtype=np.float32, values=v) for v in extra_bottoms]
    top, = setup(layer, x, *others)
    layer.forward([x] + others, [top])
    if "STOCHASTIC" in text:  # TEST mode samples nothing: there is no backward
        return [top.data.copy()]
    top.diff[...] = np.random.RandomState(dy_seed).randn(*top.shape)
    layer.backward([top], [True] + [False] * len(others), [x] + others)
    out = [top.data.copy(), x.diff.copy()] + [b.diff.copy() for b in layer.blobs]
    context.set_mode_cpu()
    return out


def _close(a, b, rel=1e-5):
    scale = max(np.abs(a).max(), 1e-30)
    assert np.abs(a - b).max() <= rel * scale + 1e-7, np.abs(a - b).max() / scale


@pytest.mark.gpu
@pytest.mark.parametrize("text", GPU_CASES)
def test_cpu_gpu_parity(text):
    x = np.random.RandomState(0).uniform(0.1, 1.0, (4, 8, 11, 10)).astype(np.float32)
    # (stochastic pooling runs in TEST mode: the generators differ between CPU and GPU)
    cpu = _run_mode(text, False, x, 1)
    gpu = _run_mode(text, True, x, 1)
    for a, b in zip(cpu, gpu):
        _close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("text,shape,extra", [
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 '
     'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }', (2, 3, 6, 7, 5),
     ()),
    ('type: "Deconvolution" convolution_param { num_output: 4 kernel_size: 2 stride: 2 '
     'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }', (2, 3, 3, 4, 2),
     ()),
    ('type: "Crop" crop_param { axis: 1 offset: 1 offset: 2 offset: 0 }', (3, 5, 7, 6),
     ((3, 2, 4, 6),)),
    # a kernel larger than the padded input: one clipped window (a GoogLeNet variant)
    ('type: "Pooling" pooling_param { pool: AVE kernel_size: 5 stride: 3 }', (2, 3, 4, 4), ()),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 7 stride: 3 pad: 1 }',
     (2, 3, 4, 4), ()),
])
def test_cpu_gpu_parity_nd_and_crop(text, shape, extra):
    x = np.random.RandomState(0).uniform(-1, 1, shape).astype(np.float32)
    others = [np.zeros(s, np.float32) for s in extra]
    context.set_random_seed(1701)
    cpu = _run_mode(text, False, x, 1, extra_bottoms=others)
    gpu = _run_mode(text, True, x, 1, extra_bottoms=others)
    for a, b in zip(cpu, gpu):
        _close(a, b)


@pytest.mark.gpu
def test_stochastic_pooling_train_on_gpu_samples_window_elements():
    """Random case: the GPU generator differs from the CPU one, so check what
    must hold for any sample (the value is its window's element at the index)."""
    context.set_mode_gpu()
    try:
        x = make_blob((2, 3, 7, 6), dtype=np.float32,
                      values=np.random.RandomState(0).uniform(0.1, 1, (2, 3, 7, 6)))
        layer = make_layer('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 '
                           'stride: 2 }', phase=caffe_pb2.TRAIN)
        top, = forward(layer, x)
        idx = layer.mask.get() if hasattr(layer.mask, "get") else layer.mask
        for n, c, i, j in np.ndindex(*top.shape):
            h, w = divmod(int(idx[n, c, i, j]), 6)
            assert 2 * i <= h < 2 * i + 3 and 2 * j <= w < 2 * j + 3
            assert top.data[n, c, i, j] == x.data[n, c, h, w]
        top.diff[...] = 1.0
        layer.backward([top], [True], [x])
        assert x.diff.sum() == pytest.approx(top.count())
    finally:
        context.set_mode_cpu()
