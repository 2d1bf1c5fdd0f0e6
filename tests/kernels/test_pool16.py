"""kernels/pool16.py's numpy body (the reference of its CUDA kernels, tests/
test_pool16_gpu.py): MAX pooling of channels-last 2-byte maps over disjoint windows,
against Caffe's fp32 NCHW kernels (kernels/pooling.py) on the same values, ties included,
and its NaN rule."""
import numpy as np
import pytest

from minicaffe.core import precision as P
from minicaffe.kernels import pool16
from minicaffe.kernels import pooling as K

KINDS = (P.BFLOAT16, P.FLOAT16)
# (N, C, H, W), kernel, stride, pad: VGG's 2x2/2, odd maps (Caffe's ceil: a clipped last
# window), a gap between windows (stride > kernel), padding, a non-square window
GEOMETRIES = [
    ((2, 16, 8, 6), 2, 2, 0),
    ((2, 12, 7, 5), 2, 2, 0),
    ((1, 6, 9, 10), (2, 3), (3, 4), 0),
    ((2, 3, 7, 7), 2, 2, 1),
    ((1, 5, 5, 9), 3, 3, (1, 2)),
    ((3, 1, 4, 4), 1, 2, 0),
]


def words(a, kind):
    """The 2-byte buffer of the fp32 values ``a`` (exact when they are representable)."""
    return P.narrow(np, np.ascontiguousarray(a, np.float32),
                    np.empty(a.shape, P.buffer_dtype(kind)), kind)


def values(w, kind):
    return P.widen(np, w, np.empty(w.shape, np.float32), kind)


def nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def nchw(a):
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2))


def tied_maps(shape, seed, kind):
    """fp32 NCHW values of ``kind`` with many ties (a few levels), -0.0 beside +0.0."""
    rs = np.random.RandomState(seed)
    x = rs.randint(-3, 4, size=shape).astype(np.float32) * 0.5
    x[rs.random_sample(shape) < 0.1] = -0.0
    return values(words(x, kind), kind)


def reference(x, geo, kind, dy=None):
    """Caffe's forward (y: the input at Caffe's argmax mask, bit for bit -- the numpy
    body's own y may hold +0.0 for a first -0.0) or backward (dx) on fp32 NCHW values."""
    _, k, s, p = geo
    y, mask = K.max_pool_forward(x, k, s, p)
    if dy is None:
        N, C = x.shape[:2]
        planes = x.reshape(N, C, -1)
        at = np.take_along_axis(planes, np.maximum(mask, 0).reshape(N, C, -1), axis=2)
        y = np.where(mask >= 0, at.reshape(y.shape), y)
        return values(words(y, kind), kind)       # an empty window's -FLT_MAX: -inf
    return K.max_pool_backward(dy, mask, x.shape, k, s, p)


def run16(x, geo, kind, dy=None):
    """pool16's body on the NHWC words of ``x`` (NCHW fp32) -> NCHW fp32 values."""
    shape, k, s, p = geo
    PH, PW = pool16.output_shape(shape[2], shape[3], k, s, p)
    xw = words(nhwc(x), kind)
    if dy is None:
        y = np.empty((shape[0], PH, PW, shape[1]), xw.dtype)
        pool16.max_pool_forward(xw, y, shape, k, s, p, kind)
        return nchw(values(y, kind))
    dx = np.full(xw.shape, 7, xw.dtype)     # every value written
    pool16.max_pool_backward(xw, words(nhwc(dy), kind), dx, shape, k, s, p, kind)
    return nchw(values(dx, kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("geo", GEOMETRIES)
def test_forward_and_backward_are_caffes_ties_included(geo, kind):
    x = tied_maps(geo[0], 5, kind)
    y = reference(x, geo, kind)
    got = run16(x, geo, kind)
    assert got.shape == y.shape
    assert np.array_equal(got.view(np.uint32), y.view(np.uint32))     # -0.0 kept too
    rs = np.random.RandomState(6)
    dy = values(words(rs.standard_normal(y.shape), kind), kind)
    assert np.array_equal(run16(x, geo, kind, dy), reference(x, geo, kind, dy))


def test_overlapping_windows_are_refused():
    x = np.zeros((1, 9, 9, 8), np.uint16)
    y = np.zeros((1, 4, 4, 8), np.uint16)
    assert not pool16.disjoint(3, 2) and pool16.disjoint((2, 3), (2, 3))
    with pytest.raises(ValueError, match="overlapping"):
        pool16.max_pool_forward(x, y, (1, 8, 9, 9), 3, 2, 0, P.BFLOAT16)


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_wins_its_window_and_takes_the_gradient(kind):
    """The first NaN in window order is the output (NaN propagation, as our cuDNN pooling
    descriptor asks) and receives dy; an all -inf window gives -inf and no gradient."""
    x = np.array([[[[1.0, np.nan, 5.0, -np.inf],
                    [np.nan, 9.0, -np.inf, -np.inf]]]], np.float32)   # (1, 1, 2, 4)
    geo = ((1, 1, 2, 4), 2, 2, 0)
    y = run16(x, geo, kind)
    assert np.isnan(y[0, 0, 0, 0]) and y[0, 0, 0, 1] == 5.0
    dx = run16(x, geo, kind, np.array([[[[2.0, 3.0]]]], np.float32))
    assert dx[0, 0].tolist() == [[0.0, 2.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    x[0, 0, :, 2:] = -np.inf
    y = run16(x, geo, kind)
    assert y[0, 0, 0, 1] == -np.inf
    assert not run16(x, geo, kind, np.array([[[[2.0, 3.0]]]], np.float32))[0, 0, :, 2:].any()


def test_a_floor_geometry_drops_the_last_window_and_zeroes_its_inputs():
    x = tied_maps((1, 4, 5, 5), 9, P.BFLOAT16)
    xw = words(nhwc(x), P.BFLOAT16)
    y = np.empty((1, 2, 2, 4), np.uint16)
    pool16.max_pool_forward(xw, y, x.shape, 2, 2, 0, P.BFLOAT16, out_hw=(2, 2))
    full = reference(x, ((1, 4, 5, 5), 2, 2, 0), P.BFLOAT16)        # ceil: 3 x 3
    assert np.array_equal(nchw(values(y, P.BFLOAT16)), full[:, :, :2, :2])
    dx = np.full(xw.shape, 7, np.uint16)
    dy = words(np.ones((1, 2, 2, 4), np.float32), P.BFLOAT16)
    pool16.max_pool_backward(xw, dy, dx, x.shape, 2, 2, 0, P.BFLOAT16, out_hw=(2, 2))
    d = nchw(values(dx, P.BFLOAT16))
    assert not d[:, :, 4].any() and not d[:, :, :, 4].any()
    assert (d[:, :, :4, :4].reshape(1, 4, 2, 2, 2, 2).sum(axis=(3, 5)) == 1).all()


def test_pad_channels_appends_zero_channels():
    from minicaffe.kernels import pad16
    x = np.arange(1, 2 * 3 * 3 + 1, dtype=np.uint16)           # 6 rows of 3 channels
    out = np.full(6 * 8, 9, np.uint16)
    pad16.pad_channels(x, out, 3, 8)
    o = out.reshape(6, 8)
    assert np.array_equal(o[:, :3], x.reshape(6, 3)) and not o[:, 3:].any()
    with pytest.raises(ValueError):
        pad16.pad_channels(x, out[:40], 3, 8)
