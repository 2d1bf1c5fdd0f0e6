"""Common layers (minicaffe/layers/common.py) against naive numpy references:
shapes, forward, float64 finite-difference gradients, propagate_down, parameter
accumulation, shared memory, bad parameters, a small Net, and CPU/GPU parity."""
import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.blob import Blob
from minicaffe.core.errors import LayerError
from minicaffe.network.net import Net
from minicaffe.proto import caffe_pb2
from minicaffe.compat.testing import make_layer, make_blob, check_gradient

G = 'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" }'


def U(*shape):
    return lambda rng: rng.uniform(-1, 1, shape)


def ints(high, *shape):
    return lambda rng: rng.randint(0, high, shape).astype(float)


def fixed(values):
    return lambda rng: np.asarray(values, dtype=float)


def distinct(n_bottoms, *shape):
    """n bottoms whose values are all distinct and at least 0.1 apart (MAX, ArgMax)."""
    def make(rng):
        size = int(np.prod(shape))
        v = rng.permutation(n_bottoms * size) / 10.0 - n_bottoms * size / 20.0
        return [v[i * size:(i + 1) * size].reshape(shape) for i in range(n_bottoms)]
    return make


def argmax_ref(x, top_k, out_max_val, axis=None):
    """Caffe's loop: sort (value, index) pairs descending, take the first top_k."""
    if axis is None:
        flat = x.reshape(x.shape[0], -1)
        out = np.zeros((x.shape[0], 2 if out_max_val else 1, top_k) + (1,) * max(0, x.ndim - 3))
        for i, row in enumerate(flat):
            best = sorted(((v, j) for j, v in enumerate(row)), reverse=True)[:top_k]
            out[i, 0, :] = np.array([j for _, j in best]).reshape((top_k,) + (1,) * max(0, x.ndim - 3))
            if out_max_val:
                out[i, 1, :] = np.array([v for v, _ in best]).reshape(out[i, 1].shape)
        return out
    xm = np.moveaxis(x, axis, -1)
    out = np.zeros(xm.shape[:-1] + (top_k,))
    for idx in np.ndindex(*xm.shape[:-1]):
        best = sorted(((v, j) for j, v in enumerate(xm[idx])), reverse=True)[:top_k]
        out[idx] = [v if out_max_val else j for v, j in best]
    return np.moveaxis(out, -1, axis)


def reduce_ref(x, axis, f, coeff):
    return coeff * f(x.reshape(x.shape[:axis] + (-1,))).sum(-1)


