"""Winograd F(4x4, 5x5) in the numpy convolution engine (kernels/winograd.py): the
transforms' identity, the engine's three passes against the direct im2col + GEMM path
(exactly in float64, within a measured bound in float32), the kernel pool's bits, the
forward's kept tiles, and ``engine: CAFFE`` keeping Caffe's arithmetic."""
import numpy as np
import pytest

from minicaffe.core import threads
from minicaffe.kernels import winograd
from minicaffe.kernels.conv import ConvEngine

GEOMETRIES = [  # C, O, H, W, pad: CIFAR-10 quick's conv2 and conv3, LeNet's conv2, odd tiles
    (32, 32, 16, 16, 2),
    (32, 64, 8, 8, 2),
    (20, 50, 12, 12, 0),
    (8, 12, 11, 13, 1),
    (16, 8, 9, 7, 4),
    (9, 7, 13, 10, 3),
]


def _engine(C, O, H, W, pad, winograd=True):
    out = (H + 2 * pad - 4, W + 2 * pad - 4)
    return ConvEngine(C, O, 1, (5, 5), (pad, pad), (1, 1), (1, 1), (H, W), out,
                      winograd=winograd)


def _passes(engine, x, w, dy, b, budget=1 << 20):
    y = np.empty(dy.shape, x.dtype)
    engine.forward(np, x, w, y, budget, bias=b, keep=True)
    dw = np.full_like(w, 0.5)                   # the gradients accumulate
    db = np.full_like(b, 0.25)
    dx = np.empty_like(x)
    engine.backward(np, x, w, dy, budget, dw=dw, dx=dx, db=db)
    return y, dw, dx, db


def _data(C, O, H, W, pad, dtype, N=6, seed=0):
    rs = np.random.RandomState(seed)
    out = (H + 2 * pad - 4, W + 2 * pad - 4)
    return (rs.randn(N, C, H, W).astype(dtype), (rs.randn(O, C, 5, 5) * 0.1).astype(dtype),
            rs.randn(N, O, *out).astype(dtype), rs.randn(O).astype(dtype))


