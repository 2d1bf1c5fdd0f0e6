import itertools
import math

import numpy as np
import pytest

from minicaffe.kernels import (ave_pool_backward, ave_pool_forward, max_pool_backward,
                               max_pool_forward, pool_output_shape, stochastic_pool_backward,
                               stochastic_pool_forward_test, stochastic_pool_forward_train)

FLT_MAX = float(np.finfo(np.float32).max)
FLT_MIN = float(np.finfo(np.float32).tiny)

# (N, C, H, W, kernel, stride, pad)
CONFIGS = [
    (2, 3, 7, 7, (3, 3), (2, 2), (0, 0)),     # ceil overhang, no pad
    (2, 2, 6, 7, (3, 3), (2, 2), (1, 1)),     # ceil + pad: clipped divisor windows
    (1, 3, 8, 6, (2, 3), (2, 1), (1, 1)),
    (2, 2, 5, 8, (3, 2), (1, 3), (1, 0)),
    (1, 2, 9, 9, (4, 4), (3, 3), (2, 2)),     # PH -= 1 correction
    (2, 2, 6, 5, (6, 5), (1, 1), (0, 0)),     # global pooling
    (1, 2, 7, 8, (2, 2), (3, 3), (0, 0)),     # stride > kernel (torch's size differs)
]
NOPAD = [c for c in CONFIGS if c[6] == (0, 0)] + [(2, 2, 6, 7, (3, 3), (2, 2), (0, 0)),
                                                   (1, 3, 8, 6, (2, 3), (2, 1), (0, 0))]


def windows(H, W, k, s, p, PH, PW):
    for ph, pw in itertools.product(range(PH), range(PW)):
        yield ph, pw, ph * s[0] - p[0], pw * s[1] - p[1]


def naive_max(x, k, s, p):
    N, C, H, W = x.shape
    PH, PW = pool_output_shape(H, W, k, s, p)
    y = np.full((N, C, PH, PW), -FLT_MAX, dtype=x.dtype)
    m = np.full((N, C, PH, PW), -1, dtype=np.int64)
    for n, c in itertools.product(range(N), range(C)):
        for ph, pw, hs, ws in windows(H, W, k, s, p, PH, PW):
            he, we = min(hs + k[0], H), min(ws + k[1], W)
            for h in range(max(hs, 0), he):
                for w in range(max(ws, 0), we):
                    if x[n, c, h, w] > y[n, c, ph, pw]:
                        y[n, c, ph, pw] = x[n, c, h, w]
                        m[n, c, ph, pw] = h * W + w
    return y, m


def naive_ave(x, k, s, p):
    N, C, H, W = x.shape
    PH, PW = pool_output_shape(H, W, k, s, p)
    y = np.zeros((N, C, PH, PW), dtype=x.dtype)
    for n, c in itertools.product(range(N), range(C)):
        for ph, pw, hs, ws in windows(H, W, k, s, p, PH, PW):
            he, we = min(hs + k[0], H + p[0]), min(ws + k[1], W + p[1])
            size = (he - hs) * (we - ws)
            tot = 0.0
            for h in range(max(hs, 0), min(he, H)):
                for w in range(max(ws, 0), min(we, W)):
                    tot += x[n, c, h, w]
            y[n, c, ph, pw] = tot / size
    return y


def naive_index_backward(dy, m, shape):
    dx = np.zeros(shape, dtype=dy.dtype)
    N, C, PH, PW = dy.shape
    W = shape[3]
    for n, c, ph, pw in itertools.product(range(N), range(C), range(PH), range(PW)):
        if m[n, c, ph, pw] >= 0:
            h, w = divmod(int(m[n, c, ph, pw]), W)
            dx[n, c, h, w] += dy[n, c, ph, pw]
    return dx


def naive_sto_train(x, u, k, s):
    N, C, H, W = x.shape
    PH, PW = pool_output_shape(H, W, k, s, 0)
    y = np.zeros((N, C, PH, PW), dtype=x.dtype)
    idx = np.full((N, C, PH, PW), -1, dtype=np.int64)
    for n, c in itertools.product(range(N), range(C)):
        for ph, pw, hs, ws in windows(H, W, k, s, (0, 0), PH, PW):
            cells = [(h, w) for h in range(hs, min(hs + k[0], H)) for w in range(ws, min(ws + k[1], W))]
            tot = x.dtype.type(0)
            for h, w in cells:
                tot += x[n, c, h, w]
            thres = x.dtype.type(u[n, c, ph, pw]) * tot
            cum = x.dtype.type(0)
            for h, w in cells:      # falls back to the last cell if never reached
                cum += x[n, c, h, w]
                y[n, c, ph, pw], idx[n, c, ph, pw] = x[n, c, h, w], h * W + w
                if cum >= thres:
                    break
    return y, idx


