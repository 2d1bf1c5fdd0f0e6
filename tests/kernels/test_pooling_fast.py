"""The numpy fast paths of kernels/pooling.py (phase planes, np.add.at backward) against the general path and naive loops of
Caffe's formulas: exact equality where the summation order is the same,
first-maximum ties, NaN / +-inf / -FLT_MAX inputs and empty windows."""
import itertools

import numpy as np
import pytest

from minicaffe.kernels import pooling as pl

FLT_MAX = float(np.finfo(np.float32).max)

# (N, C, H, W, kernel, stride, pad)
GEOMS = [
    (2, 3, 12, 12, (3, 3), (2, 2), (0, 0)),   # CIFAR-10 pool: overlapping, CEIL overhang
    (2, 2, 8, 8, (2, 2), (2, 2), (0, 0)),     # LeNet pool: stride == kernel
    (2, 2, 9, 7, (3, 3), (2, 2), (1, 1)),     # padding, clipped windows
    (1, 3, 8, 6, (2, 3), (2, 1), (1, 1)),     # non-square, stride 1 on w
    (2, 2, 5, 8, (3, 2), (1, 3), (1, 0)),     # stride > kernel on w
    (1, 2, 9, 9, (4, 4), (3, 3), (2, 2)),     # the PH -= 1 correction
    (1, 2, 7, 8, (2, 2), (3, 3), (0, 0)),     # stride > kernel, window past the image
    (2, 2, 6, 5, (6, 5), (1, 1), (0, 0)),     # global pooling
    (1, 2, 3, 2, (3, 3), (1, 1), (1, 1)),     # kernel wider than the image (pad)
    (2, 2, 11, 10, (3, 3), (1, 1), (1, 1)),   # stride 1 (LRN WITHIN_CHANNEL's pooling)
    (1, 2, 13, 13, (5, 5), (4, 4), (2, 2)),
    (1, 2, 34, 34, (17, 17), (17, 17), (0, 0)),  # 289 offsets: 16-bit ranks
]


@pytest.fixture
def general():
    """Run a body with the fast paths off, then restore them."""
    def run(fn, *args):
        old = pl.FAST_PATH
        pl.FAST_PATH = False
        try:
            return fn(*args)
        finally:
            pl.FAST_PATH = old
    return run


@pytest.fixture(params=["phase", "general"])
def max_path(request, monkeypatch):
    """Every geometry through the phase planes (no waste limit), or through the
    general path (the phase planes refused by a zero waste limit)."""
    if request.param == "general":
        monkeypatch.setattr(pl, "FAST_MAX_WASTE", 0.0)
    else:
        monkeypatch.setattr(pl, "FAST_MAX_WASTE", 1e9)
    return request.param


def naive_max(x, k, s, p):
    """Caffe's loop: strictly greater replaces, from -FLT_MAX; index h*W + w."""
    N, C, H, W = x.shape
    PH, PW = pl.pool_output_shape(H, W, k, s, p)
    y = np.full((N, C, PH, PW), -FLT_MAX, dtype=x.dtype)
    m = np.full((N, C, PH, PW), -1, dtype=np.int32)
    for n, c, i, j in itertools.product(range(N), range(C), range(PH), range(PW)):
        hs, ws = i * s[0] - p[0], j * s[1] - p[1]
        for h in range(max(hs, 0), min(hs + k[0], H)):
            for w in range(max(ws, 0), min(ws + k[1], W)):
                if x[n, c, h, w] > y[n, c, i, j]:
                    y[n, c, i, j] = x[n, c, h, w]
                    m[n, c, i, j] = h * W + w
    return y, m


def naive_route(dy, m, shape):
    """Caffe's CPU max backward: float adds in output order."""
    dx = np.zeros(shape, dtype=dy.dtype)
    W = shape[3]
    for n, c, i, j in itertools.product(*(range(v) for v in dy.shape)):
        if m[n, c, i, j] >= 0:
            h, w = divmod(int(m[n, c, i, j]), W)
            dx[n, c, h, w] += dy[n, c, i, j]
    return dx


