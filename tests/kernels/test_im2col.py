import itertools

import numpy as np
import pytest

from minicaffe.kernels import (col2im, col2im_nd, conv_output_shape, im2col,
                               im2col_nd)

# (N, C, H, W, kernel, pad, stride, dilation)
CONFIGS = [
    (2, 3, 7, 6, (3, 3), (1, 1), (1, 1), (1, 1)),
    (1, 2, 8, 9, (3, 2), (0, 1), (2, 3), (1, 1)),
    (2, 2, 9, 8, (3, 3), (2, 1), (2, 1), (2, 3)),
    (3, 1, 5, 5, (1, 1), (0, 0), (1, 1), (1, 1)),
    (1, 3, 6, 7, (5, 4), (2, 2), (3, 2), (1, 1)),
    (2, 2, 4, 4, (4, 4), (0, 0), (1, 1), (1, 1)),
]


def naive_im2col(x, k, p, s, d):
    N, C, H, W = x.shape
    OH, OW = conv_output_shape(H, W, k, p, s, d)
    col = np.zeros((C * k[0] * k[1], N * OH * OW), dtype=x.dtype)
    for c, i, j, n, oh, ow in itertools.product(range(C), range(k[0]), range(k[1]),
                                               range(N), range(OH), range(OW)):
        h = oh * s[0] - p[0] + i * d[0]
        w = ow * s[1] - p[1] + j * d[1]
        if 0 <= h < H and 0 <= w < W:
            col[(c * k[0] + i) * k[1] + j, (n * OH + oh) * OW + ow] = x[n, c, h, w]
    return col


def naive_col2im(col, shape, k, p, s, d):
    N, C, H, W = shape
    OH, OW = conv_output_shape(H, W, k, p, s, d)
    x = np.zeros(shape, dtype=col.dtype)
    for c, i, j, n, oh, ow in itertools.product(range(C), range(k[0]), range(k[1]),
                                               range(N), range(OH), range(OW)):
        h = oh * s[0] - p[0] + i * d[0]
        w = ow * s[1] - p[1] + j * d[1]
        if 0 <= h < H and 0 <= w < W:
            x[n, c, h, w] += col[(c * k[0] + i) * k[1] + j, (n * OH + oh) * OW + ow]
    return x


@pytest.mark.parametrize("cfg", CONFIGS)
def test_im2col_matches_naive(cfg):
    N, C, H, W, k, p, s, d = cfg
    x = np.random.default_rng(0).standard_normal((N, C, H, W)).astype(np.float32)
    col = im2col(x, k, p, s, d)
    np.testing.assert_array_equal(col, naive_im2col(x, k, p, s, d))
    assert col.dtype == np.float32


@pytest.mark.parametrize("cfg", CONFIGS)
def test_col2im_matches_naive_and_is_adjoint(cfg):
    N, C, H, W, k, p, s, d = cfg
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N, C, H, W))
    OH, OW = conv_output_shape(H, W, k, p, s, d)
    c = rng.standard_normal((C * k[0] * k[1], N * OH * OW))
    back = col2im(c, x.shape, k, p, s, d)
    np.testing.assert_allclose(back, naive_col2im(c, x.shape, k, p, s, d), rtol=1e-12, atol=1e-12)
    lhs = np.vdot(im2col(x, k, p, s, d), c)
    rhs = np.vdot(x, back)
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs))


def test_scalar_params_and_output_shape():
    x = np.arange(2 * 1 * 5 * 5, dtype=np.float64).reshape(2, 1, 5, 5)
    assert conv_output_shape(5, 5, 3, 1, 2, 1) == (3, 3)
    assert conv_output_shape(9, 8, (3, 3), (2, 1), (2, 1), (2, 3)) == (5, 4)
    np.testing.assert_array_equal(im2col(x, 3, 1, 2), im2col(x, (3, 3), (1, 1), (2, 2), (1, 1)))
    with pytest.raises(ValueError):
        im2col(x, 7, 0, 1)


def _conv_via_im2col(x, w, stride, pad, dilation, groups):
    N, C, H, W = x.shape
    Cout, Cg, kh, kw = w.shape
    OH, OW = conv_output_shape(H, W, (kh, kw), pad, stride, dilation)
    col = im2col(x, (kh, kw), pad, stride, dilation)          # one buffer
    K = Cg * kh * kw
    Cog = Cout // groups
    y2 = np.concatenate([w[g * Cog:(g + 1) * Cog].reshape(Cog, K) @ col[g * K:(g + 1) * K]
                         for g in range(groups)], axis=0)
    return y2.reshape(Cout, N, OH, OW).transpose(1, 0, 2, 3)