def test_the_transforms_compute_the_five_tap_correlation():
    rs = np.random.RandomState(3)
    for _ in range(20):
        d, g = rs.randn(8), rs.randn(5)
        y = winograd.AT64 @ ((winograd.G64 @ g) * (winograd.BT64 @ d))
        want = np.array([d[i:i + 5] @ g for i in range(4)])
        np.testing.assert_allclose(y, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("C,O,H,W,pad", GEOMETRIES)
def test_winograd_passes_equal_the_direct_method_in_float64(C, O, H, W, pad):
    """The same arithmetic up to rounding: in float64 the two methods agree to 1e-12 of
    each result's largest value (forward, weight, data and bias gradients)."""
    e = _engine(C, O, H, W, pad)
    assert e.winograd
    x, w, dy, b = _data(C, O, H, W, pad, np.float64)
    got = _passes(e, x, w, dy, b)
    want = _passes(_engine(C, O, H, W, pad, winograd=False), x, w, dy, b)
    for g, r in zip(got, want):
        assert np.abs(g - r).max() <= 1e-12 * np.abs(r).max()


@pytest.mark.parametrize("C,O,H,W,pad", GEOMETRIES)
def test_winograd_float32_error_against_float64(C, O, H, W, pad):
    """float32: within 3e-5 of each result's largest value (measured: 2e-6 to 1.1e-5,
    the direct method 2e-7 to 6e-7; docs/layers.md)."""
    x, w, dy, b = _data(C, O, H, W, pad, np.float32)
    got = _passes(_engine(C, O, H, W, pad), x, w, dy, b)
    ref = _passes(_engine(C, O, H, W, pad, winograd=False),
                  *(a.astype(np.float64) for a in (x, w, dy, b)))
    for g, r in zip(got, ref):
        err = np.abs(g - r).max() / np.abs(r).max()
        assert err <= 3e-5
    direct = _passes(_engine(C, O, H, W, pad, winograd=False), x, w, dy, b)
    assert not np.array_equal(got[0], direct[0])          # another method, other bits


@pytest.mark.parametrize("shape", [(32, 32, 1, 5, 2, 1), (32, 32, 2, 5, 2, 1),
                                   (32, 32, 1, 5, 2, 2), (32, 32, 1, 3, 1, 1),
                                   (3, 32, 1, 5, 2, 1), (32, 32, 1, 5, 5, 1)])
def test_only_one_group_5x5_stride_1_with_enough_channels_takes_winograd(shape):
    C, O, G, k, pad, s = shape
    H = 16
    OH = (H + 2 * pad - k) // s + 1
    e = ConvEngine(C, O, G, (k, k), (pad, pad), (s, s), (1, 1), (H, H), (OH, OH),
                   winograd=True)
    assert e.winograd == (shape == (32, 32, 1, 5, 2, 1))


@pytest.mark.parametrize("per_chunk", [3, 5, 24])
def test_kernel_pool_is_bit_identical_to_one_thread(per_chunk, monkeypatch):
    """Chunks of ``per_chunk`` images (8 of 3; 4 of 5 and one of 4; one of 24) on 1 and
    3 threads: the same bits."""
    pytest.importorskip("threadpoolctl")
    from minicaffe.kernels import conv
    # the tile matrix of one image: 64 points x 9 tiles (12x12 outputs) x 24 channels
    monkeypatch.setattr(conv, "WINO_BUFFER_BYTES", per_chunk * 64 * 9 * 24 * 4)
    x, w, dy, b = _data(16, 24, 12, 12, 2, np.float32, N=24)
    e = _engine(16, 24, 12, 12, 2)
    results = []
    try:
        for n in (1, 3):
            threads.set_kernel_threads(n)
            results.append(_passes(e, x, w, dy, b))
    finally:
        threads.set_kernel_threads(1)
    for serial, pooled in zip(*results):
        assert np.array_equal(serial, pooled)


def test_the_weight_gradient_reuses_the_forwards_tiles_only_for_the_same_input():
    """forward(keep=True) then backward on the same x: the bits of a backward that
    transforms x again; on another x of the same shape: that x's gradient."""
    x, w, dy, b = _data(32, 32, 16, 16, 2, np.float32, N=10)
    e, fresh = _engine(32, 32, 16, 16, 2), _engine(32, 32, 16, 16, 2)
    y = np.empty(dy.shape, np.float32)
    e.forward(np, x, w, y, 0, keep=True)
    dw, dw_fresh = np.zeros_like(w), np.zeros_like(w)
    e.backward(np, x, w, dy, 0, dw=dw)
    fresh.backward(np, x, w, dy, 0, dw=dw_fresh)         # no forward before it
    assert np.array_equal(dw, dw_fresh)
    x2 = x[::-1].copy()
    dw2, dw2_fresh = np.zeros_like(w), np.zeros_like(w)
    e.backward(np, x2, w, dy, 0, dw=dw2)
    fresh.backward(np, x2, w, dy, 0, dw=dw2_fresh)
    assert np.array_equal(dw2, dw2_fresh) and not np.array_equal(dw2, dw)


@pytest.mark.parametrize("engine", ["DEFAULT", "CAFFE"])
def test_engine_caffe_keeps_im2col_and_default_takes_winograd(engine):
    """A Convolution layer's ``engine: CAFFE`` computes as Caffe (the im2col + GEMM bits);
    DEFAULT takes Winograd for a 5x5 stride-1 convolution on the CPU."""
    from minicaffe.core.blob import Blob
    from minicaffe.layers.registry import create_layer
    from minicaffe.proto import caffe_pb2
    from google.protobuf import text_format
    p = text_format.Parse(
        f'name: "c" type: "Convolution" convolution_param {{ num_output: 16 kernel_size: 5 '
        f'pad: 2 engine: {engine} weight_filler {{ type: "gaussian" std: 0.1 }} '
        f'bias_filler {{ type: "constant" value: 0.1 }} }}', caffe_pb2.LayerParameter())
    layer = create_layer(p)
    bottom, top = Blob((4, 8, 12, 12)), Blob()
    bottom.data[...] = np.random.RandomState(5).randn(4, 8, 12, 12)
    layer.setup([bottom], [top])
    layer.forward([bottom], [top])
    w, b = layer.blobs[0].data, layer.blobs[1].data
    want = np.empty_like(top.data)
    direct = ConvEngine(8, 16, 1, (5, 5), (2, 2), (1, 1), (1, 1), (12, 12), (12, 12))
    direct.forward(np, bottom.data, w, want, 1 << 20, bias=b)
    assert np.array_equal(top.data, want) == (engine == "CAFFE")
    np.testing.assert_allclose(top.data, want, rtol=0, atol=3e-5 * np.abs(want).max())
