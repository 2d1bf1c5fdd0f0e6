import itertools

import numpy as np
import pytest

from minicaffe.kernels import (lrn_across_channels_backward, lrn_across_channels_forward,
                               lrn_backward, lrn_forward, lrn_within_channel_backward,
                               lrn_within_channel_forward)

# (shape, size, alpha, beta, k)
CASES = [
    ((2, 7, 3, 4), 5, 1e-1, 0.75, 1.0),
    ((1, 4, 5, 5), 3, 2.0, 0.6, 2.0),
    ((2, 3, 4, 3), 7, 0.5, 1.3, 1.5),        # window wider than C
    ((1, 5, 2, 2), 1, 0.3, 0.75, 1.0),
]


def naive_across(x, size, alpha, beta, k):
    N, C, H, W = x.shape
    pre = (size - 1) // 2
    scale = np.empty_like(x)
    for n, c, h, w in itertools.product(range(N), range(C), range(H), range(W)):
        acc = sum(x[n, cc, h, w] ** 2 for cc in range(max(0, c - pre), min(C, c + pre + 1)))
        scale[n, c, h, w] = k + alpha / size * acc
    return x * scale ** -beta, scale


def naive_within(x, size, alpha, beta):
    N, C, H, W = x.shape
    pre = (size - 1) // 2
    scale = np.empty_like(x)
    for n, c, h, w in itertools.product(range(N), range(C), range(H), range(W)):
        acc = (x[n, c, max(0, h - pre):h + pre + 1, max(0, w - pre):w + pre + 1] ** 2).sum()
        scale[n, c, h, w] = 1 + alpha / size ** 2 * acc
    return x * scale ** -beta, scale


def _fd_grad(f, x, dy, eps=1e-6):
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
    return num


@pytest.mark.parametrize("case", CASES)
def test_across_forward_vs_naive(case):
    shape, size, alpha, beta, k = case
    x = np.random.default_rng(0).standard_normal(shape)
    y, scale = lrn_across_channels_forward(x, size, alpha, beta, k)
    ry, rs = naive_across(x, size, alpha, beta, k)
    np.testing.assert_allclose(scale, rs, rtol=1e-12)
    np.testing.assert_allclose(y, ry, rtol=1e-12, atol=1e-14)
    y32, s32 = lrn_forward(x.astype(np.float32), size, alpha, beta, k)
    assert y32.dtype == np.float32 and s32.dtype == np.float32
    np.testing.assert_allclose(y32, ry, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES[:3])
def test_across_vs_torch(case):
    torch = pytest.importorskip("torch")
    shape, size, alpha, beta, k = case
    x = np.random.default_rng(1).standard_normal(shape)
    y, scale = lrn_across_channels_forward(x, size, alpha, beta, k)
    xt = torch.from_numpy(x).requires_grad_()
    yt = torch.nn.functional.local_response_norm(xt, size, alpha=alpha, beta=beta, k=k)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-10, atol=1e-12)
    dy = np.random.default_rng(2).standard_normal(shape)
    yt.backward(torch.from_numpy(dy))
    dx = lrn_across_channels_backward(dy, x, y, scale, size, alpha, beta)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("case", CASES)
def test_across_backward_finite_differences(case):
    shape, size, alpha, beta, k = case
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape)
    y, scale = lrn_across_channels_forward(x, size, alpha, beta, k)
    dy = rng.standard_normal(shape)
    dx = lrn_backward(dy, x, y, scale, size, alpha, beta)
    num = _fd_grad(lambda a: lrn_across_channels_forward(a, size, alpha, beta, k)[0], x, dy)
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", CASES)
def test_within_forward_vs_naive_and_fd(case):
    shape, size, alpha, beta, _ = case
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape)
    y, scale = lrn_within_channel_forward(x, size, alpha, beta)
    ry, rs = naive_within(x, size, alpha, beta)
    np.testing.assert_allclose(scale, rs, rtol=1e-12)
    np.testing.assert_allclose(y, ry, rtol=1e-12, atol=1e-14)
    dy = rng.standard_normal(shape)
    dx = lrn_within_channel_backward(dy, x, y, scale, size, alpha, beta)
    num = _fd_grad(lambda a: lrn_within_channel_forward(a, size, alpha, beta)[0], x, dy)
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-7)
    y32, _ = lrn_within_channel_forward(x.astype(np.float32), size, alpha, beta)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, ry, rtol=1e-5, atol=1e-6)


def test_even_size_rejected():
    x = np.ones((1, 4, 2, 2))
    with pytest.raises(ValueError):
        lrn_across_channels_forward(x, 4)
    with pytest.raises(ValueError):
        lrn_within_channel_forward(x, 2)


# ---------------------------------------------------------------- GPU parity
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_gpu_parity(cp, case, dtype):
    shape, size, alpha, beta, k = case
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gx, gdy = cp.asarray(x), cp.asarray(dy)
    for fwd, bwd, extra in ((lrn_across_channels_forward, lrn_across_channels_backward, (k,)),
                            (lrn_within_channel_forward, lrn_within_channel_backward, ())):
        y, scale = fwd(x, size, alpha, beta, *extra)
        gy, gscale = fwd(gx, size, alpha, beta, *extra)
        assert isinstance(gy, cp.ndarray) and gy.dtype == dtype and gscale.dtype == dtype
        np.testing.assert_allclose(cp.asnumpy(gscale), scale, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cp.asnumpy(gy), y, rtol=1e-5, atol=1e-6)
        dx = bwd(dy, x, y, scale, size, alpha, beta)
        gdx = bwd(gdy, gx, gy, gscale, size, alpha, beta)
        assert gdx.dtype == dtype
        np.testing.assert_allclose(cp.asnumpy(gdx), dx, rtol=1e-5, atol=1e-5)