def naive_sto_test(x, k, s):
    N, C, H, W = x.shape
    PH, PW = pool_output_shape(H, W, k, s, 0)
    y = np.zeros((N, C, PH, PW), dtype=x.dtype)
    for n, c in itertools.product(range(N), range(C)):
        for ph, pw, hs, ws in windows(H, W, k, s, (0, 0), PH, PW):
            win = x[n, c, hs:min(hs + k[0], H), ws:min(ws + k[1], W)]
            y[n, c, ph, pw] = (win * win).sum() / (FLT_MIN + win.sum())
    return y


def test_output_shape_rules():
    assert pool_output_shape(7, 7, 3, 2, 0) == (3, 3)
    assert pool_output_shape(6, 6, 3, 2, 1) == (4, 4)          # ceil
    assert pool_output_shape(9, 9, 4, 3, 2) == (4, 4)          # ceil 5 then PH -= 1
    assert pool_output_shape(7, 8, 2, 3, 0) == (3, 3)          # no correction without pad
    assert pool_output_shape(13, 13, 3, 2, 0) == (6, 6)
    assert pool_output_shape(6, 5, (6, 5), 1, 0) == (1, 1)     # global


@pytest.mark.parametrize("cfg", CONFIGS)
def test_max_forward_backward_vs_naive(cfg):
    N, C, H, W, k, s, p = cfg
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    y, m = max_pool_forward(x, k, s, p)
    ry, rm = naive_max(x, k, s, p)
    assert m.dtype == np.int32
    np.testing.assert_array_equal(y, ry)
    np.testing.assert_array_equal(m, rm)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    np.testing.assert_allclose(max_pool_backward(dy, m, x.shape), naive_index_backward(dy, m, x.shape),
                               rtol=1e-6, atol=1e-6)
    # a float top_mask (Caffe's second top) works as well
    np.testing.assert_array_equal(max_pool_backward(dy, m.astype(np.float32), x.shape),
                                  max_pool_backward(dy, m, x.shape))


def test_max_ties_pick_first_and_special_values():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 3, size=(2, 2, 7, 7)).astype(np.float64)   # many ties
    x[0, 0, :3, :3] = -np.inf                                       # window of -inf only
    x[1, 1, 2, 2] = np.nan
    for k, s, p in [((3, 3), (2, 2), (1, 1)), ((2, 2), (1, 1), (0, 0)), ((3, 2), (2, 3), (1, 0))]:
        y, m = max_pool_forward(x, k, s, p)
        ry, rm = naive_max(x, k, s, p)
        np.testing.assert_array_equal(y, ry)
        np.testing.assert_array_equal(m, rm)
    y, m = max_pool_forward(x, 2, 2, 0)
    assert y[0, 0, 0, 0] == -FLT_MAX and m[0, 0, 0, 0] == -1
    dx = max_pool_backward(np.ones_like(y), m, x.shape)
    assert dx[0, 0, :2, :2].sum() == 0