def special_input(rng, shape, dtype):
    """Few distinct values (many ties) plus NaN, +-inf and -FLT_MAX, and some
    windows made entirely of NaN / -inf."""
    x = rng.integers(-2, 3, size=shape).astype(dtype)
    r = rng.random(shape)
    x[r < 0.08] = np.nan
    x[(r >= 0.08) & (r < 0.14)] = -np.inf
    x[(r >= 0.14) & (r < 0.17)] = np.inf
    x[(r >= 0.17) & (r < 0.21)] = -FLT_MAX
    x[0, 0, :3, :3] = np.nan
    x[-1, -1, :3, :3] = -np.inf
    x[0, -1, -3:, -3:] = -FLT_MAX
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geom", GEOMS)
def test_max_forward_matches_naive_and_general(geom, dtype, max_path, general):
    N, C, H, W, k, s, p = geom
    rng = np.random.default_rng(hash(geom) % 2**32)
    for x in (rng.standard_normal((N, C, H, W)).astype(dtype),
              rng.integers(0, 2, size=(N, C, H, W)).astype(dtype),   # ties everywhere
              special_input(rng, (N, C, H, W), dtype)):
        y, m = pl.max_pool_forward(x, k, s, p)
        ry, rm = naive_max(x, k, s, p)
        assert y.dtype == x.dtype and m.dtype == np.int32
        np.testing.assert_array_equal(m, rm)
        np.testing.assert_array_equal(y, ry)
        gy, gm = general(pl.max_pool_forward, x, k, s, p)
        np.testing.assert_array_equal(m, gm)
        np.testing.assert_array_equal(y, gy)
        assert not np.isnan(y).any()


