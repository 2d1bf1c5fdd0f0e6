"""Every registered layer type builds, runs forward and backward from a minimal
prototxt (Caffe's own test: a test creates every registered type).

ENTRIES maps each type to (prototxt body without ``type``, bottoms, number of
tops[, prepare]).  A bottom is a shape (values uniform in [-1, 1]) or a maker
from the helpers below; ``prepare(layer)`` runs after setup, before forward.
An entry may also be a function of a temporary directory returning that tuple
(for layers that read or write files), or a string: the reason to skip.

A type registered without an entry FAILS the test: whoever adds a layer type adds
its entry here.  Entries for Caffe types not registered yet are skipped.
"""
import sys
import types

import numpy as np
import pytest

from minicaffe.core.blob import Blob
from minicaffe.core.errors import LayerError
from minicaffe.layers.registry import layer_type_list
from minicaffe.compat.testing import make_layer, make_blob

G = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" }'


def I(high, *shape):
    """Integer labels/indices in [0, high)."""
    return lambda rng: rng.randint(0, high, shape).astype(np.float32)


def V(values):
    """Fixed values."""
    return lambda rng: np.asarray(values, dtype=np.float32)


def R(low, high, *shape):
    """Uniform in [low, high)."""
    return lambda rng: rng.uniform(low, high, shape)


def P(*shape):
    """Rows of probabilities (positive, summing to 1 over axis 1)."""
    def make(rng):
        p = rng.uniform(0.1, 1, shape)
        return p / p.sum(axis=1, keepdims=True)
    return make


def _python_entry(tmp_path):
    """A Python layer from a module made on the fly (y = 2x, dx = 2dy)."""
    from minicaffe.layers.python_layer import PythonLayerBase

    class Double(PythonLayerBase):
        def reshape(self, bottom, top):
            top[0].reshape(*bottom[0].data.shape)

        def forward(self, bottom, top):
            top[0].data[...] = 2 * bottom[0].data

        def backward(self, top, propagate_down, bottom):
            if propagate_down[0]:
                bottom[0].diff[...] = 2 * top[0].diff

    mod = types.ModuleType("_minicaffe_registry_pylayer")
    mod.Double = Double
    sys.modules[mod.__name__] = mod
    return (f'python_param {{ module: "{mod.__name__}" layer: "Double" }}', [(2, 3)], 1)


