"""Normalization layers: BatchNorm and MVN.

BatchNorm against torch.nn.functional.batch_norm (train and eval) and Caffe's
running-statistics formulas; the statistics blobs get lr_mult 0 and the Net
never back-propagates into them; MVN against a naive loop; float64 gradient
checks; propagate_down; CPU/GPU parity (marked gpu).
"""
import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.blob import Blob
from minicaffe.core.errors import LayerError
from minicaffe.network.net import Net
from minicaffe.proto import caffe_pb2
from minicaffe.compat.testing import check_gradient, make_blob, make_layer

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def rand_blob(shape, seed=0, scale=1.0, shift=0.0):
    return make_blob(shape, values=np.random.RandomState(seed).randn(*shape) * scale + shift)


def forward(layer, x):
    top = Blob(dtype=x.dtype)
    layer.setup([x], [top])
    layer.forward([x], [top])
    return top


# ---------------------------------------------------------------------------
# BatchNorm
# ---------------------------------------------------------------------------
def test_batchnorm_setup_blobs_and_param_specs():
    layer = make_layer('name: "bn" type: "BatchNorm"')
    top = forward(layer, rand_blob((2, 3, 4, 5)))
    assert top.shape == (2, 3, 4, 5)
    assert [b.shape for b in layer.blobs] == [(3,), (3,), (1,)]
    assert [p.lr_mult for p in layer.layer_param.param] == [0.0, 0.0, 0.0]
    assert layer.param_propagate_down == [False, False, False]
    # train phase: batch statistics; test phase: global statistics
    assert not layer.use_global_stats
    t = make_layer('type: "BatchNorm"', phase=TEST)
    forward(t, rand_blob((2, 3)))
    assert t.use_global_stats
    t = make_layer('type: "BatchNorm" batch_norm_param { use_global_stats: false }', phase=TEST)
    forward(t, rand_blob((2, 3)))
    assert not t.use_global_stats