def test_max_forward_special_windows():
    x = np.zeros((1, 3, 4, 4), np.float32)
    x[0, 0] = np.nan                            # all NaN: nothing selected
    x[0, 1] = -np.inf                           # all -inf: nothing selected
    x[0, 2] = 5.0                               # ties: the first in (h, w) order
    x[0, 2, 1, 0] = np.nan
    y, m = pl.max_pool_forward(x, 2, 2, 0)
    np.testing.assert_array_equal(y[0, :2], -FLT_MAX)
    np.testing.assert_array_equal(m[0, :2], -1)
    np.testing.assert_array_equal(y[0, 2], 5.0)
    np.testing.assert_array_equal(m[0, 2], [[0, 2], [8, 10]])
    x = np.full((1, 1, 3, 3), -FLT_MAX, np.float32)
    x[0, 0, 2, 2] = -np.inf
    x[0, 0, 1, 1] = np.nextafter(np.float32(-FLT_MAX), np.float32(0))
    y, m = pl.max_pool_forward(x, 2, 1, 0)
    # only values strictly above -FLT_MAX are ever selected
    np.testing.assert_array_equal(m[0, 0], [[4, 4], [4, 4]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geom", GEOMS)
def test_max_backward_matches_caffe_order(geom, dtype, general):
    N, C, H, W, k, s, p = geom
    rng = np.random.default_rng(1 + hash(geom) % 2**32)
    x = special_input(rng, (N, C, H, W), dtype)
    x[0, 0] = np.nan                                          # a plane of empty windows
    y, m = pl.max_pool_forward(x, k, s, p)
    assert (m < 0).any()
    dy = rng.standard_normal(y.shape).astype(dtype)
    ref = naive_route(dy, m, x.shape)
    for geo in ((k, s, p), ()):                               # with and without geometry
        dx = pl.max_pool_backward(dy, m, x.shape, *geo)
        assert dx.dtype == dtype and dx.shape == x.shape
        np.testing.assert_array_equal(dx, ref)                # same float order: exact
    np.testing.assert_allclose(general(pl.max_pool_backward, dy, m, x.shape, k, s, p), ref,
                               rtol=1e-6, atol=1e-6)
    # Caffe's float top_mask gives the same
    np.testing.assert_array_equal(pl.max_pool_backward(dy, m.astype(dtype), x.shape, k, s, p),
                                  ref)


def test_max_backward_nonfinite_dy_stays_put():
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    y, m = pl.max_pool_forward(x, 2, 2, 0)
    dy = np.array([[[[np.nan, np.inf], [1.0, -np.inf]]]], np.float32)
    dx = pl.max_pool_backward(dy, m, x.shape, 2, 2, 0)
    np.testing.assert_array_equal(dx, naive_route(dy, m, x.shape))
    assert np.isnan(dx).sum() == 1 and (dx == 0).sum() == 12


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geom", GEOMS)
def test_ave_matches_general(geom, dtype, max_path, general):
    N, C, H, W, k, s, p = geom
    rng = np.random.default_rng(2 + hash(geom) % 2**32)
    x = rng.standard_normal((N, C, H, W)).astype(dtype)
    y = pl.ave_pool_forward(x, k, s, p)
    # the same additions in the same order as the general path: identical bits
    np.testing.assert_array_equal(y, general(pl.ave_pool_forward, x, k, s, p))
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx = pl.ave_pool_backward(dy, x.shape, k, s, p)
    assert dx.shape == x.shape and dx.dtype == dtype
    np.testing.assert_array_equal(dx, general(pl.ave_pool_backward, dy, x.shape, k, s, p))
    # adjoint: <ave(x), dy> == <x, ave_backward(dy)>
    np.testing.assert_allclose((y.astype(np.float64) * dy).sum(),
                               (x.astype(np.float64) * dx).sum(), rtol=1e-5)


@pytest.mark.parametrize("geom", [g for g in GEOMS if g[6] == (0, 0)])
def test_stochastic_backward_matches_naive(geom):
    N, C, H, W, k, s, _ = geom
    rng = np.random.default_rng(3)
    x = rng.random((N, C, H, W)).astype(np.float32)
    PH, PW = pl.pool_output_shape(H, W, k, s, 0)
    u = rng.random((N, C, PH, PW)).astype(np.float32)
    y, idx = pl.stochastic_pool_forward_train(x, u, k, s)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    np.testing.assert_array_equal(pl.stochastic_pool_backward(dy, idx, x.shape, k, s),
                                  naive_route(dy, idx, x.shape))


def test_fast_path_choice():
    """CIFAR-10 and LeNet pooling use the phase planes; global pooling does not."""
    phase_ok = pl.uses_phase_planes
    assert phase_ok((100, 32, 32, 32), 3, 2, 0)
    assert phase_ok((64, 20, 24, 24), 2, 2, 0)
    assert not phase_ok((2, 2, 6, 5), (6, 5), 1, 0)


@pytest.mark.parametrize("fast", [True, False])
def test_out_arguments(fast, monkeypatch):
    """``out=`` receives the result (written in place when it is a C-contiguous
    array of the right shape and dtype, copied into otherwise) and is returned."""
    monkeypatch.setattr(pl, "FAST_PATH", fast)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    geo = (3, 2, 1)
    y, m = pl.max_pool_forward(x, *geo)
    ya = pl.ave_pool_forward(x, *geo)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dxm = pl.max_pool_backward(dy, m, x.shape, *geo)
    dxa = pl.ave_pool_backward(dy, x.shape, *geo)
    for out_y, out_x in ((np.full(y.shape, 7, np.float32), np.full(x.shape, 7, np.float32)),
                         (np.full(y.shape, 7, np.float64), np.full(x.shape, 7, np.float64)),
                         (np.full(y.shape[:2] + (8, 8), 7, np.float32)[:, :, :5, :5],
                          np.full(x.shape[:2] + (9, 10), 7, np.float32)[:, :, :, :9])):
        r, m2 = pl.max_pool_forward(x, *geo, out=out_y)
        assert r is out_y
        np.testing.assert_array_equal(out_y, y)
        np.testing.assert_array_equal(m2, m)
        assert pl.ave_pool_forward(x, *geo, out=out_y) is out_y
        np.testing.assert_array_equal(out_y, ya)
        assert pl.max_pool_backward(dy, m, x.shape, *geo, out=out_x) is out_x
        np.testing.assert_array_equal(out_x, dxm)
        assert pl.ave_pool_backward(dy, x.shape, *geo, out=out_x) is out_x
        np.testing.assert_array_equal(out_x, dxa)
    m[0, 0, 0, 0] = -1                                  # nothing routed from there
    out_x = np.full(x.shape, 7, np.float32)
    pl.max_pool_backward(dy, m, x.shape, *geo, out=out_x)
    # the general path sums in float64 (bincount): equal up to float rounding
    np.testing.assert_allclose(out_x, naive_route(dy, m, x.shape), rtol=1e-6, atol=1e-6)


def test_scratch_reuse_keeps_results_independent():
    """Scratch arrays are reused across calls and geometries: earlier results stay
    intact and a geometry with the same buffer size sees its own padding."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    y1, m1 = pl.max_pool_forward(x, 3, 2, 0)
    keep = y1.copy()
    pl.max_pool_forward(-x, 3, 2, 0)
    np.testing.assert_array_equal(y1, keep)
    for pad in (0, 1, 2):                                 # same shapes, different padding
        for k in (3, 4):
            y, m = pl.max_pool_forward(x, k, 2, pad)
            ry, rm = naive_max(x, (k, k), (2, 2), (pad, pad))
            np.testing.assert_array_equal(y, ry)
            np.testing.assert_array_equal(m, rm)
            np.testing.assert_array_equal(pl.ave_pool_forward(x, k, 2, pad),
                                          pl.ave_pool_forward(x.copy(), k, 2, pad))
