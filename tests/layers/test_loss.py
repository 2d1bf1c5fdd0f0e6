"""Loss layers and Accuracy: shapes, forward against naive loops, float64 gradient
checks, propagate_down, loss_weight scaling, bad input, GPU parity."""
import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.blob import Blob
from minicaffe.core.errors import LayerError
from minicaffe.proto import caffe_pb2
from minicaffe.core.protoio import write_binary
from minicaffe.compat.testing import check_gradient, make_blob, make_layer

FLT_MIN = float(np.finfo(np.float32).tiny)


def rs(seed=0):
    return np.random.RandomState(seed)


def blob(values, dtype=np.float64):
    values = np.asarray(values)
    return make_blob(values.shape, dtype=dtype, values=values)


def run(text, bottoms, ntop=1):
    layer = make_layer(text)
    top = [Blob(dtype=bottoms[0].dtype) for _ in range(ntop)]
    layer.setup(bottoms, top)
    loss = layer.forward(bottoms, top)
    return layer, top, loss


# -- naive references ---------------------------------------------------------------

def softmax_np(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def ref_softmax_loss(x, label, axis=1, ignore=None, mode="VALID"):
    p = softmax_np(x, axis)
    pm = np.moveaxis(p, axis, -1).reshape(-1, x.shape[axis])
    lab = label.reshape(-1).astype(int)
    loss, count = 0.0, 0
    for k in range(lab.size):
        if ignore is not None and lab[k] == ignore:
            continue
        loss -= np.log(max(pm[k, lab[k]], FLT_MIN))
        count += 1
    outer = int(np.prod(x.shape[:axis]))
    inner = int(np.prod(x.shape[axis + 1:]))
    n = {"FULL": outer * inner, "VALID": count, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return loss / max(1, n)


def ref_sigmoid_ce(x, t, ignore=None, mode="BATCH_SIZE"):
    loss, count = 0.0, 0
    for xi, ti in zip(x.ravel(), t.ravel()):
        if ignore is not None and int(ti) == ignore:
            continue
        s = 1 / (1 + np.exp(-xi))
        loss -= ti * np.log(s) + (1 - ti) * np.log(1 - s)
        count += 1
    n = {"FULL": x.size, "VALID": count, "BATCH_SIZE": x.shape[0], "NONE": 1}[mode]
    return loss / max(1, n)


def ref_hinge(x, label, norm):
    N = x.shape[0]
    x = x.reshape(N, -1)
    loss = 0.0
    for n in range(N):
        for j in range(x.shape[1]):
            t = -1 if j == int(label[n]) else 1
            m = max(0.0, 1 + t * x[n, j])
            loss += m if norm == "L1" else m * m
    return loss / N


def ref_infogain(x, label, H, axis=1, ignore=None):
    p = softmax_np(x, axis)
    pm = np.moveaxis(p, axis, -1).reshape(-1, x.shape[axis])
    lab = label.reshape(-1).astype(int)
    loss, count = 0.0, 0
    for k in range(lab.size):
        if ignore is not None and lab[k] == ignore:
            continue
        for l in range(x.shape[axis]):
            loss -= H[lab[k], l] * np.log(max(pm[k, l], 1e-20))
        count += 1
    return loss / max(1, count)


def ref_contrastive(a, b, y, margin, legacy):
    loss = 0.0
    for n in range(a.shape[0]):
        d2 = ((a[n] - b[n]) ** 2).sum()
        if int(y[n]):
            loss += d2
        elif legacy:
            loss += max(margin - d2, 0)
        else:
            loss += max(margin - np.sqrt(d2), 0) ** 2
    return loss / a.shape[0] / 2


def ref_accuracy(x, label, top_k=1, axis=1, ignore=None):
    C = x.shape[axis]
    xm = np.moveaxis(x, axis, -1).reshape(-1, C)
    lab = label.reshape(-1).astype(int)
    ok, count = 0, 0
    per_ok, per_n = np.zeros(C), np.zeros(C)
    for k in range(lab.size):
        if ignore is not None and lab[k] == ignore:
            continue
        rank = sum(xm[k, c] >= xm[k, lab[k]] for c in range(C)) - 1
        per_n[lab[k]] += 1
        if rank < top_k:
            ok += 1
            per_ok[lab[k]] += 1
        count += 1
    per = np.where(per_n > 0, per_ok / np.maximum(per_n, 1), 0)
    return ok / count if count else 0.0, per


# -- cases shared by the generic tests ----------------------------------------------

def softmax_case():
    x = blob(rs(1).randn(4, 5, 2, 3))
    lab = blob(rs(2).randint(0, 5, (4, 1, 2, 3)))
    return [x, lab], [0]


def sigmoid_case():
    x = blob(rs(1).randn(4, 6) * 3)
    t = blob(rs(2).uniform(0, 1, (4, 6)))
    return [x, t], [0]


def euclid_case():
    return [blob(rs(1).randn(4, 5)), blob(rs(2).randn(4, 5, 1, 1))], [0, 1]


def hinge_case():
    x = rs(1).uniform(-2, 2, (4, 6))
    # keep clear of the kinks at x = +-1 (finite differences would straddle them)
    x = np.where(np.abs(np.abs(x) - 1) < 0.05, x + 0.2, x)
    return [blob(x), blob(rs(2).randint(0, 6, (4,)))], [0]


def infogain_case():
    x = blob(rs(1).randn(4, 5, 2))
    lab = blob(rs(2).randint(0, 5, (4, 2)))
    H = blob(rs(3).uniform(0, 1, (5, 5)))
    return [x, lab, H], [0]


def mlogistic_case():
    p = blob(rs(1).uniform(0.1, 1, (4, 5, 1, 1)))
    return [p, blob(rs(2).randint(0, 5, (4, 1, 1, 1)))], [0]


def contrastive_case():
    a = blob(rs(1).uniform(-0.5, 0.5, (6, 3)))
    b = blob(rs(2).uniform(-0.5, 0.5, (6, 3, 1, 1)))
    y = blob(np.array([1, 0, 1, 0, 0, 1]))
    return [a, b, y], [0, 1]


CASES = {
    "SoftmaxWithLoss": ('type: "SoftmaxWithLoss"', softmax_case),
    "SigmoidCrossEntropyLoss": ('type: "SigmoidCrossEntropyLoss"', sigmoid_case),
    "EuclideanLoss": ('type: "EuclideanLoss"', euclid_case),
    "HingeLossL1": ('type: "HingeLoss"', hinge_case),
    "HingeLossL2": ('type: "HingeLoss" hinge_loss_param { norm: L2 }', hinge_case),
    "InfogainLoss": ('type: "InfogainLoss"', infogain_case),
    "MultinomialLogisticLoss": ('type: "MultinomialLogisticLoss"', mlogistic_case),
    "ContrastiveLoss": ('type: "ContrastiveLoss" contrastive_loss_param { margin: 1.0 }',
                        contrastive_case),
    "ContrastiveLossLegacy": ('type: "ContrastiveLoss" contrastive_loss_param { margin: 0.5 '
                              'legacy_version: true }', contrastive_case),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scalar_top_and_gradient(name):
    text, case = CASES[name]
    bottoms, check = case()
    layer = make_layer(text)
    top = Blob(dtype=np.float64)
    layer.setup(bottoms, [top])
    assert top.shape == ()
    assert layer.loss(0) == 1.0
    n = check_gradient(layer, bottoms, [top], check_bottom=check, setup=False)
    assert n == sum(bottoms[i].count() for i in check)


@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_weight_doubles_loss_and_gradients(name):
    text, case = CASES[name]
    results = []
    for w in (1, 2):
        bottoms, check = case()
        layer, top, loss = run(text + f" loss_weight: {w}", bottoms)
        assert loss == pytest.approx(w * float(top[0].data))
        layer.backward(top, [i in check for i in range(len(bottoms))], bottoms)
        results.append((loss, [bottoms[i].diff.copy() for i in check]))
    assert results[1][0] == pytest.approx(2 * results[0][0], rel=1e-12)
    for g1, g2 in zip(results[0][1], results[1][1]):
        assert np.abs(g1).max() > 0
        np.testing.assert_allclose(g2, 2 * g1, rtol=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_propagate_down_false_leaves_bottoms(name):
    text, case = CASES[name]
    bottoms, _ = case()
    layer, top, _ = run(text, bottoms)
    for b in bottoms:
        b.diff[...] = 7.0
    layer.backward(top, [False] * len(bottoms), bottoms)
    for b in bottoms:
        assert (b.diff == 7.0).all()


def test_label_backprop_refused():
    bottoms, _ = softmax_case()
    layer, top, _ = run('type: "SoftmaxWithLoss"', bottoms)
    with pytest.raises(LayerError, match="cannot backpropagate to label"):
        layer.backward(top, [True, True], bottoms)


# -- SoftmaxWithLoss ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("ignore", [None, 3])
def test_softmax_loss_normalization_and_ignore(mode, ignore):
    (x, lab), _ = softmax_case()
    text = f'type: "SoftmaxWithLoss" loss_param {{ normalization: {mode} '
    text += (f"ignore_label: {ignore} }}" if ignore is not None else "}")
    layer, top, loss = run(text, [x, lab])
    ref = ref_softmax_loss(x.data, lab.data, ignore=ignore, mode=mode)
    assert float(top[0].data) == pytest.approx(ref, rel=1e-12)
    check_gradient(layer, [x, lab], top, check_bottom=[0], setup=False)
    if ignore is not None:
        layer.backward(top, [True, False], [x, lab])
        ign = np.broadcast_to(lab.data == ignore, x.shape)   # (4,1,2,3) against (4,5,2,3)
        assert (x.diff[ign] == 0).all() and np.abs(x.diff[~ign]).max() > 0


@pytest.mark.parametrize("normalize,mode", [(True, "VALID"), (False, "BATCH_SIZE")])
def test_softmax_loss_legacy_normalize(normalize, mode):
    (x, lab), _ = softmax_case()
    _, top, _ = run(f'type: "SoftmaxWithLoss" loss_param {{ normalize: {str(normalize).lower()} '
                    f'ignore_label: 0 }}', [x, lab])
    assert float(top[0].data) == pytest.approx(
        ref_softmax_loss(x.data, lab.data, ignore=0, mode=mode), rel=1e-12)


def test_softmax_loss_axis_and_prob_top():
    x = blob(rs(4).randn(3, 2, 6))
    lab = blob(rs(5).randint(0, 6, (3, 2)))
    layer, top, _ = run('type: "SoftmaxWithLoss" softmax_param { axis: -1 } '
                        'loss_weight: 1 loss_weight: 0', [x, lab], ntop=2)
    assert top[1].shape == (3, 2, 6)
    np.testing.assert_allclose(top[1].data, softmax_np(x.data, 2), rtol=1e-12)
    assert float(top[0].data) == pytest.approx(ref_softmax_loss(x.data, lab.data, axis=2))
    check_gradient(layer, [x, lab], top, check_bottom=[0], setup=False, top_ids=[0])


def test_softmax_loss_flt_min_clamp():
    x = blob(np.array([[0.0, 200.0]]))
    lab = blob(np.array([0]))
    _, top, _ = run('type: "SoftmaxWithLoss"', [x, lab])
    assert float(top[0].data) == pytest.approx(-np.log(FLT_MIN))


def test_softmax_loss_against_torch():
    torch = pytest.importorskip("torch")
    (x, lab), _ = softmax_case()
    _, top, _ = run('type: "SoftmaxWithLoss" loss_param { ignore_label: 2 }', [x, lab])
    ref = torch.nn.functional.cross_entropy(torch.tensor(x.data), torch.tensor(
        lab.data[:, 0].astype(np.int64)), ignore_index=2)
    assert float(top[0].data) == pytest.approx(float(ref), rel=1e-10)


# -- SigmoidCrossEntropyLoss ---------------------------------------------------------------

@pytest.mark.parametrize("mode", [None, "FULL", "VALID", "BATCH_SIZE", "NONE"])
def test_sigmoid_ce_forward_and_ignore(mode):
    (x, t), _ = sigmoid_case()
    t.data[0, :3] = -1
    text = 'type: "SigmoidCrossEntropyLoss" loss_param { ignore_label: -1 '
    text += (f"normalization: {mode} }}" if mode else "}")
    layer, top, _ = run(text, [x, t])
    ref = ref_sigmoid_ce(x.data, t.data, ignore=-1, mode=mode or "BATCH_SIZE")
    assert float(top[0].data) == pytest.approx(ref, rel=1e-10)
    check_gradient(layer, [x, t], top, check_bottom=[0], setup=False)
    layer.backward(top, [True, False], [x, t])
    assert (x.diff[0, :3] == 0).all()


def test_sigmoid_ce_is_stable_for_large_inputs():
    x = blob(np.array([[800.0, -800.0, 0.0]]))
    t = blob(np.array([[0.0, 1.0, 0.5]]))
    layer, top, _ = run('type: "SigmoidCrossEntropyLoss"', [x, t])
    assert float(top[0].data) == pytest.approx(1600 + np.log(2))
    layer.backward(top, [True, False], [x, t])
    np.testing.assert_allclose(x.diff, [[1.0, -1.0, 0.0]])


def test_sigmoid_ce_against_torch():
    torch = pytest.importorskip("torch")
    (x, t), _ = sigmoid_case()
    _, top, _ = run('type: "SigmoidCrossEntropyLoss" loss_param { normalization: FULL }', [x, t])
    ref = torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor(x.data),
                                                               torch.tensor(t.data))
    assert float(top[0].data) == pytest.approx(float(ref), rel=1e-10)


# -- EuclideanLoss, HingeLoss, MultinomialLogisticLoss ---------------------------------

def test_euclidean_forward():
    (a, b), _ = euclid_case()
    _, top, _ = run('type: "EuclideanLoss"', [a, b])
    ref = sum(((a.data[n] - b.data[n].ravel()) ** 2).sum() for n in range(4)) / 4 / 2
    assert float(top[0].data) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_forward(norm):
    (x, lab), _ = hinge_case()
    _, top, _ = run(f'type: "HingeLoss" hinge_loss_param {{ norm: {norm} }}', [x, lab])
    assert float(top[0].data) == pytest.approx(ref_hinge(x.data, lab.data, norm), rel=1e-12)


def test_multinomial_logistic_forward():
    (p, lab), _ = mlogistic_case()
    _, top, _ = run('type: "MultinomialLogisticLoss"', [p, lab])
    ref = -sum(np.log(max(p.data[n, int(lab.data[n, 0, 0, 0]), 0, 0], 1e-20))
               for n in range(4)) / 4
    assert float(top[0].data) == pytest.approx(ref, rel=1e-12)


# -- InfogainLoss ------------------------------------------------------------------------------

def test_infogain_forward_matrix_bottom():
    (x, lab, H), _ = infogain_case()
    layer, top, _ = run('type: "InfogainLoss" loss_weight: 1 loss_weight: 0', [x, lab, H], ntop=2)
    assert float(top[0].data) == pytest.approx(ref_infogain(x.data, lab.data, H.data), rel=1e-12)
    np.testing.assert_allclose(top[1].data, softmax_np(x.data, 1), rtol=1e-12)


def test_infogain_identity_is_softmax_loss():
    (x, lab, _), _ = infogain_case()
    H = blob(np.eye(5))
    _, top, _ = run('type: "InfogainLoss"', [x, lab, H])
    assert float(top[0].data) == pytest.approx(ref_softmax_loss(x.data, lab.data), rel=1e-12)


def test_infogain_source_file_axis_and_ignore(tmp_path):
    x = blob(rs(6).randn(2, 3, 4))                     # classes on axis 2
    lab = blob(rs(7).randint(0, 4, (2, 3)))
    lab.data[0, 0] = 9
    H = rs(8).uniform(0, 2, (4, 4))
    path = tmp_path / "H.binaryproto"
    b = Blob((1, 1, 4, 4), np.float32)
    b.data[...] = H.reshape(1, 1, 4, 4)
    write_binary(str(path), b.to_proto())
    text = (f'type: "InfogainLoss" infogain_loss_param {{ source: "{path}" axis: 2 }} '
            f'loss_param {{ ignore_label: 9 }}')
    layer, top, _ = run(text, [x, lab])
    ref = ref_infogain(x.data, lab.data, H.astype(np.float32).astype(np.float64), axis=2,
                       ignore=9)
    assert float(top[0].data) == pytest.approx(ref, rel=1e-7)
    check_gradient(layer, [x, lab], top, check_bottom=[0], setup=False)


def test_infogain_errors(tmp_path):
    (x, lab, H), _ = infogain_case()
    with pytest.raises(LayerError, match="infogain matrix source must be specified"):
        run('type: "InfogainLoss"', [x, lab])
    with pytest.raises(LayerError, match="cannot read the infogain matrix"):
        run(f'type: "InfogainLoss" infogain_loss_param {{ source: "{tmp_path}/none" }}', [x, lab])
    with pytest.raises(LayerError, match="must be 5x5"):
        run('type: "InfogainLoss"', [x, lab, blob(np.ones((4, 4)))])
    with pytest.raises(LayerError, match="normalize is deprecated"):
        run('type: "InfogainLoss" loss_param { normalize: true }', [x, lab, H])


# -- ContrastiveLoss ---------------------------------------------------------------------------

@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_forward(legacy):
    (a, b, y), _ = contrastive_case()
    margin = 0.5 if legacy else 1.0
    _, top, _ = run(f'type: "ContrastiveLoss" contrastive_loss_param {{ margin: {margin} '
                    f'legacy_version: {str(legacy).lower()} }}', [a, b, y])
    ref = ref_contrastive(a.data, b.data.reshape(6, 3), y.data, margin, legacy)
    assert float(top[0].data) == pytest.approx(ref, rel=1e-12)


# -- Accuracy --------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_k,ignore", [(1, None), (2, None), (3, 1)])
def test_accuracy_matches_naive(top_k, ignore):
    x = blob(rs(9).randn(20, 6))
    lab = blob(rs(10).randint(0, 6, (20,)))
    text = f'type: "Accuracy" accuracy_param {{ top_k: {top_k} '
    text += f"ignore_label: {ignore} }}" if ignore is not None else "}"
    _, top, loss = run(text, [x, lab], ntop=2)
    acc, per = ref_accuracy(x.data, lab.data, top_k, ignore=ignore)
    assert loss == 0.0
    assert top[0].shape == () and top[1].shape == (6,)
    assert float(top[0].data) == pytest.approx(acc)
    np.testing.assert_allclose(top[1].data, per)


def test_accuracy_axis_and_ties():
    x = blob(rs(11).randn(2, 3, 4))          # classes on axis 2
    lab = blob(rs(12).randint(0, 4, (2, 3)))
    _, top, _ = run('type: "Accuracy" accuracy_param { axis: 2 }', [x, lab])
    assert float(top[0].data) == pytest.approx(ref_accuracy(x.data, lab.data, axis=2)[0])
    # a tie with the true class counts against it (Caffe's >= rule)
    x2 = blob(np.array([[1.0, 1.0, 0.0]]))
    _, top, _ = run('type: "Accuracy"', [x2, blob(np.array([0]))])
    assert float(top[0].data) == 0.0


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,bottoms,match", [
    ('type: "SoftmaxWithLoss"', lambda: [blob(np.zeros((4, 5))), blob(np.zeros((3,)))],
     "first dimension"),
    ('type: "SoftmaxWithLoss"', lambda: [blob(np.zeros((4, 5, 2))), blob(np.zeros((4,)))],
     "number of labels must match"),
    ('type: "SoftmaxWithLoss"', lambda: [blob(np.zeros((2, 5))), blob(np.array([1, 5]))],
     r"label 5 is out of range \[0, 5\)"),
    ('type: "SoftmaxWithLoss" loss_param { ignore_label: 7 }',
     lambda: [blob(np.zeros((2, 5))), blob(np.array([7, -1]))], "label -1 is out of range"),
    ('type: "SigmoidCrossEntropyLoss"', lambda: [blob(np.zeros((2, 5))), blob(np.zeros((2, 4)))],
     "same count"),
    ('type: "EuclideanLoss"', lambda: [blob(np.zeros((2, 5))), blob(np.zeros((2, 4)))],
     "same dimension"),
    ('type: "HingeLoss"', lambda: [blob(np.zeros((2, 5))), blob(np.array([0, 6]))],
     "out of range"),
    ('type: "HingeLoss"', lambda: [blob(np.zeros((2, 5))), blob(np.zeros((2, 2)))],
     "one label per item"),
    ('type: "MultinomialLogisticLoss"', lambda: [blob(np.ones((2, 5))), blob(np.array([0, -2]))],
     "out of range"),
    ('type: "ContrastiveLoss"', lambda: [blob(np.zeros((2, 3))), blob(np.zeros((2, 4))),
                                         blob(np.zeros(2))], "same shape"),
    ('type: "ContrastiveLoss"', lambda: [blob(np.zeros((2, 3))), blob(np.zeros((2, 3)))],
     "exactly 3 bottom"),
    ('type: "Accuracy" accuracy_param { top_k: 6 }',
     lambda: [blob(np.zeros((2, 5))), blob(np.zeros(2))], "top_k"),
    ('type: "Accuracy"', lambda: [blob(np.zeros((2, 5))), blob(np.array([0, 9]))],
     "label 9 is out of range"),
])
def test_bad_input_is_one_line_layer_error(text, bottoms, match):
    with pytest.raises(LayerError, match=match) as e:
        run(text, bottoms(), ntop=1)
    assert "\n" not in str(e.value) and str(e.value).startswith("layer '")


def test_softmax_loss_two_tops_need_two_loss_weights():
    (x, lab), _ = softmax_case()
    with pytest.raises(LayerError, match="loss_weight must be given once per top"):
        run('type: "SoftmaxWithLoss"', [x, lab], ntop=2)


# -- GPU parity ------------------------------------------------------------------------------------

def _forward_backward(text, bottoms_np, ntop, check, gpu):
    if gpu:
        context.set_mode_gpu()
    bottoms = [make_blob(v.shape, dtype=np.float32, values=v) for v in bottoms_np]
    layer = make_layer(text)
    top = [Blob(dtype=np.float32) for _ in range(ntop)]
    layer.setup(bottoms, top)
    loss = layer.forward(bottoms, top)
    layer.backward(top, [i in check for i in range(len(bottoms))], bottoms)
    out = [t.data.copy() for t in top] + [bottoms[i].diff.copy() for i in check]
    context.set_mode_cpu()
    return loss, out


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES) + ["Accuracy"])
def test_gpu_parity(name):
    if name == "Accuracy":
        text, (bottoms, check) = 'type: "Accuracy" accuracy_param { top_k: 2 }', softmax_case()
        check, ntop = [], 2
    else:
        text, case = CASES[name]
        (bottoms, check), ntop = case(), 1
        text += " loss_weight: 2"
    values = [b.data.astype(np.float32) for b in bottoms]
    loss_c, out_c = _forward_backward(text, values, ntop, check, gpu=False)
    loss_g, out_g = _forward_backward(text, values, ntop, check, gpu=True)
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    for c, g in zip(out_c, out_g):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("text,ntop", [
    ('type: "SoftmaxWithLoss" loss_param { ignore_label: 3 } loss_weight: 2', 1),
    ('type: "SoftmaxWithLoss" loss_param { ignore_label: 3 normalization: BATCH_SIZE } '
     'loss_weight: 1 loss_weight: 0', 2),
    ('type: "SoftmaxWithLoss" softmax_param { axis: 3 } loss_weight: 0.5', 1),
])
def test_gpu_parity_softmax_loss_fused_kernels(text, ntop):
    """The GPU body's fused kernels: ignored labels, normalization, the probability top,
    another softmax axis."""
    x = rs(5).randn(4, 5, 2, 3).astype(np.float32) * 3
    if "axis: 3" in text:
        lab = rs(6).randint(0, 3, (4, 5, 2, 1)).astype(np.float32)
    else:
        lab = rs(6).randint(0, 5, (4, 1, 2, 3)).astype(np.float32)
    loss_c, out_c = _forward_backward(text, [x, lab], ntop, [0], gpu=False)
    loss_g, out_g = _forward_backward(text, [x, lab], ntop, [0], gpu=True)
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    for c, g in zip(out_c, out_g):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("C,ignore", [(1000, False), (1000, True), (130, False)])
def test_gpu_parity_softmax_loss_wide_rows(C, ignore):
    """Rows of many classes (one block per row on the GPU): the loss, the probabilities
    and the gradient as the CPU's, an ignored label and a NaN row included."""
    x = rs(7).randn(6, C).astype(np.float32) * 4
    lab = rs(8).randint(0, C, 6).astype(np.float32)
    text = 'type: "SoftmaxWithLoss" loss_weight: 1 loss_weight: 0'
    if ignore:
        lab[2] = 5
        text = text.replace('"SoftmaxWithLoss"', '"SoftmaxWithLoss" loss_param { ignore_label: 5 }')
    loss_c, out_c = _forward_backward(text, [x, lab], 2, [0], gpu=False)
    loss_g, out_g = _forward_backward(text, [x, lab], 2, [0], gpu=True)
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    for c, g in zip(out_c, out_g):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-7)
    x[3, 17] = np.nan
    _, out_n = _forward_backward(text, [x, lab], 2, [0], gpu=True)
    assert np.isnan(out_n[1][3]).all() and np.isfinite(np.delete(out_n[1], 3, axis=0)).all()


@pytest.mark.gpu
def test_gpu_softmax_loss_label_out_of_range_is_one_line():
    with pytest.raises(LayerError, match="label 7 is out of range") as e:
        _forward_backward('type: "SoftmaxWithLoss"',
                          [np.zeros((2, 5), np.float32), np.array([1, 7], np.float32)],
                          1, [0], gpu=True)
    assert "\n" not in str(e.value)