@pytest.mark.parametrize("stride,pad,dilation,groups", [
    ((1, 1), (1, 1), (1, 1), 1),
    ((2, 1), (0, 2), (1, 1), 2),
    ((1, 2), (2, 1), (2, 1), 1),
    ((2, 2), (1, 1), (2, 2), 4),
])
def test_conv_vs_torch(stride, pad, dilation, groups):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 9, 8))
    w = rng.standard_normal((8, 4 // groups, 3, 3))
    y = _conv_via_im2col(x, w, stride, pad, dilation, groups)
    ref = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), stride=stride,
                                     padding=pad, dilation=dilation, groups=groups).numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-10)

    # data and weight gradients through col2im / one GEMM
    dy = rng.standard_normal(y.shape)
    xt = torch.from_numpy(x).requires_grad_()
    wt = torch.from_numpy(w).requires_grad_()
    torch.nn.functional.conv2d(xt, wt, stride=stride, padding=pad, dilation=dilation,
                               groups=groups).backward(torch.from_numpy(dy))
    Cout, Cg, kh, kw = w.shape
    K, Cog = Cg * kh * kw, Cout // groups
    dy2 = dy.transpose(1, 0, 2, 3).reshape(Cout, -1)
    col = im2col(x, (kh, kw), pad, stride, dilation)
    dw = np.concatenate([dy2[g * Cog:(g + 1) * Cog] @ col[g * K:(g + 1) * K].T
                         for g in range(groups)]).reshape(w.shape)
    dcol = np.concatenate([w[g * Cog:(g + 1) * Cog].reshape(Cog, K).T @ dy2[g * Cog:(g + 1) * Cog]
                           for g in range(groups)])
    dx = col2im(dcol, x.shape, (kh, kw), pad, stride, dilation)
    np.testing.assert_allclose(dw, wt.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_group_rows_equal_channel_slice_im2col():
    x = np.random.default_rng(3).standard_normal((2, 6, 7, 7)).astype(np.float32)
    col = im2col(x, 3, 1, 2, 1)
    K = 2 * 9
    for g in range(3):
        np.testing.assert_array_equal(col[g * K:(g + 1) * K], im2col(x[:, 2 * g:2 * g + 2], 3, 1, 2, 1))


# ---------------------------------------------------------------- N-D
def test_im2col_nd_2d_equals_im2col():
    for N, C, H, W, k, p, s, d in CONFIGS:
        x = np.random.default_rng(4).standard_normal((N, C, H, W))
        np.testing.assert_array_equal(im2col_nd(x, k, p, s, d), im2col(x, k, p, s, d))
        c = np.random.default_rng(5).standard_normal(im2col(x, k, p, s, d).shape)
        np.testing.assert_allclose(col2im_nd(c, x.shape, k, p, s, d),
                                   col2im(c, x.shape, k, p, s, d), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nd", [1, 3])
def test_im2col_nd_conv_vs_torch_and_adjoint(nd):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    spatial = (11,) if nd == 1 else (5, 6, 4)
    k = (3,) if nd == 1 else (3, 2, 2)
    p = (2,) if nd == 1 else (1, 0, 1)
    s = (2,) if nd == 1 else (1, 2, 1)
    d = (2,) if nd == 1 else (1, 1, 2)
    x = rng.standard_normal((2, 3) + spatial)
    w = rng.standard_normal((4, 3) + k)
    col = im2col_nd(x, k, p, s, d)
    out = w.reshape(4, -1) @ col
    conv = getattr(torch.nn.functional, f"conv{nd}d")
    ref = conv(torch.from_numpy(x), torch.from_numpy(w), stride=s, padding=p, dilation=d).numpy()
    y = out.reshape((4, 2) + ref.shape[2:]).swapaxes(0, 1)
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-10)
    c = rng.standard_normal(col.shape)
    assert np.isclose(np.vdot(col, c), np.vdot(x, col2im_nd(c, x.shape, k, p, s, d)), rtol=1e-10)


# ---------------------------------------------------------------- GPU parity
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_gpu_parity(cp, cfg, dtype):
    N, C, H, W, k, p, s, d = cfg
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, C, H, W)).astype(dtype)
    col = im2col(x, k, p, s, d)
    gcol = im2col(cp.asarray(x), k, p, s, d)
    assert isinstance(gcol, cp.ndarray) and gcol.dtype == dtype
    np.testing.assert_array_equal(cp.asnumpy(gcol), col)
    c = rng.standard_normal(col.shape).astype(dtype)
    ref = col2im(c, x.shape, k, p, s, d)
    got = col2im(cp.asarray(c), x.shape, k, p, s, d)
    assert got.shape == x.shape and got.dtype == dtype
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-5, atol=1e-5)
    # non-contiguous input (channel slice, grouped conv use)
    np.testing.assert_array_equal(cp.asnumpy(im2col(cp.asarray(x)[:, :1], k, p, s, d)),
                                  im2col(x[:, :1], k, p, s, d))
    np.testing.assert_array_equal(cp.asnumpy(im2col_nd(cp.asarray(x), k, p, s, d)), col)
    np.testing.assert_allclose(cp.asnumpy(col2im_nd(cp.asarray(c), x.shape, k, p, s, d)), ref,
                               rtol=1e-5, atol=1e-5)