def _hdf5_data_entry(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "rows.h5"
    with h5py.File(path, "w") as f:
        f["data"] = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
        f["label"] = np.arange(4, dtype=np.float32)
    listing = tmp_path / "list.txt"
    listing.write_text(f"{path}\n")
    return (f'top: "data" top: "label" hdf5_data_param {{ source: "{listing}" batch_size: 2 }}',
            [], 2)


def _hdf5_output_entry(tmp_path):
    pytest.importorskip("h5py")
    return (f'hdf5_output_param {{ file_name: "{tmp_path / "out.h5"}" }}', [(2, 3), I(3, 2)], 0)


ENTRIES = {
    # -- Neuron
    "ReLU": ("relu_param { negative_slope: 0.1 }", [(2, 3, 4)], 1),
    "PReLU": ("", [(2, 3, 4)], 1),
    "ELU": ("", [(2, 3)], 1),
    "Sigmoid": ("", [(2, 3)], 1),
    "TanH": ("", [(2, 3)], 1),
    "AbsVal": ("", [(2, 3)], 1),
    "BNLL": ("", [(2, 3)], 1),
    "Power": ("power_param { power: 2 scale: 0.5 shift: 1 }", [(2, 3)], 1),
    "Exp": ("exp_param { base: 2 }", [(2, 3)], 1),
    "Log": ("log_param { shift: 2 }", [(2, 3)], 1),
    "Threshold": ("threshold_param { threshold: 0.1 }", [(2, 3)], 1),
    "Clip": ("clip_param { min: -0.5 max: 0.5 }", [(2, 3)], 1),
    "Swish": ("", [(2, 3)], 1),
    "Dropout": ("dropout_param { dropout_ratio: 0.4 }", [(2, 3)], 1),
    "Bias": ("bias_param { filler { type: \"gaussian\" } }", [(2, 3, 4)], 1),
    "Scale": ("scale_param { bias_term: true }", [(2, 3, 4)], 1),
    # -- Common
    "InnerProduct": (f"inner_product_param {{ num_output: 3 {G} }}", [(2, 3, 2)], 1),
    "Embed": (f"embed_param {{ num_output: 3 input_dim: 4 {G} }}", [I(4, 2, 3)], 1),
    "Split": ("", [(2, 3)], 2),
    "Concat": ("", [(2, 3), (2, 1)], 1),
    "Slice": ("slice_param { slice_point: 1 }", [(2, 3)], 2),
    "Eltwise": ("eltwise_param { operation: PROD }", [(2, 3), (2, 3)], 1),
    "Flatten": ("", [(2, 3, 4)], 1),
    "Reshape": ("reshape_param { shape { dim: -1 } }", [(2, 3)], 1),
    "Tile": ("tile_param { tiles: 2 }", [(2, 3)], 1),
    "Reduction": ("reduction_param { operation: SUMSQ axis: 1 }", [(2, 3)], 1),
    "ArgMax": ("argmax_param { top_k: 2 }", [(2, 5)], 1),
    "Softmax": ("", [(2, 3)], 1),
    "Silence": ("", [(2, 3)], 0),
    "Filter": ("", [(3, 2), V([1, 0, 1])], 1),
    "BatchReindex": ("", [(3, 2), V([2, 2, 0, 1])], 1),
    "Parameter": ("parameter_param { shape { dim: 2 dim: 3 } }", [], 1),
    # -- Vision
    "Convolution": (f"convolution_param {{ num_output: 2 kernel_size: 3 pad: 1 {G} }}",
                    [(2, 3, 5, 5)], 1),
    "Deconvolution": (f"convolution_param {{ num_output: 2 kernel_size: 2 stride: 2 {G} }}",
                      [(2, 3, 3, 3)], 1),
    "Pooling": ("pooling_param { pool: MAX kernel_size: 2 stride: 2 }", [(2, 3, 4, 4)], 1),
    "Im2col": ("convolution_param { kernel_size: 2 }", [(2, 3, 4, 4)], 1),
    "SPP": ("spp_param { pyramid_height: 2 }", [(2, 3, 4, 4)], 1),
    "Crop": ("crop_param { axis: 2 offset: 1 }", [(2, 3, 5, 5), (2, 3, 3, 3)], 1),
    # -- Normalization
    "LRN": ("lrn_param { local_size: 3 }", [(2, 4, 3, 3)], 1),
    "BatchNorm": ("", [(4, 3, 2, 2)], 1),
    "MVN": ("", [(2, 3, 4, 4)], 1),
    # -- Loss
    "SoftmaxWithLoss": ("", [(4, 5), I(5, 4)], 1),
    "Accuracy": ("", [(4, 5), I(5, 4)], 1),
    "SigmoidCrossEntropyLoss": ("", [(4, 3), R(0, 1, 4, 3)], 1),
    "EuclideanLoss": ("", [(4, 3), (4, 3)], 1),
    "HingeLoss": ("", [(4, 3), I(3, 4)], 1),
    "InfogainLoss": ("", [P(4, 3), I(3, 4), R(0, 1, 3, 3)], 1),
    "MultinomialLogisticLoss": ("", [P(4, 3), I(3, 4)], 1),
    "ContrastiveLoss": ("", [(4, 3), (4, 3), I(2, 4)], 1),
    # -- Recurrent (T = 2 steps of N = 2 streams)
    "RNN": (f"recurrent_param {{ num_output: 3 {G} }}", [(2, 2, 4), V([[0, 0], [1, 1]])], 1),
    "LSTM": (f"recurrent_param {{ num_output: 3 {G} }}", [(2, 2, 4), V([[0, 0], [1, 1]])], 1),
    "LSTMUnit": ("", [(1, 2, 3), (1, 2, 12), V([[0, 1]])], 2),
    # -- Data
    "Input": ("input_param { shape { dim: 2 dim: 3 } }", [], 1),
    "DummyData": ('dummy_data_param { shape { dim: 2 dim: 3 } data_filler { type: "gaussian" } }',
                  [], 1),
    "MemoryData": ("memory_data_param { batch_size: 2 channels: 1 height: 2 width: 2 }", [], 2,
                   lambda layer: layer.reset(np.ones((4, 1, 2, 2)), np.arange(4))),
    "HDF5Data": _hdf5_data_entry,
    "HDF5Output": _hdf5_output_entry,
    "Data": "needs an LMDB/LevelDB database and a prefetch thread (tested with the data layers)",
    "ImageData": "needs image files and a prefetch thread (tested with the data layers)",
    "WindowData": "needs a window file and images (tested with the data layers)",
    # -- Python
    "Python": _python_entry,
}

REGISTERED = layer_type_list()


def test_every_registered_type_has_an_entry():
    missing = [t for t in REGISTERED if t not in ENTRIES]
    assert not missing, (f"registered layer types without an entry in "
                         f"tests/layers/test_registry.py ENTRIES: {missing}; add a minimal "
                         f"prototxt and bottom shapes for each")


def test_caffe_types_have_entries():
    caffe_types = {"Deconvolution", "Im2col", "LRN", "SPP", "Crop", "BatchNorm", "MVN",
                   "SigmoidCrossEntropyLoss", "EuclideanLoss", "HingeLoss", "InfogainLoss",
                   "MultinomialLogisticLoss", "ContrastiveLoss", "RNN", "LSTM", "LSTMUnit",
                   "Python", "Data", "ImageData", "HDF5Data", "HDF5Output", "WindowData"}
    assert caffe_types <= set(ENTRIES)


@pytest.mark.parametrize("type_name", sorted(set(ENTRIES) | set(REGISTERED)))
def test_type_builds_runs_forward_and_backward(type_name, tmp_path):
    if type_name not in ENTRIES:
        pytest.fail(f"layer type '{type_name}' is registered but has no entry in ENTRIES")
    if type_name not in REGISTERED:
        pytest.skip(f"'{type_name}' is not registered yet")
    entry = ENTRIES[type_name]
    if isinstance(entry, str):
        pytest.skip(entry)
    if callable(entry):
        entry = entry(tmp_path)
    text, bottom_specs, ntop = entry[:3]
    prepare = entry[3] if len(entry) > 3 else None
    rng = np.random.RandomState(0)
    arrays = [np.asarray(s(rng) if callable(s) else rng.uniform(-1, 1, s)) for s in bottom_specs]
    bottom = [make_blob(a.shape, dtype=np.float32, values=a) for a in arrays]
    top = [Blob() for _ in range(ntop)]
    layer = make_layer(f'name: "{type_name.lower()}" type: "{type_name}" {text}')
    try:
        layer.setup(bottom, top)
        if prepare is not None:
            prepare(layer)
        layer.forward(bottom, top)
        for i, t in enumerate(top):
            assert np.isfinite(t.data).all(), f"top {i} of {type_name} is not finite"
            if not layer.loss(i):  # loss tops keep their loss weight as diff
                t.diff[...] = rng.uniform(-1, 1, t.shape)
        propagate = [layer.allow_force_backward(i) for i in range(len(bottom))]
        try:
            layer.backward(top, propagate, bottom)
        except LayerError as e:  # a layer with no gradient (Accuracy) may refuse, as Caffe's
            assert "cannot backprop" in str(e), str(e)
            propagate = [False] * len(bottom)
            layer.backward(top, propagate, bottom)
        for i, (b, p) in enumerate(zip(bottom, propagate)):
            if p:
                assert np.isfinite(b.diff).all(), f"bottom {i} diff of {type_name} is not finite"
    finally:
        close = getattr(layer, "close", None)
        if callable(close):
            close()


# -- what backward keeps ---------------------------------------------------------------------
# Variants beside ENTRIES whose declaration differs: (type, prototxt body, bottoms, tops,
# in place).
RETAIN_VARIANTS = [
    ("Eltwise", "eltwise_param { operation: SUM coeff: 2 coeff: -1 }", [(2, 3), (2, 3)], 1, False),
    ("Eltwise", "eltwise_param { operation: MAX }", [(2, 3), (2, 3)], 1, False),
    ("Pooling", "pooling_param { pool: AVE kernel_size: 2 stride: 2 }", [(2, 3, 4, 4)], 1, False),
    ("Scale", "scale_param { axis: 0 }", [(2, 3, 4), (2, 3)], 1, False),
    ("Scale", "scale_param { axis: 0 }", [(2, 3, 4), (2, 3)], 1, True),
    ("Scale", "scale_param { bias_term: true }", [(2, 3, 4)], 1, True),
    ("ReLU", "", [(2, 3, 4)], 1, True),
    ("ReLU", "relu_param { negative_slope: -0.5 }", [(2, 3, 4)], 1, True),
    ("BatchNorm", "", [(4, 3, 2, 2)], 1, True),
    ("Sigmoid", "", [(2, 3)], 1, True),
]


def _retain_cases():
    cases = []
    for name in sorted(ENTRIES):
        entry = ENTRIES[name]
        if isinstance(entry, tuple) and name in REGISTERED and entry[1]:
            cases.append(pytest.param(name, entry[0], entry[1], entry[2], False, id=name))
    for k, (name, text, bottoms, ntop, in_place) in enumerate(RETAIN_VARIANTS):
        cases.append(pytest.param(name, text, bottoms, ntop, in_place,
                                  id=f"{name}-variant{k}"))
    return cases


def _run_backward(layer, top, propagate, bottom):
    try:
        layer.backward(top, propagate, bottom)
    except LayerError as e:
        assert "cannot backprop" in str(e), str(e)
        return False
    return True


@pytest.mark.parametrize("type_name,text,bottom_specs,ntop,in_place", _retain_cases())
def test_backward_reads_only_what_the_layer_retains(type_name, text, bottom_specs, ntop,
                                                    in_place):
    """The declaration the memory plan reads (``retain_inputs``/``retain_outputs``, None:
    all) against the math: with the data of every bottom and top not retained poisoned
    (NaN) after forward, backward gives the same bottom and parameter gradients."""
    rng = np.random.RandomState(0)
    arrays = [np.asarray(s(rng) if callable(s) else rng.uniform(-1, 1, s)) for s in bottom_specs]
    bottom = [make_blob(a.shape, dtype=np.float32, values=a) for a in arrays]
    top = [bottom[0]] if in_place else [Blob() for _ in range(ntop)]
    layer = make_layer(f'name: "{type_name.lower()}" type: "{type_name}" {text}')
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    for i, t in enumerate(top):
        if not layer.loss(i):
            t.diff[...] = rng.uniform(-1, 1, t.shape)
    dys = [t.diff.copy() for t in top]
    propagate = [layer.allow_force_backward(i) for i in range(len(bottom))]
    if not _run_backward(layer, top, propagate, bottom):
        pytest.skip(f"{type_name} has no gradient")

    def grads():
        return ([b.diff.copy() for b, p in zip(bottom, propagate) if p] +
                [p.diff.copy() for p in layer.blobs])

    want = grads()
    keep_b = range(len(bottom)) if layer.retain_inputs is None else layer.retain_inputs
    keep_t = range(len(top)) if layer.retain_outputs is None else layer.retain_outputs
    keep = {id(bottom[j]) for j in keep_b} | {id(top[j]) for j in keep_t}
    for blob in bottom + top:
        if id(blob) not in keep:
            blob.data[...] = np.nan
    for b, p in zip(bottom, propagate):
        if p:
            b.diff[...] = 0
    for t, dy in zip(top, dys):
        t.diff[...] = dy
    for p in layer.blobs:
        p.diff[...] = 0
    layer.backward(top, propagate, bottom)
    got = grads()
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(
            g, w, err_msg=f"{type_name} ({text or 'defaults'}): gradient {k} changed when the "
                          f"data it does not retain was poisoned; its retain_inputs/"
                          f"retain_outputs leave out data its backward reads")
