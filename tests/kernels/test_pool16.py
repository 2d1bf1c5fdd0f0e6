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


# -- overlapping MAX (argmax bytes) and AVE: against a naive loop over Caffe's formulas ------
# (N, C, H, W), kernel, stride, pad, out_hw (None: Caffe's CEIL; else a FLOOR layer's):
# ResNet's and CIFAR's 3x3/2 (CEIL: the last window past the edge), 3x3/1 with padding,
# non-square windows and strides, odd channel counts, a window larger than the map, and
# disjoint ones (the argmax body takes any geometry)
OVERLAP_GEOMETRIES = [
    ((2, 3, 9, 9), 3, 2, 0, None),
    ((2, 5, 8, 8), 3, 2, 0, None),
    ((1, 4, 7, 6), 3, 1, 1, None),
    ((2, 3, 6, 9), (3, 2), (2, 1), (1, 0), None),
    ((1, 7, 5, 5), (2, 4), (1, 3), (1, 2), None),
    ((2, 2, 4, 3), 5, 2, 2, None),
    ((1, 6, 8, 8), 3, 2, 0, (3, 3)),
    ((2, 3, 7, 7), 2, 2, 1, None),
    ((1, 1, 3, 3), 3, 1, 0, None),
]


def _pairs(geo):
    from minicaffe.kernels._backend import as_pair
    shape, k, s, p, hw = geo
    (kh, kw), (sh, sw), (ph, pw) = as_pair(k, "k"), as_pair(s, "s"), as_pair(p, "p")
    PH, PW = hw or pool16.output_shape(shape[2], shape[3], k, s, p)
    return shape, kh, kw, sh, sw, ph, pw, PH, PW