def softmax_ref(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


# id -> (prototxt, bottoms (list of makers or one maker of a list), number of tops,
#        reference(list of bottom arrays, layer) -> list of top arrays,
#        gradient: None (no backward) or check_gradient kwargs)
CASES = {
    "inner_product": (f'type: "InnerProduct" inner_product_param {{ num_output: 4 {G} }}',
                      [U(2, 3, 2, 2)], 1,
                      lambda b, l: [b[0].reshape(2, -1) @ l.blobs[0].data.T + l.blobs[1].data], {}),
    "inner_product_axis_transpose": (
        f'type: "InnerProduct" inner_product_param {{ num_output: 2 axis: 2 transpose: true {G} }}',
        [U(2, 3, 4)], 1, lambda b, l: [b[0] @ l.blobs[0].data + l.blobs[1].data], {}),
    "embed": (f'type: "Embed" embed_param {{ num_output: 3 input_dim: 5 {G} }}',
              [ints(5, 2, 4)], 1, lambda b, l: [l.blobs[0].data[b[0].astype(int)] + l.blobs[1].data],
              dict(check_bottom=[])),
    "embed_no_bias": (f'type: "Embed" embed_param {{ num_output: 2 input_dim: 4 bias_term: false {G} }}',
                      [fixed([[0, 3, 3], [1, 0, 3]])], 1,
                      lambda b, l: [l.blobs[0].data[b[0].astype(int)]], dict(check_bottom=[])),
    "concat": ('type: "Concat"', [U(2, 3, 4), U(2, 1, 4), U(2, 2, 4)], 1,
               lambda b, l: [np.concatenate(b, axis=1)], {}),
    "concat_last_axis": ('type: "Concat" concat_param { axis: -1 }', [U(2, 3), U(2, 5)], 1,
                         lambda b, l: [np.concatenate(b, axis=1)], {}),
    "concat_dim0": ('type: "Concat" concat_param { concat_dim: 0 }', [U(2, 3), U(4, 3)], 1,
                    lambda b, l: [np.concatenate(b, axis=0)], {}),
    "concat_one": ('type: "Concat"', [U(2, 3)], 1, lambda b, l: [b[0]], {}),
    "slice_points": ('type: "Slice" slice_param { slice_point: 1 slice_point: 4 }', [U(2, 6, 3)], 3,
                     lambda b, l: [b[0][:, :1], b[0][:, 1:4], b[0][:, 4:]], {}),
    "slice_even_dim0": ('type: "Slice" slice_param { slice_dim: 0 }', [U(6, 4)], 3,
                        lambda b, l: [b[0][0:2], b[0][2:4], b[0][4:6]], {}),
    "slice_last_axis": ('type: "Slice" slice_param { axis: -1 slice_point: 1 }', [U(2, 3, 4)], 2,
                        lambda b, l: [b[0][..., :1], b[0][..., 1:]], {}),
    "slice_one": ('type: "Slice"', [U(2, 3)], 1, lambda b, l: [b[0]], {}),
    "eltwise_prod": ('type: "Eltwise" eltwise_param { operation: PROD }',
                     [U(2, 3, 4), U(2, 3, 4), U(2, 3, 4)], 1, lambda b, l: [b[0] * b[1] * b[2]], {}),
    "eltwise_prod_unstable": ('type: "Eltwise" eltwise_param { operation: PROD stable_prod_grad: false }',
                              [U(2, 3, 4), U(2, 3, 4)], 1, lambda b, l: [b[0] * b[1]], {}),
    "eltwise_sum": ('type: "Eltwise"', [U(2, 3, 4), U(2, 3, 4)], 1, lambda b, l: [b[0] + b[1]], {}),
    "eltwise_sum_coeff": ('type: "Eltwise" eltwise_param { coeff: 1 coeff: -0.5 coeff: 2 }',
                          [U(2, 3), U(2, 3), U(2, 3)], 1,
                          lambda b, l: [b[0] - 0.5 * b[1] + 2 * b[2]], {}),
    "eltwise_max": ('type: "Eltwise" eltwise_param { operation: MAX }', distinct(3, 2, 3, 4), 1,
                    lambda b, l: [np.maximum(np.maximum(b[0], b[1]), b[2])], {}),
    "flatten": ('type: "Flatten"', [U(2, 3, 4, 5)], 1, lambda b, l: [b[0].reshape(2, 60)], {}),
    "flatten_axes": ('type: "Flatten" flatten_param { axis: 1 end_axis: 2 }', [U(2, 3, 4, 5)], 1,
                     lambda b, l: [b[0].reshape(2, 12, 5)], {}),
    "flatten_negative": ('type: "Flatten" flatten_param { axis: -2 }', [U(2, 3, 4, 5)], 1,
                         lambda b, l: [b[0].reshape(2, 3, 20)], {}),
    "reshape_infer": ('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } }', [U(2, 3, 4)], 1,
                      lambda b, l: [b[0].reshape(2, 12)], {}),
    "reshape_full": ('type: "Reshape" reshape_param { shape { dim: 3 dim: 2 dim: 4 } }',
                     [U(2, 3, 4)], 1, lambda b, l: [b[0].reshape(3, 2, 4)], {}),
    "reshape_part": ('type: "Reshape" reshape_param { shape { dim: 2 dim: -1 } axis: 1 num_axes: 1 }',
                     [U(2, 4, 3)], 1, lambda b, l: [b[0].reshape(2, 2, 2, 3)], {}),
    "reshape_append": ('type: "Reshape" reshape_param { shape { dim: 1 } axis: -1 num_axes: 0 }',
                       [U(2, 3)], 1, lambda b, l: [b[0].reshape(2, 3, 1)], {}),
    "tile": ('type: "Tile" tile_param { tiles: 3 }', [U(2, 3, 2)], 1,
             lambda b, l: [np.tile(b[0], (1, 3, 1))], {}),
    "tile_last_axis": ('type: "Tile" tile_param { axis: -1 tiles: 2 }', [U(2, 3)], 1,
                       lambda b, l: [np.tile(b[0], (1, 2))], {}),
    "reduction_sum": ('type: "Reduction"', [U(2, 3, 4)], 1,
                      lambda b, l: [np.asarray(b[0].sum())], {}),
    "reduction_asum": ('type: "Reduction" reduction_param { operation: ASUM axis: 1 coeff: 2 }',
                       [U(2, 3, 4)], 1, lambda b, l: [reduce_ref(b[0], 1, np.abs, 2.0)],
                       dict(kink=0.0, kink_range=0.02)),
    "reduction_sumsq": ('type: "Reduction" reduction_param { operation: SUMSQ axis: -1 coeff: -0.5 }',
                        [U(2, 3, 4)], 1, lambda b, l: [reduce_ref(b[0], 2, np.square, -0.5)], {}),
    "reduction_mean": ('type: "Reduction" reduction_param { operation: MEAN axis: 1 }',
                       [U(2, 3, 4)], 1, lambda b, l: [b[0].reshape(2, -1).mean(1)], {}),
    "argmax": ('type: "ArgMax"', distinct(1, 3, 10), 1, lambda b, l: [argmax_ref(b[0], 1, False)], None),
    "argmax_top3_values": ('type: "ArgMax" argmax_param { top_k: 3 out_max_val: true }',
                           distinct(1, 3, 2, 5), 1, lambda b, l: [argmax_ref(b[0], 3, True)], None),
    "argmax_axis": ('type: "ArgMax" argmax_param { axis: 1 top_k: 2 }', distinct(1, 2, 5, 3), 1,
                    lambda b, l: [argmax_ref(b[0], 2, False, axis=1)], None),
    "argmax_axis_values": ('type: "ArgMax" argmax_param { axis: -1 top_k: 2 out_max_val: true }',
                           distinct(1, 2, 3, 4), 1,
                           lambda b, l: [argmax_ref(b[0], 2, True, axis=2)], None),
    "softmax": ('type: "Softmax"', [U(2, 3, 4)], 1, lambda b, l: [softmax_ref(b[0], 1)], {}),
    "softmax_last_axis": ('type: "Softmax" softmax_param { axis: -1 }', [U(2, 3, 4)], 1,
                          lambda b, l: [softmax_ref(b[0], 2)], {}),
    "split": ('type: "Split"', [U(2, 3)], 3, lambda b, l: [b[0]] * 3, {}),
    "silence": ('type: "Silence"', [U(2, 3), U(4)], 0, lambda b, l: [], {}),
    "filter": ('type: "Filter"', [U(5, 3), U(5, 2, 2), fixed([1, 0, 1, 1, 0])], 2,
               lambda b, l: [b[0][[0, 2, 3]], b[1][[0, 2, 3]]], dict(check_bottom=[0, 1])),
    "batch_reindex": ('type: "BatchReindex"', [U(4, 3), fixed([2, 0, 2, 3, 1])], 1,
                      lambda b, l: [b[0][[2, 0, 2, 3, 1]]], dict(check_bottom=[0])),
    "parameter": ('type: "Parameter" parameter_param { shape { dim: 2 dim: 3 } }', [], 1,
                  lambda b, l: [l.blobs[0].data], {}),
}
WITH_BACKWARD = [k for k, c in CASES.items() if c[4] is not None]


def bottom_arrays(case, seed=3):
    rng = np.random.RandomState(seed)
    spec = CASES[case][1]
    return spec(rng) if callable(spec) else [f(rng) for f in spec]


def build(case, dtype=np.float64, seed=3):
    text, _, ntop, _, _ = CASES[case]
    layer = make_layer(text)
    bottom = [make_blob(a.shape, dtype=dtype, values=a) for a in bottom_arrays(case, seed)]
    top = [Blob(dtype=dtype) for _ in range(ntop)]
    layer.setup(bottom, top)
    if case == "parameter":  # zeros until trained: give it values to see
        layer.blobs[0].data[...] = np.random.RandomState(seed).uniform(-1, 1, (2, 3))
    return layer, bottom, top


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_reference(case):
    layer, bottom, top = build(case)
    layer.forward(bottom, top)
    ref = CASES[case][3]([b.data.copy() for b in bottom], layer)
    assert len(ref) == len(top)
    for t, r in zip(top, ref):
        assert t.shape == r.shape
        np.testing.assert_allclose(t.data, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_in_float32(case):
    layer, bottom, top = build(case, dtype=np.float32)
    layer.forward(bottom, top)
    ref = CASES[case][3]([b.data.astype(np.float64) for b in bottom], layer)
    for t, r in zip(top, ref):
        assert t.data.dtype == np.float32
        np.testing.assert_allclose(t.data, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", WITH_BACKWARD)
def test_gradient(case):
    text, _, ntop, _, kw = CASES[case]
    bottom = [make_blob(a.shape, values=a) for a in bottom_arrays(case)]
    n = check_gradient(make_layer(text), bottom, [Blob(dtype=np.float64) for _ in range(ntop)], **kw)
    assert n > 0


@pytest.mark.parametrize("case", [k for k in CASES if CASES[k][1]])
def test_propagate_down_false_leaves_bottom_diff(case):
    layer, bottom, top = build(case)
    layer.forward(bottom, top)
    for t in top:
        t.diff[...] = 1.5
    for b in bottom:
        b.diff[...] = 7.0
    layer.backward(top, [False] * len(bottom), bottom)
    for b in bottom:
        assert (b.diff == 7.0).all()


@pytest.mark.parametrize("case", ["inner_product", "embed", "embed_no_bias"])
def test_param_diffs_accumulate(case):
    layer, bottom, top = build(case)
    layer.forward(bottom, top)
    top[0].diff[...] = np.random.RandomState(3).randn(*top[0].shape)
    layer.backward(top, [False] * len(bottom), bottom)
    once = [b.diff.copy() for b in layer.blobs]
    assert all(np.abs(o).sum() > 0 for o in once)
    layer.backward(top, [False] * len(bottom), bottom)
    for b, o in zip(layer.blobs, once):
        np.testing.assert_allclose(b.diff, 2 * o)


def test_embed_sums_repeated_indices():
    layer, bottom, top = build("embed_no_bias")  # indices [[0, 3, 3], [1, 0, 3]]
    layer.forward(bottom, top)
    top[0].diff[...] = 1.0
    layer.backward(top, [False], bottom)
    np.testing.assert_allclose(layer.blobs[0].diff[:, 0], [2, 1, 0, 3])


@pytest.mark.parametrize("values,match", [([0, 5], "embed indices .*\\[0, 5\\).* 5"),
                                          ([-1, 0], "got -1"), ([0.5, 1], "got 0.5")])
def test_embed_rejects_bad_indices(values, match):
    layer = make_layer('name: "emb" type: "Embed" embed_param { num_output: 2 input_dim: 5 }')
    x = make_blob((2,), values=values)
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    with pytest.raises(LayerError, match="layer 'emb' .*" + match):
        layer.forward([x], [top])


def test_index_bottoms_get_no_gradient():
    for case, index_bottom in [("embed", 0), ("batch_reindex", 1), ("filter", 2)]:
        layer, bottom, top = build(case)
        layer.forward(bottom, top)
        assert not layer.allow_force_backward(index_bottom)
        pd = [i == index_bottom for i in range(len(bottom))]
        with pytest.raises(LayerError, match="cannot backpropagate"):
            layer.backward(top, pd, bottom)


def test_eltwise_max_ties_go_to_the_first_bottom_and_route_the_gradient():
    layer = make_layer('type: "Eltwise" eltwise_param { operation: MAX }')
    a = make_blob((4,), values=[1, 5, 2, 2])
    b = make_blob((4,), values=[1, 3, 4, 2])
    c = make_blob((4,), values=[0, 5, 4, 1])
    top = Blob(dtype=np.float64)
    layer.setup([a, b, c], [top])
    layer.forward([a, b, c], [top])
    np.testing.assert_array_equal(top.data, [1, 5, 4, 2])
    top.diff[...] = [10, 20, 30, 40]
    layer.backward([top], [True] * 3, [a, b, c])
    np.testing.assert_array_equal(a.diff, [10, 20, 0, 40])
    np.testing.assert_array_equal(b.diff, [0, 0, 30, 0])
    np.testing.assert_array_equal(c.diff, [0, 0, 0, 0])


@pytest.mark.parametrize("op", ["SUM", "PROD", "MAX"])
def test_eltwise_in_place_matches_out_of_place(op):
    text = f'type: "Eltwise" eltwise_param {{ operation: {op} }}'
    arrays = distinct(2, 3, 4)(np.random.RandomState(0))
    outs = []
    for in_place in (False, True):
        bottom = [make_blob(a.shape, values=a) for a in arrays]
        top = [bottom[0]] if in_place else [Blob(dtype=np.float64)]
        layer = make_layer(text)
        layer.setup(bottom, top)
        layer.forward(bottom, top)
        y = top[0].data.copy()
        top[0].diff[...] = np.arange(12).reshape(3, 4)
        layer.backward(top, [True, True], bottom)
        outs.append([y] + [b.diff.copy() for b in bottom])
    for a, b in zip(*outs):
        np.testing.assert_allclose(b, a)


def test_argmax_ties_take_the_larger_index_first():
    layer = make_layer('type: "ArgMax" argmax_param { top_k: 3 out_max_val: true }')
    x = make_blob((1, 5), values=[[2, 7, 2, 7, 1]])
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    layer.forward([x], [top])
    assert top.shape == (1, 2, 3)
    np.testing.assert_array_equal(top.data[0], [[3, 1, 2], [7, 7, 2]])


@pytest.mark.parametrize("case", ["flatten", "reshape_infer", "concat_one", "slice_one"])
def test_shape_layers_share_data_and_diff(case):
    layer, bottom, top = build(case)
    layer.forward(bottom, top)
    bottom[0].data.reshape(-1)[0] = 42.0
    assert top[0].data.reshape(-1)[0] == 42.0
    top[0].diff.reshape(-1)[-1] = -3.0
    assert bottom[0].diff.reshape(-1)[-1] == -3.0


def test_filter_setup_shape_then_selected_items_and_zero_gradient():
    layer, bottom, top = build("filter")
    assert top[0].shape == (5, 3) and top[1].shape == (5, 2, 2)  # selector not seen at setup
    layer.forward(bottom, top)
    assert top[0].shape == (3, 3)
    top[0].diff[...] = 1.0
    top[1].diff[...] = 2.0
    layer.backward(top, [True, True, False], bottom)
    np.testing.assert_array_equal(bottom[0].diff[:, 0], [1, 0, 1, 1, 0])
    np.testing.assert_array_equal(bottom[1].diff[:, 0, 0], [2, 0, 2, 2, 0])
    bottom[2].data[...] = 0  # nothing selected
    layer.forward(bottom, top)
    assert top[0].shape == (0, 3)


def test_slice_then_concat_is_identity():
    x = make_blob((2, 7, 3))
    parts = [Blob(dtype=np.float64) for _ in range(3)]
    s = make_layer('type: "Slice" slice_param { slice_point: 2 slice_point: 3 }')
    c = make_layer('type: "Concat"')
    y = Blob(dtype=np.float64)
    s.setup([x], parts)
    s.forward([x], parts)
    c.setup(parts, [y])
    c.forward(parts, [y])
    np.testing.assert_array_equal(y.data, x.data)


def test_parameter_blob_is_the_top_in_a_net():
    text = """
    name: "p" force_backward: true
    layer { name: "w" type: "Parameter" top: "w" parameter_param { shape { dim: 2 dim: 3 } } }
    layer { name: "loss" type: "Reduction" bottom: "w" top: "loss"
            reduction_param { operation: SUMSQ } loss_weight: 1 }
    """
    net = _net(text)
    net.params["w"][0].data[...] = np.arange(6).reshape(2, 3)
    loss = net.forward_prefilled()
    assert loss == pytest.approx(float((np.arange(6) ** 2).sum()))
    net.backward_from_to()
    np.testing.assert_allclose(net.params["w"][0].diff, 2 * np.arange(6).reshape(2, 3))


def _net(text):
    from minicaffe.core.protoio import parse_text
    return Net(parse_text(text, caffe_pb2.NetParameter()), caffe_pb2.TRAIN)


def test_layers_compose_in_a_net_with_in_place_relu():
    """x (2, 6) -> Slice(3) -> a, b; ReLU(a) in place; Eltwise SUM; Reshape (3, 2);
    Reduction SUMSQ as the loss.  loss = sum((relu(a) + b)^2)."""
    text = """
    name: "compose" force_backward: true
    layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 6 } } }
    layer { name: "slice" type: "Slice" bottom: "x" top: "a" top: "b" slice_param { slice_point: 3 } }
    layer { name: "relu" type: "ReLU" bottom: "a" top: "a" }
    layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }
    layer { name: "rs" type: "Reshape" bottom: "s" top: "r" reshape_param { shape { dim: 3 dim: -1 } } }
    layer { name: "loss" type: "Reduction" bottom: "r" top: "loss"
            reduction_param { operation: SUMSQ } loss_weight: 1 }
    """
    net = _net(text)
    x = np.random.RandomState(0).uniform(-1, 1, (2, 6)).astype(np.float32)
    net.blobs["x"].data[...] = x
    loss = net.forward_prefilled()
    a, b = x[:, :3], x[:, 3:]
    s = np.maximum(a, 0) + b
    assert net.blobs["r"].shape == (3, 2)
    assert loss == pytest.approx(float((s.astype(np.float64) ** 2).sum()), rel=1e-6)
    net.backward_from_to()
    want = np.concatenate([2 * s * (a > 0), 2 * s], axis=1)
    np.testing.assert_allclose(net.blobs["x"].diff, want, rtol=1e-6)


# -- bad parameters: one line naming the layer, the parameter and the shapes --------------

BAD = [
    ('type: "Eltwise"', [(2, 3), (2, 4)], 1, "same shape: bottom 0 \\(2, 3\\), bottom 1 \\(2, 4\\)"),
    ('type: "Eltwise" eltwise_param { coeff: 1 }', [(2, 3), (2, 3)], 1, "one coeff per bottom"),
    ('type: "Eltwise" eltwise_param { operation: MAX coeff: 1 coeff: 2 }', [(2, 3), (2, 3)], 1,
     "coeff is only for the SUM"),
    ('type: "Concat"', [(2, 3, 4), (2, 3, 5)], 1, "except on the concat axis 1: bottom 0 "
                                                  "\\(2, 3, 4\\), bottom 1 \\(2, 3, 5\\)"),
    ('type: "Concat"', [(2, 3, 4), (2, 3)], 1, "same number of axes"),
    ('type: "Concat" concat_param { axis: 3 }', [(2, 3), (2, 3)], 1, "axis 3 is out of range"),
    ('type: "Concat" concat_param { axis: 1 concat_dim: 1 }', [(2, 3), (2, 3)], 1, "not both"),
    ('type: "Reshape" reshape_param { shape { dim: -1 dim: -1 } }', [(2, 3)], 1, "multiple -1"),
    ('type: "Reshape" reshape_param { shape { dim: 5 dim: 2 } }', [(2, 3)], 1,
     "output count 10 .* input count 6"),
    ('type: "Reshape" reshape_param { shape { dim: 4 dim: -1 } }', [(2, 3)], 1, "divisible"),
    ('type: "Reshape" reshape_param { shape { dim: 0 dim: 0 dim: 0 } }', [(2, 3)], 1,
     "contains a 0 at position 2"),
    ('type: "Reshape" reshape_param { shape { dim: -2 } }', [(2, 3)], 1, "below -1"),
    ('type: "Reshape" reshape_param { axis: 4 shape { dim: 1 } }', [(2, 3)], 1, "axis 4"),
    ('type: "Slice" slice_param { slice_point: 3 slice_point: 2 }', [(2, 6)], 3,
     "strictly increasing.*\\[3, 2\\]"),
    ('type: "Slice" slice_param { slice_point: 6 }', [(2, 6)], 2, "slice point 6 is out of range"),
    ('type: "Slice" slice_param { slice_point: 2 }', [(2, 6)], 3, "1 slice_point.*3 tops"),
    ('type: "Slice"', [(2, 5)], 2, "size 5 .*\\(2, 5\\).* evenly into 2"),
    ('type: "Tile" tile_param { tiles: 0 }', [(2, 3)], 1, "tiles must be positive"),
    ('type: "Tile"', [(2, 3)], 1, "tiles"),
    ('type: "Flatten" flatten_param { axis: 2 end_axis: 1 }', [(2, 3, 4)], 1, "end_axis"),
    ('type: "ArgMax" argmax_param { top_k: 7 }', [(2, 6)], 1, "top_k 7 .*\\(2, 6\\)"),
    ('type: "ArgMax" argmax_param { top_k: 4 axis: 1 }', [(2, 3, 5)], 1, "top_k 4 .*axis 1"),
    ('type: "Softmax" softmax_param { axis: 2 }', [(2, 3)], 1, "axis 2 is out of range.*\\(2, 3\\)"),
    ('type: "Filter"', [(4, 3), (4,)], 2, "one top per filtered bottom"),
    ('type: "Filter"', [(4, 3), (5, 1)], 1, "selector's first dimension 5"),
    ('type: "Filter"', [(4, 3), (4, 2)], 1, "singleton"),
    ('type: "BatchReindex"', [(4, 3), (2, 2)], 1, "must be 1-D, got shape \\(2, 2\\)"),
    ('type: "Embed" embed_param { input_dim: 3 }', [(2,)], 1, "num_output must be positive"),
    ('type: "Embed" embed_param { num_output: 3 }', [(2,)], 1, "input_dim must be positive"),
    ('type: "Reduction" reduction_param { axis: 3 }', [(2, 3)], 1, "axis 3"),
]


@pytest.mark.parametrize("text,shapes,ntop,match", BAD)
def test_bad_parameters_fail_at_setup(text, shapes, ntop, match):
    layer = make_layer('name: "bad" ' + text)
    with pytest.raises(LayerError, match=match) as e:
        layer.setup([make_blob(s) for s in shapes], [Blob(dtype=np.float64) for _ in range(ntop)])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("layer 'bad' (")


@pytest.mark.parametrize("kind", ["Flatten", "Reshape", "Tile"])
def test_shape_layers_refuse_in_place(kind):
    layer = make_layer(f'name: "ip" type: "{kind}" tile_param {{ tiles: 2 }}' if kind == "Tile"
                       else f'name: "ip" type: "{kind}"')
    x = make_blob((2, 3))
    with pytest.raises(LayerError, match="layer 'ip' .*in-place"):
        layer.setup([x], [x])


def test_batch_reindex_index_out_of_range():
    layer = make_layer('name: "r" type: "BatchReindex"')
    x, idx = make_blob((3, 2)), make_blob((2,), values=[0, 3])
    top = Blob(dtype=np.float64)
    layer.setup([x, idx], [top])
    with pytest.raises(LayerError, match="layer 'r' .*\\[0, 3\\); got 3"):
        layer.forward([x, idx], [top])


# -- CPU/GPU parity (run by the lead on a GPU machine) --------------------------------------

def run_mode(gpu, case):
    context.set_mode_gpu() if gpu else context.set_mode_cpu()
    context.set_random_seed(1701)
    try:
        layer, bottom, top = build(case, dtype=np.float32)
        layer.forward(bottom, top)
        y = [t.data.copy() for t in top]
        rng = np.random.RandomState(5)
        for t in top:
            t.diff[...] = rng.uniform(-1, 1, t.shape)
        if CASES[case][4] is not None:
            for p in layer.blobs:
                p.diff[...] = 0
            pd = [layer.allow_force_backward(i) for i in range(len(bottom))]
            layer.backward(top, pd, bottom)
        return y, [b.diff.copy() for b in bottom], [p.diff.copy() for p in layer.blobs]
    finally:
        context.set_mode_cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_matches_cpu(case):
    cpu, gpu = run_mode(False, case), run_mode(True, case)
    for a_list, b_list in zip(cpu, gpu):
        for a, b in zip(a_list, b_list):
            assert a.shape == b.shape
            if a.size:
                scale = max(float(np.abs(a).max()), 1e-6)
                assert float(np.abs(a - b).max()) <= 1e-5 * scale, case
