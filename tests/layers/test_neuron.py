"""Neuron layers (minicaffe/layers/neuron.py) against naive numpy references:
forward, float64 finite-difference gradients, in place vs out of place,
propagate_down, parameter accumulation, bad parameters, and CPU/GPU parity."""
import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.blob import Blob
from minicaffe.core.errors import LayerError
from minicaffe.proto import caffe_pb2
from minicaffe.compat.testing import make_layer, make_blob, check_gradient

SHAPE = (2, 3, 4, 5)


def F(v):
    """A prototxt float as the layer sees it (float32 in the message)."""
    return float(np.float32(v))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def away_from(x, points, gap=0.05):
    """x with every value within ``gap`` of a kink moved 2*gap away from it."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, 2 * gap, -2 * gap)
    return x


# id -> (prototxt, reference y(x), kinks (values where the gradient jumps))
CASES = {
    "relu": ('type: "ReLU"', lambda x: np.maximum(x, 0), [0]),
    "relu_leaky": ('type: "ReLU" relu_param { negative_slope: 0.1 }',
                   lambda x: np.where(x > 0, x, F(0.1) * x), [0]),
    "relu_negative_slope": ('type: "ReLU" relu_param { negative_slope: -0.5 }',
                            lambda x: np.where(x > 0, x, -0.5 * x), [0]),
    "elu": ('type: "ELU" elu_param { alpha: 0.5 }',
            lambda x: np.where(x > 0, x, 0.5 * (np.exp(x) - 1)), [0]),
    "elu_default": ('type: "ELU"', lambda x: np.where(x > 0, x, np.exp(x) - 1), [0]),
    "sigmoid": ('type: "Sigmoid"', sigmoid, []),
    "tanh": ('type: "TanH"', np.tanh, []),
    "absval": ('type: "AbsVal"', np.abs, [0]),
    "bnll": ('type: "BNLL"', lambda x: np.log(1 + np.exp(x)), []),
    "power": ('type: "Power" power_param { power: 0.37 scale: 0.83 shift: 2.4 }',
              lambda x: (F(2.4) + F(0.83) * x) ** F(0.37), []),
    "power_square": ('type: "Power" power_param { power: 2 scale: 0.83 shift: -2.4 }',
                     lambda x: (-F(2.4) + F(0.83) * x) ** 2, []),
    "power_one": ('type: "Power" power_param { power: 1 scale: 0.83 shift: -2.4 }',
                  lambda x: -F(2.4) + F(0.83) * x, []),
    "power_zero": ('type: "Power" power_param { power: 0 scale: 0.83 shift: -2.4 }',
                   lambda x: np.ones_like(x), []),
    "power_no_shift": ('type: "Power" power_param { power: 3 scale: 0.5 }',
                       lambda x: (0.5 * x) ** 3, []),
    "power_zero_scale": ('type: "Power" power_param { power: 2 scale: 0 shift: 1.5 }',
                         lambda x: np.full_like(x, 2.25), []),
    "exp": ('type: "Exp"', np.exp, []),
    "exp_base2": ('type: "Exp" exp_param { base: 2 scale: 0.5 shift: 1 }',
                  lambda x: 2.0 ** (1 + 0.5 * x), []),
    "log": ('type: "Log" log_param { shift: 2 }', lambda x: np.log(2 + x), []),
    "log_base3": ('type: "Log" log_param { base: 3 scale: 0.5 shift: 1.5 }',
                  lambda x: np.log(1.5 + 0.5 * x) / np.log(3), []),
    "threshold": ('type: "Threshold" threshold_param { threshold: 0.3 }',
                  lambda x: (x > F(0.3)).astype(float), [F(0.3)]),
    "clip": ('type: "Clip" clip_param { min: -0.5 max: 0.6 }',
             lambda x: np.clip(x, -0.5, F(0.6)), [-0.5, F(0.6)]),
    "swish": ('type: "Swish" swish_param { beta: 1.5 }', lambda x: x * sigmoid(1.5 * x), []),
    "swish_default": ('type: "Swish"', lambda x: x * sigmoid(x), []),
    "dropout_test": ('type: "Dropout" phase: TEST dropout_param { dropout_ratio: 0.3 }',
                     lambda x: x, []),
    "dropout_test_unscaled": ('type: "Dropout" phase: TEST dropout_param { dropout_ratio: 0.3 '
                              'scale_train: false }', lambda x: (1 - F(0.3)) * x, []),
}
IN_PLACE_OK = [k for k in CASES if k != "absval"]


def bottom_for(case, shape=SHAPE, dtype=np.float64, seed=3):
    x = np.random.RandomState(seed).uniform(-1, 1, size=shape)
    return make_blob(shape, dtype=dtype, values=away_from(x, CASES[case][2]))


def run(layer, bottom, top, dy_seed=7, propagate=True):
    """setup + forward + backward with a fixed random top diff; returns (y, dx)."""
    layer.setup([bottom], [top])
    layer.forward([bottom], [top])
    y = top.data.copy()
    top.diff[...] = np.random.RandomState(dy_seed).uniform(-1, 1, size=top.shape)
    layer.backward([top], [propagate], [bottom])
    return y, bottom.diff.copy()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_forward_matches_reference(case, dtype):
    text, ref, _ = CASES[case]
    layer = make_layer(text)
    x = bottom_for(case, dtype=dtype)
    top = Blob(dtype=dtype)
    layer.setup([x], [top])
    assert top.shape == SHAPE
    layer.forward([x], [top])
    rtol = 1e-12 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(top.data, ref(x.data.astype(np.float64)), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("case", list(CASES))
def test_gradient(case):
    text, _, kinks = CASES[case]
    x = bottom_for(case, shape=(2, 3, 2, 2))
    kw = dict(kink=kinks[0], kink_range=0.02) if kinks else {}
    n = check_gradient(make_layer(text), [x], [Blob(dtype=np.float64)], **kw)
    assert n > 0


@pytest.mark.parametrize("case", IN_PLACE_OK)
def test_in_place_matches_out_of_place(case):
    text = CASES[case][0]
    y, dx = run(make_layer(text), bottom_for(case), Blob(dtype=np.float64))
    b = bottom_for(case)
    y_in, dx_in = run(make_layer(text), b, b)
    np.testing.assert_array_equal(y_in, y)
    np.testing.assert_allclose(dx_in, dx, rtol=1e-14, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_propagate_down_false_leaves_bottom_diff(case):
    x = bottom_for(case)
    x.diff[...] = 7.0
    run(make_layer(CASES[case][0]), x, Blob(dtype=np.float64), propagate=False)
    assert (x.diff == 7.0).all()


def test_threshold_backward_is_zero():
    x = make_blob((3, 4))
    x.diff[...] = 5
    _, dx = run(make_layer('type: "Threshold"'), x, Blob(dtype=np.float64))
    assert (dx == 0).all()


def test_power_of_negative_base_is_nan_without_warning():
    layer = make_layer('type: "Power" power_param { power: 0.5 }')
    x = make_blob((4,), values=[-1.0, 0.0, 1.0, 4.0])
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    layer.forward([x], [top])  # filterwarnings=error: a numpy warning would fail here
    assert np.isnan(top.data[0]) and list(top.data[1:]) == [0.0, 1.0, 2.0]


def test_bnll_and_exp_are_finite_for_large_inputs():
    x = make_blob((4,), values=[-800.0, -60.0, 60.0, 800.0])
    top = Blob(dtype=np.float64)
    layer = make_layer('type: "BNLL"')
    layer.setup([x], [top])
    layer.forward([x], [top])
    np.testing.assert_allclose(top.data, [0.0, np.log1p(np.exp(-60.0)), 60.0, 800.0], rtol=1e-12)
    elu = make_layer('type: "ELU"')
    elu.setup([x], [top])
    elu.forward([x], [top])
    np.testing.assert_allclose(top.data, [-1.0, np.expm1(-60.0), 60.0, 800.0])


# -- PReLU ---------------------------------------------------------------------------

def prelu_ref(x, a, shared):
    a = np.asarray(a).reshape(()) if shared else np.asarray(a).reshape((1, -1) + (1,) * (x.ndim - 2))
    return np.maximum(x, 0) + a * np.minimum(x, 0)


@pytest.mark.parametrize("shared", [False, True])
def test_prelu_forward_gradient_and_default_slope(shared):
    text = f'type: "PReLU" prelu_param {{ channel_shared: {str(shared).lower()} }}'
    layer = make_layer(text)
    x = make_blob(SHAPE)
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    assert layer.blobs[0].shape == (() if shared else (3,))
    assert (layer.blobs[0].data == 0.25).all()
    layer.forward([x], [top])
    np.testing.assert_allclose(top.data, prelu_ref(x.data, layer.blobs[0].data, shared))
    # random slopes, checked over the bottom and the slope blob
    filler = 'filler { type: "uniform" min: -1 max: 1 }'
    layer = make_layer(text[:-1] + filler + " }")
    x = make_blob((2, 3, 2, 2), values=away_from(np.random.RandomState(2).uniform(-1, 1, (2, 3, 2, 2)), [0]))
    check_gradient(layer, [x], [Blob(dtype=np.float64)], kink=0.0, kink_range=0.02)


def test_prelu_in_place_gives_same_param_gradient():
    text = 'type: "PReLU" prelu_param { filler { type: "uniform" min: 0 max: 1 } }'
    context.set_random_seed(5)
    a = make_layer(text)
    y, dx = run(a, bottom_for("relu"), Blob(dtype=np.float64))
    context.set_random_seed(5)
    b = make_layer(text)
    blob = bottom_for("relu")
    y_in, dx_in = run(b, blob, blob)
    np.testing.assert_array_equal(y_in, y)
    np.testing.assert_allclose(dx_in, dx)
    np.testing.assert_allclose(b.blobs[0].diff, a.blobs[0].diff)


# -- Bias and Scale ---------------------------------------------------------------------

BROADCAST = [  # (param text, operand shape for bottom (2, 3, 4, 5), how to broadcast it)
    ("", (3,), lambda p: p.reshape(1, 3, 1, 1)),
    ("axis: 0 num_axes: 2", (2, 3), lambda p: p.reshape(2, 3, 1, 1)),
    ("axis: -2 num_axes: -1", (4, 5), lambda p: p.reshape(1, 1, 4, 5)),
    ("num_axes: 0", (), lambda p: p.reshape(())),
    ("axis: 1 num_axes: 3", (3, 4, 5), lambda p: p.reshape(1, 3, 4, 5)),
]


@pytest.mark.parametrize("kind", ["Bias", "Scale"])
@pytest.mark.parametrize("params,shape,bcast", BROADCAST)
def test_bias_scale_learned_forward_and_gradient(kind, params, shape, bcast):
    p = kind.lower() + "_param"
    text = f'type: "{kind}" {p} {{ {params} filler {{ type: "gaussian" }} }}'
    layer = make_layer(text)
    x = make_blob(SHAPE)
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    assert layer.blobs[0].shape == shape
    layer.forward([x], [top])
    w = bcast(layer.blobs[0].data)
    np.testing.assert_allclose(top.data, x.data + w if kind == "Bias" else x.data * w)
    check_gradient(make_layer(text), [make_blob((2, 3, 4, 5))], [Blob(dtype=np.float64)])


@pytest.mark.parametrize("kind", ["Bias", "Scale"])
@pytest.mark.parametrize("params,shape,bcast", BROADCAST[:4])
def test_bias_scale_two_bottoms(kind, params, shape, bcast):
    text = f'type: "{kind}" {kind.lower()}_param {{ {params} }}'
    layer = make_layer(text)
    x, w = make_blob(SHAPE), make_blob(shape)
    top = Blob(dtype=np.float64)
    layer.setup([x, w], [top])
    assert layer.blobs == []
    layer.forward([x, w], [top])
    ref = x.data + bcast(w.data) if kind == "Bias" else x.data * bcast(w.data)
    np.testing.assert_allclose(top.data, ref)
    check_gradient(make_layer(text), [make_blob((2, 3, 4, 5)), make_blob(shape)],
                   [Blob(dtype=np.float64)])


def test_scale_defaults_and_bias_term():
    layer = make_layer('type: "Scale" scale_param { bias_term: true '
                       'bias_filler { type: "constant" value: 0.5 } }')
    x = make_blob(SHAPE)
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    assert [b.shape for b in layer.blobs] == [(3,), (3,)]
    assert (layer.blobs[0].data == 1).all() and (layer.blobs[1].data == 0.5).all()
    layer.forward([x], [top])
    np.testing.assert_allclose(top.data, x.data + 0.5)
    text = ('type: "Scale" scale_param { axis: 2 num_axes: 2 bias_term: true '
            'filler { type: "gaussian" } bias_filler { type: "gaussian" } }')
    check_gradient(make_layer(text), [make_blob((2, 3, 2, 3))], [Blob(dtype=np.float64)])
    # two bottoms + bias term: the only param blob is the bias
    two = make_layer('type: "Scale" scale_param { bias_term: true bias_filler { type: "gaussian" } }')
    check_gradient(two, [make_blob((2, 3, 2)), make_blob((3,))], [Blob(dtype=np.float64)])
    assert [b.shape for b in two.blobs] == [(3,)]


@pytest.mark.parametrize("text", [
    'type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
    'bias_filler { type: "gaussian" } }',
    'type: "Bias" bias_param { filler { type: "gaussian" } }',
])
def test_bias_scale_in_place(text):
    context.set_random_seed(9)
    a = make_layer(text)
    y, dx = run(a, bottom_for("tanh"), Blob(dtype=np.float64))
    context.set_random_seed(9)
    b = make_layer(text)
    blob = bottom_for("tanh")
    y_in, dx_in = run(b, blob, blob)
    np.testing.assert_allclose(y_in, y)
    np.testing.assert_allclose(dx_in, dx)
    for pa, pb in zip(a.blobs, b.blobs):
        np.testing.assert_allclose(pb.diff, pa.diff)


@pytest.mark.parametrize("text", [
    'type: "PReLU" prelu_param { filler { type: "gaussian" } }',
    'type: "PReLU" prelu_param { channel_shared: true }',
    'type: "Bias" bias_param { filler { type: "gaussian" } }',
    'type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } }',
])
def test_param_diffs_accumulate(text):
    layer = make_layer(text)
    x = make_blob(SHAPE)
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    layer.forward([x], [top])
    top.diff[...] = np.random.RandomState(3).randn(*top.shape)
    layer.backward([top], [True], [x])
    once = [b.diff.copy() for b in layer.blobs]
    assert all(np.abs(o).sum() > 0 for o in once)
    layer.backward([top], [True], [x])
    for b, o in zip(layer.blobs, once):
        np.testing.assert_allclose(b.diff, 2 * o)


def test_param_propagate_down_false_leaves_param_diff():
    layer = make_layer('type: "Scale" scale_param { bias_term: true }')
    x = make_blob(SHAPE)
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    layer.set_param_propagate_down(0, False)
    layer.forward([x], [top])
    top.diff[...] = 1
    layer.backward([top], [True], [x])
    assert (layer.blobs[0].diff == 0).all() and (layer.blobs[1].diff != 0).all()


# -- Dropout --------------------------------------------------------------------------

@pytest.mark.parametrize("scale_train", [True, False])
def test_dropout_train_mask_fraction_scale_and_backward(scale_train):
    ratio = 0.3
    layer = make_layer(f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} '
                       f'scale_train: {str(scale_train).lower()} }}')
    x = make_blob((100, 1000), low=0.5, high=1.5)
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    layer.forward([x], [top])
    kept = top.data != 0
    n = kept.size
    # Bernoulli(0.7) over 1e5 units: 5 sigma is 0.0072
    assert abs(kept.mean() - (1 - ratio)) < 5 * np.sqrt(ratio * (1 - ratio) / n)
    s = 1 / (1 - ratio) if scale_train else 1.0
    np.testing.assert_allclose(top.data[kept], x.data[kept] * s)
    top.diff[...] = 2.0
    layer.backward([top], [True], [x])
    np.testing.assert_allclose(x.diff, np.where(kept, 2.0 * s, 0.0))
    # a new mask each forward
    first = kept.copy()
    layer.forward([x], [top])
    assert (first != (top.data != 0)).any()


def test_dropout_mask_follows_the_seed():
    def mask():
        context.set_random_seed(42)
        layer = make_layer('type: "Dropout"')
        x = make_blob((50, 50), low=1, high=2)
        top = Blob(dtype=np.float64)
        layer.setup([x], [top])
        layer.forward([x], [top])
        return top.data != 0
    np.testing.assert_array_equal(mask(), mask())


def test_dropout_gradient_with_a_fixed_mask():
    layer = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.4 }')
    forward = layer.forward

    def reseeded(bottom, top):  # Caffe's checker reseeds before every forward
        context.set_random_seed(1701)
        return forward(bottom, top)
    layer.forward = reseeded
    check_gradient(layer, [make_blob((3, 4, 2))], [Blob(dtype=np.float64)])


def test_dropout_ratio_zero_keeps_everything():
    layer = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0 }')
    x = make_blob((20, 20))
    top = Blob(dtype=np.float64)
    layer.setup([x], [top])
    layer.forward([x], [top])
    np.testing.assert_array_equal(top.data, x.data)


# -- bad parameters: one line naming the layer, the parameter and the shapes -------------

BAD = [
    ('type: "PReLU"', [(5,)], "at least 2 axes.*\\(5,\\)"),
    ('type: "Dropout" dropout_param { dropout_ratio: 1 }', [(2, 3)], "dropout_ratio"),
    ('type: "Dropout" dropout_param { dropout_ratio: -0.1 }', [(2, 3)], "dropout_ratio"),
    ('type: "Exp" exp_param { base: -2 }', [(2, 3)], "base must be strictly positive"),
    ('type: "Log" log_param { base: 0 }', [(2, 3)], "base must be strictly positive"),
    ('type: "Clip" clip_param { min: 1 max: 0 }', [(2, 3)], "min .* must not exceed max"),
    ('type: "Bias"', [(2, 3, 4), (4,)], "bias shape \\(4,\\) does not match bottom\\[0\\] "
                                        "shape \\(2, 3, 4\\)"),
    ('type: "Scale"', [(2, 3, 4), (3, 5)], "scale shape \\(3, 5\\) does not match"),
    ('type: "Scale" scale_param { axis: 1 num_axes: 3 }', [(2, 3, 4)],
     "extends past bottom\\[0\\] \\(2, 3, 4\\)"),
    ('type: "Bias" bias_param { num_axes: -2 }', [(2, 3, 4)], "num_axes"),
    ('type: "Bias" bias_param { axis: 5 }', [(2, 3, 4)], "axis 5 is out of range.*\\(2, 3, 4\\)"),
]


@pytest.mark.parametrize("text,shapes,match", BAD)
def test_bad_parameters_fail_at_setup(text, shapes, match):
    layer = make_layer('name: "bad" ' + text)
    with pytest.raises(LayerError, match=match) as e:
        layer.setup([make_blob(s) for s in shapes], [Blob(dtype=np.float64)])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("layer 'bad' (")


def test_absval_refuses_in_place():
    layer = make_layer('name: "abs" type: "AbsVal"')
    x = make_blob((2, 3))
    with pytest.raises(LayerError, match="layer 'abs' .*in-place"):
        layer.setup([x], [x])


def test_clip_needs_min_and_max():
    with pytest.raises(LayerError, match="min: ... max: ..."):
        make_layer('type: "Clip"').setup([make_blob((2,))], [Blob(dtype=np.float64)])


# -- CPU/GPU parity (run by the lead on a GPU machine) -----------------------------------

def run_mode(gpu, text, shapes, seed=11, in_place=False):
    """A fresh layer (same seed, so the same params) run in one mode on float32
    blobs; returns tops, bottom diffs and param diffs as numpy arrays."""
    context.set_mode_gpu() if gpu else context.set_mode_cpu()
    context.set_random_seed(1701)
    rng = np.random.RandomState(seed)
    layer = make_layer(text)
    bottom = [make_blob(s, dtype=np.float32, values=rng.uniform(-1, 1, s)) for s in shapes]
    top = [bottom[0]] if in_place else [Blob(dtype=np.float32)]
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    y = [t.data.copy() for t in top]
    for t in top:
        t.diff[...] = rng.uniform(-1, 1, t.shape)
    layer.backward(top, [True] * len(bottom), bottom)
    out = y, [b.diff.copy() for b in bottom], [p.diff.copy() for p in layer.blobs]
    context.set_mode_cpu()
    return out


def assert_parity(cpu, gpu, rel=1e-5):
    for a_list, b_list in zip(cpu, gpu):
        for a, b in zip(a_list, b_list):
            assert a.shape == b.shape
            scale = max(float(np.abs(a).max()) if a.size else 0.0, 1e-6)
            assert float(np.abs(a - b).max() if a.size else 0.0) <= rel * scale


PARITY = [CASES[k][0] for k in CASES if k not in ("absval",)] + [
    'type: "PReLU" prelu_param { filler { type: "gaussian" } }',
    'type: "PReLU" prelu_param { channel_shared: true }',
    'type: "Bias" bias_param { axis: 2 num_axes: 2 filler { type: "gaussian" } }',
    'type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
    'bias_filler { type: "gaussian" } }',
]


@pytest.mark.gpu
@pytest.mark.parametrize("text", PARITY)
@pytest.mark.parametrize("in_place", [False, True])
def test_gpu_matches_cpu(text, in_place):
    assert_parity(run_mode(False, text, [SHAPE], in_place=in_place),
                  run_mode(True, text, [SHAPE], in_place=in_place))


@pytest.mark.gpu
def test_gpu_absval_and_two_bottom_forms():
    for text, shapes in [('type: "AbsVal"', [SHAPE]),
                         ('type: "Bias"', [SHAPE, (3,)]),
                         ('type: "Scale" scale_param { bias_term: true }', [SHAPE, (3, 4)])]:
        assert_parity(run_mode(False, text, shapes), run_mode(True, text, shapes))


@pytest.mark.gpu
@pytest.mark.parametrize("scale_train", [True, False])
def test_gpu_dropout_distribution(scale_train):
    """The GPU draws its own mask (cupy's generator): compare the kept fraction and
    the scale, not the mask."""
    ratio = 0.3
    context.set_mode_gpu()
    try:
        layer = make_layer(f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} '
                           f'scale_train: {str(scale_train).lower()} }}')
        x = make_blob((200, 1000), dtype=np.float32, low=0.5, high=1.5)
        top = Blob(dtype=np.float32)
        layer.setup([x], [top])
        layer.forward([x], [top])
        y = top.data.copy()
        kept = y != 0
        assert abs(kept.mean() - (1 - ratio)) < 5 * np.sqrt(ratio * (1 - ratio) / kept.size)
        s = 1 / (1 - ratio) if scale_train else 1.0
        np.testing.assert_allclose(y[kept], x.data[kept] * s, rtol=1e-6)
        top.diff[...] = 1.0
        layer.backward([top], [True], [x])
        np.testing.assert_allclose(x.diff, np.where(kept, s, 0.0), rtol=1e-6)
    finally:
        context.set_mode_cpu()