def _cover(h, ph, kh, sh, PH):
    """Caffe's phstart, phend: the windows covering input row h."""
    return (0 if h + ph < kh else (h + ph - kh) // sh + 1), min((h + ph) // sh + 1, PH)


def naive_max(x, geo, kind, dy=None):
    """Element by element: (y, argmax offsets k = i*kw + j or -1) of the fp32 NCHW values
    ``x`` by the module's rule (rows then columns, strictly greater, the first NaN,
    padding never), or with ``dy`` the gradient: per input the fp32 sum over the windows
    covering it (Caffe's phstart/phend, p then q ascending) of dy where k names it,
    rounded once to ``kind``."""
    (N, C, H, W), kh, kw, sh, sw, ph, pw, PH, PW = _pairs(geo)
    y = np.full((N, C, PH, PW), -np.inf, np.float32)
    k = np.full((N, C, PH, PW), -1, np.int64)
    for n, c, p, q in np.ndindex(N, C, PH, PW):
        hs, ws = p * sh - ph, q * sw - pw
        m = np.float32(-np.finfo(np.float32).max)
        for h in range(max(hs, 0), min(hs + kh, H)):
            for w in range(max(ws, 0), min(ws + kw, W)):
                v = x[n, c, h, w]
                if v > m or (np.isnan(v) and not np.isnan(m)):
                    m, y[n, c, p, q], k[n, c, p, q] = v, v, (h - hs) * kw + (w - ws)
    if dy is None:
        return y, k
    dx = np.zeros(x.shape, np.float32)
    for n, c, h, w in np.ndindex(*x.shape):
        g = np.float32(0)
        p0, p1 = _cover(h, ph, kh, sh, PH)
        q0, q1 = _cover(w, pw, kw, sw, PW)
        for p in range(p0, p1):
            for q in range(q0, q1):
                if k[n, c, p, q] == (h + ph - p * sh) * kw + (w + pw - q * sw):
                    g = np.float32(g + dy[n, c, p, q])
        dx[n, c, h, w] = g
    return P.round_to(np, dx, kind)


def _pool_size(p, q, H, W, kh, kw, sh, sw, ph, pw):
    hs, ws = p * sh - ph, q * sw - pw
    return np.float32((min(hs + kh, H + ph) - hs) * (min(ws + kw, W + pw) - ws))


def naive_ave(x, geo, kind, dy=None):
    """Caffe's AVE element by element in fp32 (pool_size from the window clipped to
    [-pad, H + pad), the sum over the window clipped to the image in row order; the
    backward's sum of dy / pool_size over the covering windows), rounded once."""
    (N, C, H, W), kh, kw, sh, sw, ph, pw, PH, PW = _pairs(geo)
    g = (H, W, kh, kw, sh, sw, ph, pw)
    if dy is None:
        y = np.zeros((N, C, PH, PW), np.float32)
        for n, c, p, q in np.ndindex(N, C, PH, PW):
            hs, ws = p * sh - ph, q * sw - pw
            s = np.float32(0)
            for h in range(max(hs, 0), min(hs + kh, H)):
                for w in range(max(ws, 0), min(ws + kw, W)):
                    s = np.float32(s + x[n, c, h, w])
            y[n, c, p, q] = s / _pool_size(p, q, *g)
        return P.round_to(np, y, kind)
    dx = np.zeros(x.shape, np.float32)
    for n, c, h, w in np.ndindex(*x.shape):
        s = np.float32(0)
        p0, p1 = _cover(h, ph, kh, sh, PH)
        q0, q1 = _cover(w, pw, kw, sw, PW)
        for p in range(p0, p1):
            for q in range(q0, q1):
                s = np.float32(s + dy[n, c, p, q] / _pool_size(p, q, *g))
        dx[n, c, h, w] = s
    return P.round_to(np, dx, kind)


def run_overlap(x, geo, kind, method, dy=None, mask=None, layout="nhwc"):
    """The module's body on the words of ``x`` (NCHW fp32) held ``layout``: the forward's
    (y NCHW values, argmax bytes N, PH, PW, C) or the backward's dx (NCHW values)."""
    (N, C, H, W), kh, kw, sh, sw, ph, pw, PH, PW = _pairs(geo)
    shape, k, s, p, hw = geo
    to, back = (nhwc, nchw) if layout == "nhwc" else (np.ascontiguousarray,) * 2
    kw_ = dict(out_hw=hw, nchw=layout == "nchw")
    if dy is None:
        xw = words(to(x), kind)
        y = np.full(to(np.zeros((N, C, PH, PW))).shape, 7, xw.dtype)
        if method == "max":
            m = np.full(N * PH * PW * C, 77, np.uint8)
            pool16.max_pool_forward_argmax(xw, y, m, shape, k, s, p, kind, **kw_)
            return back(values(y, kind)), m.reshape(N, PH, PW, C)
        pool16.ave_pool_forward(xw, y, shape, k, s, p, kind, **kw_)
        return back(values(y, kind)), None
    dyw = words(to(dy), kind)
    dx = np.full(to(x).shape, 7, dyw.dtype)                  # every value written
    if method == "max":
        pool16.max_pool_backward_argmax(dyw, mask, dx, shape, k, s, p, kind, **kw_)
    else:
        pool16.ave_pool_backward(dyw, dx, shape, k, s, p, kind, **kw_)
    return back(values(dx, kind))


def special_maps(shape, seed, kind):
    """tied_maps with NaNs and -infs sprinkled in and one all -inf 2x2 corner."""
    x = tied_maps(shape, seed, kind)
    rs = np.random.RandomState(seed + 1)
    x[rs.random_sample(shape) < 0.05] = np.nan
    x[rs.random_sample(shape) < 0.05] = -np.inf
    x[0, 0, :2, :2] = -np.inf
    return x


def same_bits(a, b):
    """Equal bit for bit, except that a NaN only has to be a NaN."""
    na, nb = np.isnan(a), np.isnan(b)
    return np.array_equal(na, nb) and np.array_equal(a[~na].view(np.uint32),
                                                      b[~nb].view(np.uint32))


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("geo", OVERLAP_GEOMETRIES)
def test_overlapping_max_is_the_naive_loop_ties_nan_and_padding_included(geo, kind, layout):
    x = special_maps(geo[0], 11, kind)
    y, k = naive_max(x, geo, kind)
    got, mask = run_overlap(x, geo, kind, "max", layout=layout)
    assert np.array_equal(got.view(np.uint32), y.view(np.uint32))    # the selected word
    assert np.array_equal(mask, np.where(k < 0, 255, k).transpose(0, 2, 3, 1))
    rs = np.random.RandomState(12)
    dy = values(words(rs.standard_normal(y.shape), kind), kind)
    dx = run_overlap(x, geo, kind, "max", dy, mask, layout=layout)
    assert same_bits(dx, naive_max(x, geo, kind, dy))


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("geo", OVERLAP_GEOMETRIES)
def test_ave_is_the_naive_loop(geo, kind, layout):
    rs = np.random.RandomState(13)
    x = values(words(rs.standard_normal(geo[0]) * 3, kind), kind)
    x[0, 0, 0, 0] = -0.0
    y = naive_ave(x, geo, kind)
    got, _ = run_overlap(x, geo, kind, "ave", layout=layout)
    assert np.array_equal(got.view(np.uint32), y.view(np.uint32))
    dy = values(words(rs.standard_normal(y.shape), kind), kind)
    assert np.array_equal(run_overlap(x, geo, kind, "ave", dy, layout=layout).view(np.uint32),
                          naive_ave(x, geo, kind, dy).view(np.uint32))
    x = special_maps(geo[0], 14, kind)        # a NaN or -inf in a window: the fp32 sum's
    assert same_bits(run_overlap(x, geo, kind, "ave", layout=layout)[0],
                     naive_ave(x, geo, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_overlapping_max_is_caffes_on_finite_maps(kind):
    """ResNet's pool1 geometry (3x3/2, CEIL): y is Caffe's fp32 kernels' bit for bit, the
    gradient Caffe's fp32 one rounded once (ties: many, in a few levels)."""
    geo = ((2, 8, 11, 11), 3, 2, 0, None)
    x = tied_maps(geo[0], 15, kind)
    y, mask = K.max_pool_forward(x, 3, 2, 0)
    got, m = run_overlap(x, geo, kind, "max")
    assert np.array_equal(got, y)
    rs = np.random.RandomState(16)
    dy = values(words(rs.standard_normal(y.shape), kind), kind)
    ref = P.round_to(np, K.max_pool_backward(dy, mask, x.shape, 3, 2, 0), kind)
    assert np.array_equal(run_overlap(x, geo, kind, "max", dy, m), ref)


def test_a_window_of_more_than_255_inputs_has_no_argmax_byte():
    x = np.zeros(16 * 16 * 2, np.uint16)
    with pytest.raises(ValueError, match="argmax"):
        pool16.max_pool_forward_argmax(x, np.zeros(2, np.uint16), np.zeros(2, np.uint8),
                                       (1, 2, 16, 16), 16, 1, 0, P.BFLOAT16)
    pool16.ave_pool_forward(x, np.zeros(2, np.uint16), (1, 2, 16, 16), 16, 1, 0, P.BFLOAT16)
    assert pool16.argmax_bytes((2, 3, 9, 9), (4, 4)) == 96