@pytest.mark.parametrize("cfg", CONFIGS)
def test_ave_forward_vs_naive_and_adjoint(cfg):
    N, C, H, W, k, s, p = cfg
    rng = np.random.default_rng(2)
    x = rng.standard_normal((N, C, H, W))
    y = ave_pool_forward(x, k, s, p)
    np.testing.assert_allclose(y, naive_ave(x, k, s, p), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = ave_pool_backward(dy, x.shape, k, s, p)
    assert dx.shape == x.shape
    assert np.isclose(np.vdot(y, dy), np.vdot(x, dx), rtol=1e-12)
    # float32 keeps its dtype
    assert ave_pool_forward(x.astype(np.float32), k, s, p).dtype == np.float32


def _torch_pool_cases():
    # torch requires pad <= kernel/2 and shrinks the ceil size also without
    # padding, so only the configurations where both definitions agree.
    for cfg in CONFIGS:
        N, C, H, W, k, s, p = cfg
        if all(pp <= kk // 2 for pp, kk in zip(p, k)):
            t = tuple(int(math.ceil((n + 2 * pp - kk) / ss)) + 1 for n, kk, ss, pp in zip((H, W), k, s, p))
            t = tuple(o - 1 if (o - 1) * ss >= n + pp else o for o, n, ss, pp in zip(t, (H, W), s, p))
            if t == pool_output_shape(H, W, k, s, p):
                yield cfg


@pytest.mark.parametrize("cfg", list(_torch_pool_cases()))
def test_max_and_ave_vs_torch(cfg):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    N, C, H, W, k, s, p = cfg
    x = np.random.default_rng(3).standard_normal((N, C, H, W))
    y, m = max_pool_forward(x, k, s, p)
    ty, ti = F.max_pool2d(torch.from_numpy(x), k, s, p, ceil_mode=True, return_indices=True)
    np.testing.assert_array_equal(y, ty.numpy())
    np.testing.assert_array_equal(m, ti.numpy())
    # for these (pad <= kernel/2) configurations torch's count_include_pad
    # divisor equals Caffe's (both clip the window to H + pad first); the
    # naive-loop test above covers every configuration.
    ya = ave_pool_forward(x, k, s, p)
    ta = F.avg_pool2d(torch.from_numpy(x), k, s, p, ceil_mode=True, count_include_pad=True)
    np.testing.assert_allclose(ya, ta.numpy(), rtol=1e-12, atol=1e-12)
    # gradients
    dy = np.random.default_rng(4).standard_normal(y.shape)
    xt = torch.from_numpy(x).requires_grad_()
    F.max_pool2d(xt, k, s, p, ceil_mode=True).backward(torch.from_numpy(dy))
    np.testing.assert_allclose(max_pool_backward(dy, m, x.shape), xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    xt = torch.from_numpy(x).requires_grad_()
    F.avg_pool2d(xt, k, s, p, ceil_mode=True, count_include_pad=True).backward(torch.from_numpy(dy))
    np.testing.assert_allclose(ave_pool_backward(dy, x.shape, k, s, p), xt.grad.numpy(),
                               rtol=1e-12, atol=1e-12)


def _fd_check(f, x, dy, grad, eps=1e-6, tol=1e-6):
    num = np.empty_like(x)
    flat = x.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = np.vdot(f(x), dy)
        flat[i] = old - eps
        fm = np.vdot(f(x), dy)
        flat[i] = old
        num.reshape(-1)[i] = (fp - fm) / (2 * eps)
    np.testing.assert_allclose(grad, num, rtol=tol, atol=tol)


@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[4]])
def test_backward_finite_differences(cfg):
    N, C, H, W, k, s, p = cfg
    rng = np.random.default_rng(5)
    x = rng.permutation(N * C * H * W).reshape(N, C, H, W) * 0.01 + 0.001 * rng.random((N, C, H, W))
    y, m = max_pool_forward(x, k, s, p)
    dy = rng.standard_normal(y.shape)
    _fd_check(lambda a: max_pool_forward(a, k, s, p)[0], x, dy, max_pool_backward(dy, m, x.shape))
    _fd_check(lambda a: ave_pool_forward(a, k, s, p), x, dy, ave_pool_backward(dy, x.shape, k, s, p))


@pytest.mark.parametrize("cfg", NOPAD)
def test_stochastic_vs_naive(cfg):
    N, C, H, W, k, s, _ = cfg
    rng = np.random.default_rng(6)
    x = rng.random((N, C, H, W)).astype(np.float32)
    x[0, 0, :2, :] = 0                                  # some all-zero windows
    PH, PW = pool_output_shape(H, W, k, s, 0)
    u = rng.random((N, C, PH, PW)).astype(np.float32)
    u[0, 0, 0, 0] = 1.0
    y, idx = stochastic_pool_forward_train(x, u, k, s)
    ry, ridx = naive_sto_train(x, u, k, s)
    assert idx.dtype == np.int32
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_array_equal(y, ry)
    # the selected value is the input at idx
    np.testing.assert_array_equal(np.take_along_axis(x.reshape(N, C, -1), idx.reshape(N, C, -1), 2),
                                  y.reshape(N, C, -1))
    yt = stochastic_pool_forward_test(x, k, s)
    np.testing.assert_allclose(yt, naive_sto_test(x, k, s), rtol=1e-6)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    np.testing.assert_allclose(stochastic_pool_backward(dy, idx, x.shape),
                               naive_index_backward(dy, idx, x.shape), rtol=1e-6, atol=1e-6)
    # negative inputs exercise the "never reached" fallback identically
    xn = rng.standard_normal((N, C, H, W))
    y2, i2 = stochastic_pool_forward_train(xn, u.astype(np.float64), k, s)
    ry2, ri2 = naive_sto_train(xn, u.astype(np.float64), k, s)
    np.testing.assert_array_equal(i2, ri2)
    np.testing.assert_array_equal(y2, ry2)


# stride > kernel without padding: the last CEIL window starts at H, so it is
# empty.  Caffe then outputs -FLT_MAX / mask -1 (MAX) and 0/0 = NaN (AVE,
# pool_size 0); the kernels reproduce that.
DEGENERATE = (1, 2, 4, 5, (1, 1), (2, 2), (0, 0))


def test_degenerate_empty_windows():
    N, C, H, W, k, s, p = DEGENERATE
    x = np.random.default_rng(10).standard_normal((N, C, H, W))
    y, m = max_pool_forward(x, k, s, p)
    assert y.shape == (1, 2, 3, 3)
    assert (y[:, :, 2, :] == -FLT_MAX).all() and (m[:, :, 2, :] == -1).all()
    assert not np.isnan(y[:, :, :2, :]).any()
    ya = ave_pool_forward(x, k, s, p)
    assert np.isnan(ya[:, :, 2, :]).all()
    np.testing.assert_array_equal(ya[:, :, :2, :2], x[:, :, ::2, ::2][:, :, :2, :2])
    dx = max_pool_backward(np.ones_like(y), m, x.shape)
    assert dx.sum() == 6 * 2


def test_stochastic_sampling_distribution():
    # P(select element) = x / sum(window)
    x = np.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 2, 2)
    u = np.random.default_rng(7).random((20000, 1, 1, 1))
    xs = np.broadcast_to(x, (20000, 1, 2, 2)).copy()
    _, idx = stochastic_pool_forward_train(xs, u, 2, 1)
    freq = np.bincount(idx.ravel(), minlength=4) / idx.size
    np.testing.assert_allclose(freq, x.ravel() / 10, atol=0.015)


