"""kernels/conv16.py's numpy body (the filter and bias gradients of a convolution over
few input channels, on channels-last 2-byte maps) against a naive loop over Caffe's
formulas; the GPU kernels against the numpy body, bit for bit (tests/test_conv16_gpu.py)."""
import numpy as np
import pytest

from minicaffe.core import precision as P
from minicaffe.kernels import conv16
from minicaffe.kernels.pool16 import _np_float, _np_store

STORAGES = [P.BFLOAT16, P.FLOAT16]
# (N, C, H, W, K, R, S, stride, pad, dilation)
GEOMS = [
    (2, 1, 9, 9, 5, 5, 5, (1, 1), (0, 0), (1, 1)),      # LeNet's conv1, smaller
    (2, 3, 7, 8, 4, 3, 3, (2, 1), (1, 1), (1, 1)),      # strides, padding
    (1, 2, 9, 7, 3, 3, 2, (1, 2), (2, 0), (2, 1)),      # dilation, pad past a tap
    (3, 1, 6, 6, 40, 3, 3, (1, 1), (1, 1), (1, 1)),     # K > 32: two channel blocks
]


def words(f, storage):
    """f rounded to ``storage``: (the buffer as the engine holds it, its fp32 values)."""
    w = _np_store(f, storage)
    buf = w if storage == P.BFLOAT16 else w.view(np.float16)
    return buf, _np_float(w, storage)


def naive_filter_gradient(xf, df, g):
    """dW[k, c, r, s] = sum over n, p, q of dy[n, p, q, k] x[n, p*sh-ph+r*dh, ...] and
    db[k] = sum of dy[..., k], in float64."""
    N, C, H, W, K, R, S, (sh, sw), (ph, pw), (dh, dw) = g
    Pn, Q = conv16.output_hw(g)
    dW = np.zeros((K, C, R, S))
    for n in range(N):
        for p in range(Pn):
            for q in range(Q):
                for c in range(C):
                    for r in range(R):
                        for s in range(S):
                            i, j = p * sh - ph + r * dh, q * sw - pw + s * dw
                            if 0 <= i < H and 0 <= j < W:
                                dW[:, c, r, s] += df[n, p, q, :].astype(np.float64) * xf[n, i, j, c]
    return dW, df.reshape(-1, K).astype(np.float64).sum(0)


def _inputs(g, storage, seed=0):
    N, C, H, W, K, R, S = g[:7]
    Pn, Q = conv16.output_hw(g)
    rs = np.random.RandomState(seed)
    x, xf = words(rs.standard_normal((N, H, W, C)).astype(np.float32), storage)
    d, df = words(rs.standard_normal((N, Pn, Q, K)).astype(np.float32), storage)
    return x, xf, d, df


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("g", GEOMS)
def test_filter_and_bias_gradients_accumulate_caffes_sums(storage, g):
    x, xf, d, df = _inputs(g, storage, seed=1)
    K, C, R, S = g[4], g[1], g[5], g[6]
    dw0 = np.linspace(-1, 1, K * C * R * S).astype(np.float32).reshape(K, C, R, S)
    db0 = np.linspace(2, 3, K).astype(np.float32)
    dw, db = dw0.copy(), db0.copy()
    conv16.backward_filter(x, d, dw, db, storage, g)
    wantw, wantb = naive_filter_gradient(xf, df, g)
    np.testing.assert_allclose(dw, dw0 + wantw, rtol=1e-5, atol=1e-4)   # Caffe: diff +=
    np.testing.assert_allclose(db, db0 + wantb, rtol=1e-5, atol=1e-4)
    # either alone gives the same bits
    dw2 = dw0.copy()
    conv16.backward_filter(x, d, dw2, None, storage, g)
    np.testing.assert_array_equal(dw2, dw)
    db2 = db0.copy()
    conv16.backward_filter(x, d, None, db2, storage, g)
    np.testing.assert_array_equal(db2, db)


def test_chunks_cover_the_positions_in_order():
    for npq in (1, 63, 64, 65, 1000, 36864, 10 ** 6):
        nb, chunk = conv16.blocks(npq)
        assert 1 <= nb <= conv16.MAX_BLOCKS
        assert (nb - 1) * chunk < npq <= nb * chunk
    # a chunked sum over many positions is the float64 sum within fp32 rounding
    g = (4, 1, 30, 30, 3, 3, 3, (1, 1), (0, 0), (1, 1))
    assert conv16.blocks(4 * 28 * 28)[0] > 1
    x, xf, d, df = _inputs(g, P.BFLOAT16, seed=2)
    dw = np.zeros((3, 1, 3, 3), np.float32)
    conv16.backward_filter(x, d, dw, None, P.BFLOAT16, g)
    np.testing.assert_allclose(dw, naive_filter_gradient(xf, df, g)[0], rtol=1e-4, atol=1e-3)


def test_what_the_kernels_take():
    assert conv16.applies((64, 1, 28, 28), 20, (5, 5))                 # LeNet's conv1
    assert conv16.applies((64, 3, 32, 32), 32, (5, 5))                 # CIFAR-10's conv1
    assert not conv16.applies((64, 20, 12, 12), 50, (5, 5))            # LeNet's conv2
    assert not conv16.applies((64, 3, 224, 224), 64, (7, 7))           # 3*49*64 weights
    assert not conv16.applies((64, 2, 8, 8), 4, (3, 3), group=2)
    assert not conv16.applies((64, 1, 8, 8, 8), 4, (3, 3, 3))          # 3-D
    # 32-bit indices
    assert conv16.fits((64, 1, 28, 28, 20, 5, 5, 1, 0, 1))
    assert not conv16.fits((4096, 3, 512, 512, 32, 3, 3, 1, 1, 1))


def test_wrong_buffers_are_refused():
    g = GEOMS[0]
    x, _, d, _ = _inputs(g, P.BFLOAT16)
    with pytest.raises(TypeError):      # a FLOAT16 buffer is float16, not uint16 words
        conv16.backward_filter(x, d, None, np.zeros(5, np.float32), P.FLOAT16, g)
    with pytest.raises(ValueError):
        conv16.backward_filter(x.reshape(-1)[:7], d, None, np.zeros(5, np.float32), P.BFLOAT16, g)
    with pytest.raises(ValueError):
        conv16.backward_filter(x, d, np.zeros(3, np.float32), None, P.BFLOAT16, g)
