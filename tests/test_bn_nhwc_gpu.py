"""The channels-last batch norm kernels on 2-byte maps (kernels/reduced.bn_nhwc_*, issue
20): statistics, the forward and the backward against a float64 numpy reference of the
same rounded inputs, for every vector width (8, 4, 2, 1 channels per thread), several
columns and many chunks; bitwise the same on a second run (fixed-order sums, the kernels'
counters left at zero); the fused ReLU bitwise equal to a ReLU of the stored output and to
the backward of the masked gradient."""
import numpy as np
import pytest

from minicaffe.core import backend, context
from minicaffe.core import precision as P
from minicaffe.kernels import reduced as r16

pytestmark = pytest.mark.gpu

# (M rows = N*H*W, C): C = 64 and 2048 with 8 channels a thread (one and four columns of
# blocks), 12 with 4, 6 with 2, 5 with 1
SHAPES = [(20000, 64), (3136, 2048), (1500, 12), (999, 6), (1000, 5)]
EPS = 1e-5


def _words(cp, a, s):
    """(device words of ``a`` rounded to ``s``, the rounded values as float64)."""
    a = P.round_to(np, np.asarray(a, np.float32), s)
    w = (a.view(np.uint32) >> 16).astype(np.uint16) if s == P.BFLOAT16 else \
        a.astype(np.float16).view(np.uint16)
    return cp.asarray(w), a.astype(np.float64)


def _values(cp, w, s):
    w = cp.asnumpy(w)
    return ((w.astype(np.uint32) << 16).view(np.float32) if s == P.BFLOAT16 else
            w.view(np.float16).astype(np.float32)).astype(np.float64)


def _run(cp, x, dy, C, s, g, b, relu=False):
    M = x.size // C
    f = [cp.zeros(C, np.float32) for _ in range(6)]
    work = cp.zeros(r16.bn_work_size(M, C), np.float64)
    y, dx = cp.zeros_like(x), cp.zeros_like(x)
    r16.bn_nhwc_forward(x, y, C, s, g, b, EPS, f[0], f[1], f[2], f[3], work, relu=relu)
    sums = cp.zeros(2 * C, np.float32)
    r16.bn_nhwc_backward(x, dy, dx, C, s, g, f[0], f[1], f[4], f[5], False, sums, work,
                         beta=b, relu=relu)
    out = [cp.asnumpy(a) for a in [y, dx] + f + [sums]]
    assert not cp.asnumpy(work[:C].view(np.uint32)).any()    # the counters back at zero
    return out