def test_stochastic_rejects_pad():
    x = np.ones((1, 1, 4, 4))
    with pytest.raises(ValueError):
        stochastic_pool_forward_test(x, 2, 2, 1)


# ---------------------------------------------------------------- GPU parity
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", CONFIGS + [DEGENERATE])
def test_gpu_parity_max_ave(cp, cfg, dtype):
    N, C, H, W, k, s, p = cfg
    rng = np.random.default_rng(8)
    x = rng.standard_normal((N, C, H, W)).astype(dtype)
    x[0, 0, 0, :2] = x[0, 0, 1, 0]                         # a few ties
    gx = cp.asarray(x)
    y, m = max_pool_forward(x, k, s, p)
    gy, gm = max_pool_forward(gx, k, s, p)
    assert gy.dtype == dtype and gm.dtype == np.int32
    np.testing.assert_array_equal(cp.asnumpy(gy), y)
    np.testing.assert_array_equal(cp.asnumpy(gm), m)
    dy = rng.standard_normal(y.shape).astype(dtype)
    ref = max_pool_backward(dy, m, x.shape)
    got = max_pool_backward(cp.asarray(dy), gm, x.shape, k, s, p)       # gather
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-5, atol=1e-5)
    got = max_pool_backward(cp.asarray(dy), gm, x.shape)                # scatter
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-5, atol=1e-5)
    ya = ave_pool_forward(x, k, s, p)
    np.testing.assert_allclose(cp.asnumpy(ave_pool_forward(gx, k, s, p)), ya, rtol=1e-5, atol=1e-6)
    with np.errstate(all="ignore"):
        ref = ave_pool_backward(dy, x.shape, k, s, p)
    got = ave_pool_backward(cp.asarray(dy), x.shape, k, s, p)
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", NOPAD)
def test_gpu_parity_stochastic(cp, cfg, dtype):
    N, C, H, W, k, s, _ = cfg
    rng = np.random.default_rng(9)
    x = rng.random((N, C, H, W)).astype(dtype)
    x[0, 0, :2, :] = 0
    PH, PW = pool_output_shape(H, W, k, s, 0)
    u = rng.random((N, C, PH, PW)).astype(dtype)
    y, idx = stochastic_pool_forward_train(x, u, k, s)
    gy, gidx = stochastic_pool_forward_train(cp.asarray(x), cp.asarray(u), k, s)
    np.testing.assert_array_equal(cp.asnumpy(gidx), idx)
    np.testing.assert_array_equal(cp.asnumpy(gy), y)
    np.testing.assert_allclose(cp.asnumpy(stochastic_pool_forward_test(cp.asarray(x), k, s)),
                               stochastic_pool_forward_test(x, k, s), rtol=1e-5, atol=1e-6)
    dy = rng.standard_normal(y.shape).astype(dtype)
    ref = stochastic_pool_backward(dy, idx, x.shape)
    for kw in ({"kernel": k, "stride": s}, {}):
        got = stochastic_pool_backward(cp.asarray(dy), gidx, x.shape, **kw)
        np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-5, atol=1e-5)
    # negative inputs (fallback path)
    xn = rng.standard_normal((N, C, H, W)).astype(dtype)
    y2, i2 = stochastic_pool_forward_train(xn, u, k, s)
    gy2, gi2 = stochastic_pool_forward_train(cp.asarray(xn), cp.asarray(u), k, s)
    np.testing.assert_array_equal(cp.asnumpy(gi2), i2)
    np.testing.assert_array_equal(cp.asnumpy(gy2), y2)