def test_batchnorm_refuses_learnable_statistics():
    layer = make_layer('name: "bn" type: "BatchNorm" param { lr_mult: 0 } param { lr_mult: 1 }')
    with pytest.raises(LayerError, match=r"'bn'.*Cannot configure batch normalization "
                                         r"statistics.*param 1 has lr_mult 1"):
        forward(layer, rand_blob((2, 3)))
    ok = make_layer('type: "BatchNorm" param { lr_mult: 0 decay_mult: 0 } param { lr_mult: 0 }')
    forward(ok, rand_blob((2, 3)))
    assert len(ok.layer_param.param) == 3 and ok.layer_param.param[0].decay_mult == 0


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 5), (3, 2, 7)])
def test_batchnorm_train_matches_torch(shape):
    torch = pytest.importorskip("torch")
    layer = make_layer('type: "BatchNorm" batch_norm_param { eps: 0.001 }')
    x = rand_blob(shape, scale=2.0, shift=0.5)
    top = forward(layer, x)
    tx = torch.tensor(x.data, requires_grad=True)
    ty = torch.nn.functional.batch_norm(tx, None, None, training=True,
                                        eps=float(np.float32(0.001)))
    np.testing.assert_allclose(top.data, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    dy = np.random.RandomState(3).randn(*shape)
    top.diff[...] = dy
    layer.backward([top], [True], [x])
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(x.diff, tx.grad.numpy(), rtol=1e-9, atol=1e-10)


def test_batchnorm_running_statistics_and_eval_match_torch():
    torch = pytest.importorskip("torch")
    layer = make_layer('type: "BatchNorm" batch_norm_param { moving_average_fraction: 0.9 }')
    batches = [rand_blob((4, 3, 2, 2), seed=s, scale=1 + s, shift=s) for s in range(3)]
    top = Blob(dtype=np.float64)
    layer.setup([batches[0]], [top])
    maf = float(np.float32(0.9))
    s, msum, vsum = 0.0, np.zeros(3), np.zeros(3)
    for x in batches:
        layer.forward([x], [top])
        d = x.data.transpose(1, 0, 2, 3).reshape(3, -1)
        m = d.shape[1]
        s = maf * s + 1
        msum = d.mean(1) + maf * msum
        vsum = d.var(1) * m / (m - 1) + maf * vsum
    np.testing.assert_allclose(layer.blobs[2].data, [s], rtol=1e-12)
    np.testing.assert_allclose(layer.blobs[0].data, msum, rtol=1e-10)
    np.testing.assert_allclose(layer.blobs[1].data, vsum, rtol=1e-10)
    # TEST phase with the stored statistics = torch eval with mean/var = sums / s
    test_layer = make_layer('type: "BatchNorm"', phase=TEST)
    test_layer.blobs = layer.blobs
    x = rand_blob((2, 3, 2, 2), seed=9)
    y = forward(test_layer, x)
    ty = torch.nn.functional.batch_norm(torch.tensor(x.data), torch.tensor(msum / s),
                                        torch.tensor(vsum / s), training=False,
                                        eps=float(np.float32(1e-5)))
    np.testing.assert_allclose(y.data, ty.numpy(), rtol=1e-10, atol=1e-10)
    # global stats leave the blobs alone, and a zero scale factor means zero stats
    np.testing.assert_allclose(layer.blobs[0].data, msum, rtol=1e-10)
    fresh = make_layer('type: "BatchNorm"', phase=TEST)
    y = forward(fresh, x)
    np.testing.assert_allclose(y.data, x.data / np.sqrt(np.float32(1e-5)), rtol=1e-6)


@pytest.mark.parametrize("phase,shape", [(TRAIN, (3, 2, 3, 2)), (TEST, (3, 2, 3, 2)),
                                         (TRAIN, (4, 3))])
def test_batchnorm_gradient(phase, shape):
    layer = make_layer('type: "BatchNorm"', phase=phase)
    x = rand_blob(shape)
    if phase == TEST:  # give it some statistics
        layer.setup([x], [Blob(dtype=np.float64)])
        layer.blobs[0].data[...] = [0.2, -0.3]
        layer.blobs[1].data[...] = [1.5, 0.7]
        layer.blobs[2].data[...] = 1.2
    # the statistics are not parameters: check the bottom only
    check_gradient(layer, [x], [Blob(dtype=np.float64)], check_params=False,
                   setup=phase == TRAIN)


def test_batchnorm_in_place_backward():
    x = rand_blob((4, 2, 3, 3))
    ref = make_layer('type: "BatchNorm"')
    x2 = make_blob(x.shape, values=x.data)
    top = forward(ref, x2)
    dy = np.random.RandomState(1).randn(*x.shape)
    top.diff[...] = dy
    ref.backward([top], [True], [x2])
    layer = make_layer('type: "BatchNorm"')
    layer.setup([x], [x])
    layer.forward([x], [x])
    np.testing.assert_allclose(x.data, top.data, rtol=1e-12)
    x.data[...] = 123.0  # a later in-place layer clobbers the top: backward must not care
    x.diff[...] = dy
    layer.backward([x], [True], [x])
    np.testing.assert_allclose(x.diff, x2.diff, rtol=1e-10, atol=1e-12)


BN_NET = """
name: "bn"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 3 dim: 4 dim: 4 } shape { dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _bn_net():
    p = caffe_pb2.NetParameter()
    from google.protobuf import text_format
    text_format.Merge(BN_NET, p)
    return Net(p, caffe_pb2.TRAIN)


def test_net_masks_batchnorm_statistics_from_learning():
    net = _bn_net()
    bn = net.layers[list(net.layer_names).index("bn")]
    assert bn.param_propagate_down == [False, False, False]
    ids = [net.params_.index(b) for b in bn.blobs]
    lids = [net.learnable_param_ids[i] for i in ids]
    assert [net.params_lr[i] for i in lids] == [0.0, 0.0, 0.0]
    rng = np.random.RandomState(0)
    net.blobs["data"].data[...] = rng.randn(*net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.randint(0, 3, 8)
    for b in net.learnable_params:
        b.diff[...] = 0
    net.forward_backward()
    for b in bn.blobs:
        assert np.all(b.diff == 0)
    assert np.any(net.params["conv"][0].diff != 0)  # back-propagation goes through BN


def test_solver_never_changes_batchnorm_statistics():
    solvers = pytest.importorskip("minicaffe.solvers")
    if not hasattr(solvers, "SGDSolver"):
        pytest.skip("minicaffe.solvers has no SGDSolver yet")
    from google.protobuf import text_format
    sp = caffe_pb2.SolverParameter()
    text_format.Merge('base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.1 '
                      'max_iter: 3 display: 0 snapshot_after_train: false', sp)
    text_format.Merge(BN_NET, sp.net_param)
    try:
        solver = solvers.SGDSolver(sp)
    except TypeError:
        pytest.skip("SGDSolver does not take a SolverParameter")
    net = solver.net
    bn = net.layers[list(net.layer_names).index("bn")]
    rng = np.random.RandomState(0)
    for it in range(3):
        net.blobs["data"].data[...] = rng.randn(*net.blobs["data"].shape)
        net.blobs["label"].data[...] = rng.randint(0, 3, 8)
        before = [b.data.copy() for b in bn.blobs]
        net.forward()  # the running sums as this forward leaves them
        after_forward = [b.data.copy() for b in bn.blobs]
        for b, a in zip(bn.blobs, before):
            b.data[...] = a
        solver.step(1)
        for b, a in zip(bn.blobs, after_forward):
            np.testing.assert_allclose(b.data, a, rtol=1e-6)


# ---------------------------------------------------------------------------
# MVN
# ---------------------------------------------------------------------------
def naive_mvn(x, normalize_variance, across_channels, eps):
    N = x.shape[0]
    C = x.shape[1] if x.ndim > 1 else 1
    y = np.empty_like(x)
    for n in range(N):
        groups = [slice(None)] if across_channels else [c for c in range(C)]
        for g in groups:
            v = x[n] if across_channels else x[n, g]
            out = v - v.mean()
            if normalize_variance:
                out = out / (np.sqrt((out ** 2).mean()) + eps)
            if across_channels:
                y[n] = out
            else:
                y[n, g] = out
    return y


@pytest.mark.parametrize("nv,ac", [(True, False), (True, True), (False, False), (False, True)])
def test_mvn_forward_matches_naive_loop(nv, ac):
    layer = make_layer(f'type: "MVN" mvn_param {{ normalize_variance: {str(nv).lower()} '
                       f'across_channels: {str(ac).lower()} eps: 0.01 }}')
    x = rand_blob((2, 3, 4, 5), scale=3, shift=1)
    top = forward(layer, x)
    ref = naive_mvn(x.data, nv, ac, float(np.float32(0.01)))
    np.testing.assert_allclose(top.data, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nv,ac,shape", [(True, False, (2, 3, 3, 2)), (True, True, (2, 2, 3, 2)),
                                         (False, False, (2, 3, 2, 2)), (False, True, (3, 4))])
def test_mvn_gradient(nv, ac, shape):
    layer = make_layer(f'type: "MVN" mvn_param {{ normalize_variance: {str(nv).lower()} '
                       f'across_channels: {str(ac).lower()} }}')
    check_gradient(layer, [rand_blob(shape)], [Blob(dtype=np.float64)])


# ---------------------------------------------------------------------------
# propagate_down
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", ['type: "BatchNorm"', 'type: "MVN"',
                                  'type: "MVN" mvn_param { normalize_variance: false }'])
def test_propagate_down_false_leaves_bottom_diff(text):
    layer = make_layer(text)
    x = rand_blob((2, 3, 4, 4))
    top = forward(layer, x)
    top.diff[...] = 1.0
    x.diff[...] = 7.0
    layer.backward([top], [False], [x])
    assert np.all(x.diff == 7.0)


def test_batchnorm_channel_change_is_an_error():
    layer = make_layer('name: "bn" type: "BatchNorm"')
    top = forward(layer, rand_blob((2, 3, 4)))
    with pytest.raises(LayerError, match=r"'bn'.*bottom has 4 channels.*set up for 3"):
        layer.forward([rand_blob((2, 4, 4))], [top])


# ---------------------------------------------------------------------------
# CPU / GPU parity
# ---------------------------------------------------------------------------
def _run(text, gpu, phase, x_values, stats=None):
    if gpu:
        context.set_mode_gpu()
    else:
        context.set_mode_cpu()
    layer = make_layer(text, phase=phase)
    x = make_blob(x_values.shape, dtype=np.float32, values=x_values)
    top = Blob(dtype=np.float32)
    layer.setup([x], [top])
    if stats is not None:
        for b, v in zip(layer.blobs, stats):
            b.data[...] = v
    layer.forward([x], [top])
    top.diff[...] = np.random.RandomState(2).randn(*top.shape)
    layer.backward([top], [True], [x])
    out = [top.data.copy(), x.diff.copy()] + [b.data.copy() for b in layer.blobs]
    context.set_mode_cpu()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("text,phase", [
    ('type: "BatchNorm"', TRAIN), ('type: "BatchNorm"', TEST),
    ('type: "MVN"', TRAIN), ('type: "MVN" mvn_param { across_channels: true }', TRAIN),
    ('type: "MVN" mvn_param { normalize_variance: false }', TRAIN),
])
def test_cpu_gpu_parity(text, phase):
    x = np.random.RandomState(0).randn(8, 6, 5, 7).astype(np.float32) * 2 + 1
    stats = None
    if "BatchNorm" in text and phase == TEST:
        stats = [np.linspace(-1, 1, 6), np.linspace(0.5, 2, 6), [1.5]]
    cpu = _run(text, False, phase, x, stats)
    gpu = _run(text, True, phase, x, stats)
    for a, b in zip(cpu, gpu):
        scale = max(np.abs(a).max(), 1e-30)
        assert np.abs(a - b).max() <= 1e-5 * scale + 1e-7
