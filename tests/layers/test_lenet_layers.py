"""Gradient and reference checks for the layers LeNet needs (the full layer set
is tested family by family in the other files here)."""
import numpy as np
import pytest

from minicaffe.core.blob import Blob
from minicaffe.compat.testing import make_layer, make_blob, check_gradient


def naive_conv(x, w, b, stride, pad):
    N, C, H, W = x.shape
    O, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    OH = (H + 2 * pad - kh) // stride + 1
    OW = (W + 2 * pad - kw) // stride + 1
    y = np.zeros((N, O, OH, OW))
    for n in range(N):
        for o in range(O):
            for i in range(OH):
                for j in range(OW):
                    patch = xp[n, :, i * stride:i * stride + kh, j * stride:j * stride + kw]
                    y[n, o, i, j] = (patch * w[o]).sum() + b[o]
    return y


def test_convolution_forward_matches_naive_loop():
    layer = make_layer('type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 '
                       'stride: 2 pad: 1 weight_filler { type: "gaussian" std: 0.5 } '
                       'bias_filler { type: "gaussian" std: 0.5 } }')
    x = make_blob((2, 2, 7, 6))
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    assert top.shape == (2, 3, 4, 3)
    layer.forward([x], [top])
    ref = naive_conv(x.data, layer.blobs[0].data, layer.blobs[1].data, 2, 1)
    np.testing.assert_allclose(top.data, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("text", [
    'type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 group: 2 '
    'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }',
    'type: "InnerProduct" inner_product_param { num_output: 3 weight_filler { type: "gaussian" } '
    'bias_filler { type: "gaussian" } }',
    'type: "InnerProduct" inner_product_param { num_output: 3 transpose: true '
    'weight_filler { type: "gaussian" } }',
    'type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }',
    'type: "Softmax"',
])
def test_gradients(text):
    layer = make_layer(text)
    x = make_blob((2, 4, 5, 5))
    n = check_gradient(layer, [x], [Blob(dtype=np.float64)])
    assert n > 0


def test_max_pooling_gradient():
    layer = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }')
    # distinct values so the argmax is stable under the finite-difference step
    x = make_blob((1, 2, 4, 4), values=np.random.RandomState(0).permutation(32).reshape(1, 2, 4, 4))
    check_gradient(layer, [x], [Blob(dtype=np.float64)])


def test_relu_gradient_skips_kink():
    layer = make_layer('type: "ReLU" relu_param { negative_slope: 0.1 }')
    x = make_blob((2, 3, 4))
    check_gradient(layer, [x], [Blob(dtype=np.float64)], kink=0.0, kink_range=0.02)


def test_softmax_with_loss_gradient_and_value():
    layer = make_layer('type: "SoftmaxWithLoss"')
    x = make_blob((4, 5, 2, 3))
    label = make_blob((4, 1, 2, 3), values=np.random.RandomState(1).randint(0, 5, (4, 1, 2, 3)))
    top = Blob(dtype=np.float64)
    check_gradient(layer, [x, label], [top], check_bottom=[0])
    layer.forward([x, label], [top])
    z = x.data - x.data.max(1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    idx = label.data.astype(int)
    picked = np.take_along_axis(p, idx, axis=1)
    assert float(top.data) == pytest.approx(-np.log(picked).sum() / picked.size)


def test_softmax_with_loss_ignore_label_normalizes_by_valid():
    layer = make_layer('type: "SoftmaxWithLoss" loss_param { ignore_label: 2 }')
    x = make_blob((6, 3))
    label = make_blob((6,), values=[0, 1, 2, 2, 1, 0])
    top = Blob(dtype=np.float64)
    layer.setup([x, label], [top])
    layer.forward([x, label], [top])
    z = x.data - x.data.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    keep = [0, 1, 4, 5]
    ref = -np.mean([logp[i, int(label.data[i])] for i in keep])
    assert float(top.data) == pytest.approx(ref)
    check_gradient(make_layer('type: "SoftmaxWithLoss" loss_param { ignore_label: 2 }'),
                   [x, label], [Blob(dtype=np.float64)], check_bottom=[0])


def test_accuracy_top_k_counts_ties_against():
    layer = make_layer('type: "Accuracy" accuracy_param { top_k: 2 }')
    x = make_blob((3, 4), values=[[0.1, 0.5, 0.5, 0.2], [0.9, 0.1, 0.0, 0.0], [0.3, 0.3, 0.3, 0.1]])
    label = make_blob((3,), values=[3, 0, 0])
    top, per_class = Blob(), Blob()
    layer = make_layer('type: "Accuracy" accuracy_param { top_k: 2 }')
    layer.setup([x, label], [top, per_class])
    layer.forward([x, label], [top, per_class])
    # row0: label 3 (0.2) has 2 better -> wrong; row1 right; row2: 2 ties >= -> wrong
    assert float(top.data) == pytest.approx(1 / 3)
    assert per_class.data[0] == pytest.approx(0.5)
    assert per_class.data[3] == 0


def test_split_sums_diffs_and_shares_data():
    layer = make_layer('type: "Split"')
    x = make_blob((2, 3))
    tops = [Blob(dtype=np.float64), Blob(dtype=np.float64)]
    layer.setup([x], tops)
    layer.forward([x], tops)
    np.testing.assert_array_equal(tops[1].data, x.data)
    check_gradient(make_layer('type: "Split"'), [x], [Blob(dtype=np.float64), Blob(dtype=np.float64)])


def test_propagate_down_false_leaves_bottom_diff():
    layer = make_layer('type: "InnerProduct" inner_product_param { num_output: 2 '
                       'weight_filler { type: "gaussian" } }')
    x = make_blob((3, 4))
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    layer.forward([x], [top])
    x.diff[...] = 7.0
    top.diff[...] = 1.0
    layer.backward([top], [False], [x])
    assert (x.diff == 7.0).all()


def test_param_diffs_accumulate():
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 2 '
                       'weight_filler { type: "gaussian" } }')
    x = make_blob((2, 1, 3, 3))
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    layer.forward([x], [top])
    top.diff[...] = np.random.RandomState(3).randn(*top.shape)
    layer.backward([top], [True], [x])
    once = layer.blobs[0].diff.copy()
    layer.backward([top], [True], [x])
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * once)