@pytest.mark.parametrize("s", [P.BFLOAT16, P.FLOAT16])
@pytest.mark.parametrize("M,C", SHAPES)
def test_channels_last_batch_norm_matches_numpy_and_repeats_bitwise(s, M, C):
    context.set_mode_gpu()
    cp = backend.gpu_module()
    rs = np.random.RandomState(M + C)
    x, xr = _words(cp, 3.0 + 2.0 * rs.standard_normal((M, C)), s)
    dy, dyr = _words(cp, rs.standard_normal((M, C)), s)
    g = cp.asarray(rs.uniform(0.5, 1.5, C).astype(np.float32))
    b = cp.asarray(rs.uniform(-0.5, 0.5, C).astype(np.float32))
    gr, br = cp.asnumpy(g).astype(np.float64), cp.asnumpy(b).astype(np.float64)
    y, dx, mean, inv, bmean, bvar, dg, db, _ = _run(cp, x, dy, C, s, g, b)
    mu, var = xr.mean(0), xr.var(0)
    np.testing.assert_allclose(mean, mu, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(inv, 1 / np.sqrt(var + EPS), rtol=1e-5)
    np.testing.assert_allclose(bmean, mu, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(bvar, var * M / (M - 1), rtol=1e-5)
    xh = (xr - mu) / np.sqrt(var + EPS)
    ulp = 2.0 ** -8 if s == P.BFLOAT16 else 2.0 ** -11
    yref = xh * gr + br
    assert np.abs(_values(cp, cp.asarray(y), s) - yref).max() <= ulp * np.abs(yref).max()
    np.testing.assert_allclose(db, dyr.sum(0), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dg, (dyr * xh).sum(0), rtol=1e-4, atol=1e-3)
    dxref = gr / np.sqrt(var + EPS) * (dyr - dyr.mean(0) - xh * (dyr * xh).mean(0))
    err = np.abs(_values(cp, cp.asarray(dx), s) - dxref).max()
    assert err <= 4 * ulp * np.abs(dxref).max(), err
    # a second run: the same bits (fixed-order sums, whatever block finished last)
    again = _run(cp, x, dy, C, s, g, b)
    for a, c in zip([y, dx, mean, inv, bmean, bvar, dg, db], again):
        assert np.array_equal(a, c)


@pytest.mark.parametrize("s", [P.BFLOAT16, P.FLOAT16])
@pytest.mark.parametrize("M,C", [SHAPES[0], SHAPES[3]])
def test_the_fused_relu_is_the_relu_of_the_stored_output_and_its_masked_gradient(s, M, C):
    context.set_mode_gpu()
    cp = backend.gpu_module()
    rs = np.random.RandomState(7)
    x, _ = _words(cp, rs.standard_normal((M, C)), s)
    dy, _ = _words(cp, rs.standard_normal((M, C)), s)
    g = cp.asarray(rs.uniform(0.5, 1.5, C).astype(np.float32))
    b = cp.asarray(rs.uniform(-0.5, 0.5, C).astype(np.float32))
    plain = _run(cp, x, dy, C, s, g, b)
    fused = _run(cp, x, dy, C, s, g, b, relu=True)
    y = _values(cp, cp.asarray(plain[0]), s)
    yw = np.where(y > 0, plain[0], 0).astype(np.uint16)
    assert np.array_equal(fused[0], yw)                          # ReLU of the stored y
    assert 0.2 < (y > 0).mean() < 0.8
    masked = cp.asarray(np.where(y > 0, cp.asnumpy(dy), 0).astype(np.uint16))
    ref = _run(cp, x, masked, C, s, g, b)
    for k in range(1, 9):           # dx, the statistics, the parameter gradients, the sums
        assert np.array_equal(fused[k], ref[k]), k


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_batchnorm_scale_relu_fused_matches_the_relu_apart_channels_last(prec):
    """ResNet's pieces in bf16/fp16 held channels-last: BatchNorm+Scale+ReLU (the ReLU in
    the batch norm's kernels) against the same net with the ReLU out of place (the pair
    BatchNorm+Scale, then the ReLU's own kernels): the same loss, maps and gradients
    within the storage's tolerance (the kernels' arithmetic is the same: bitwise)."""
    from minicaffe import Net
    from minicaffe.core.config import RunConfig
    from minicaffe.engine.plan import MemoryPlan
    from minicaffe.proto import caffe_pb2
    from test_storage16_gpu import BLOCK, TOL
    apart_text = BLOCK.replace('"ReLU" bottom: "c1" top: "c1"', '"ReLU" bottom: "c1" top: "r1"') \
        .replace('"Convolution" bottom: "c1"', '"Convolution" bottom: "r1"')
    context.set_mode_gpu()
    nets = []
    for text in (BLOCK, apart_text):
        context.set_random_seed(1701)
        nets.append(Net(text, phase=caffe_pb2.TRAIN,
                        config=RunConfig(precision=prec, channels_last=True)))
    fused, apart = nets
    assert [f.type for f in fused.fusions][:1] == ["BatchNorm+Scale+ReLU"]
    assert [f.type for f in apart.fusions][:1] == ["BatchNorm+Scale"]
    for name in fused.params:
        for a, b in zip(fused.params[name], apart.params[name]):
            b.data[...] = a.data
    rs = np.random.RandomState(3)
    x = rs.standard_normal(fused.blobs["data"].shape).astype(np.float32)
    lab = rs.randint(0, 4, fused.blobs["label"].shape).astype(np.float32)
    plans = [MemoryPlan(n, reduced_storage=True) for n in nets]
    for p, n in zip(plans, nets):
        p.apply()
        n.blobs["data"].data[...] = x
        n.blobs["label"].data[...] = lab
    assert fused.blobs["c1"].data_mem.layout is not None      # the kernels' path
    losses = [float(n.forward()["loss"]) for n in nets]
    for n in nets:
        n.backward()
    tol = TOL[prec]
    assert abs(losses[0] - losses[1]) <= tol * abs(losses[0])

    def close(a, b, what):
        err = np.abs(a - b).max()
        print(f"{what}: |fused - apart| {err:.3g}, largest {np.abs(a).max():.3g}")
        assert err <= 2 * tol * np.abs(a).max() + 1e-6, what

    close(fused.blobs["c1"].data, apart.blobs["r1"].data, "relu(bn1)")
    assert (fused.blobs["c1"].data == 0).mean() > 0.2
    for name in ("c2", "sum", "pool", "ip"):
        close(fused.blobs[name].data, apart.blobs[name].data, name)
    for name in fused.params:
        for k, (a, b) in enumerate(zip(fused.params[name], apart.params[name])):
            close(a.diff, b.diff, f"{name}[{k}] diff")
            close(a.data, b.data, f"{name}[{k}]")       # BN's statistics too
    for p in plans:
        p.release()
