"""Python layers (type "Python"): pycaffe's Layer API, parameters, gradients, use in a
Net, and one-line errors for modules and classes that are missing or broken."""
import textwrap

import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.blob import Blob
from minicaffe.core.errors import LayerError
from minicaffe.layers.python_layer import PyBlob, PythonLayerBase
from minicaffe.proto import caffe_pb2
from minicaffe.compat.testing import check_gradient, make_blob, make_layer

MODULE = '''
import numpy as np
from minicaffe.layers.python_layer import PythonLayerBase as Layer


class EuclideanLossLayer(Layer):
    """Caffe's examples/pycaffe/layers/pyloss.py, as pycaffe users write it."""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("Need two inputs to compute distance.")

    def reshape(self, bottom, top):
        if bottom[0].count != bottom[1].count:
            raise Exception("Inputs must have the same dimension.")
        self.diff = np.zeros_like(bottom[0].data, dtype=np.float64)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = np.sum(self.diff ** 2) / bottom[0].num / 2.

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if not propagate_down[i]:
                continue
            sign = 1 if i == 0 else -1
            bottom[i].diff[...] = sign * self.diff / bottom[i].num * top[0].diff[0]


class LearnedScale(Layer):
    """y = x * w + b with per-channel w (filled from param_str) and b."""

    def setup(self, bottom, top):
        self.init = float(eval(self.param_str)["init"]) if self.param_str else 1.0
        self.blobs.add_blob(bottom[0].channels)
        self.blobs.add_blob(bottom[0].channels)
        self.blobs[0].data[...] = self.init
        self.seen_phase = self.phase

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        w = self.blobs[0].data[None, :, None]
        b = self.blobs[1].data[None, :, None]
        top[0].data[...] = bottom[0].data * w + b

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        self.blobs[0].diff[...] += (dy * bottom[0].data).sum(axis=(0, 2))
        self.blobs[1].diff[...] += dy.sum(axis=(0, 2))
        if propagate_down[0]:
            bottom[0].diff[...] = dy * self.blobs[0].data[None, :, None]


class Broken(Layer):
    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        raise ValueError("something\\nwent wrong")


class NoForward(Layer):
    pass


class NotALayer:
    pass


NOT_A_CLASS = 3
'''


@pytest.fixture
def pymod(tmp_path, monkeypatch):
    name = f"mc_pylayers_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / f"{name}_bad.py").write_text("def oops(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def py_text(module, cls, param_str=None, extra=""):
    ps = f' param_str: "{param_str}"' if param_str else ""
    return f'type: "Python" python_param {{ module: "{module}" layer: "{cls}"{ps} }} {extra}'


def blob(values, dtype=np.float64):
    values = np.asarray(values)
    return make_blob(values.shape, dtype=dtype, values=values)


def test_euclidean_python_loss_matches_builtin_and_gradient(pymod):
    rs = np.random.RandomState(0)
    a, b = blob(rs.randn(4, 5)), blob(rs.randn(4, 5))
    layer = make_layer(py_text(pymod, "EuclideanLossLayer", extra="loss_weight: 1"))
    top = [Blob(dtype=np.float64)]
    layer.setup([a, b], top)
    assert top[0].shape == (1,)
    loss = layer.forward([a, b], top)
    builtin = make_layer('type: "EuclideanLoss"')
    t2 = [Blob(dtype=np.float64)]
    builtin.setup([a, b], t2)
    assert loss == pytest.approx(builtin.forward([a, b], t2), rel=1e-12)
    assert check_gradient(layer, [a, b], top, setup=False) == 40


def test_loss_weight_scales_python_loss(pymod):
    rs = np.random.RandomState(1)
    a, b = blob(rs.randn(3, 2)), blob(rs.randn(3, 2))
    results = []
    for w in (1, 2):
        layer = make_layer(py_text(pymod, "EuclideanLossLayer", extra=f"loss_weight: {w}"))
        top = [Blob(dtype=np.float64)]
        layer.setup([a, b], top)
        loss = layer.forward([a, b], top)
        layer.backward(top, [True, False], [a, b])
        results.append((loss, a.diff.copy()))
    assert results[1][0] == pytest.approx(2 * results[0][0])
    np.testing.assert_allclose(results[1][1], 2 * results[0][1])


def test_params_param_str_phase_and_gradient(pymod):
    rs = np.random.RandomState(2)
    x = blob(rs.randn(2, 3, 4))
    layer = make_layer(py_text(pymod, "LearnedScale", "{'init': 2.5}"), phase=caffe_pb2.TEST)
    top = [Blob(dtype=np.float64)]
    layer.setup([x], top)
    impl = layer.py_layer
    assert impl.param_str == "{'init': 2.5}" and impl.seen_phase == caffe_pb2.TEST
    assert layer.blobs is impl.blobs and len(layer.blobs) == 2
    assert all(isinstance(b, Blob) for b in layer.blobs)
    assert layer.blobs[0].dtype == np.float64 and (layer.blobs[0].data == 2.5).all()
    layer.forward([x], top)
    np.testing.assert_allclose(top[0].data, 2.5 * x.data)
    layer.blobs[1].data[...] = rs.randn(3)
    n = check_gradient(layer, [x], top, setup=False)
    assert n == x.count() + 6


def test_propagate_down_and_param_accumulation(pymod):
    x = blob(np.ones((1, 2, 3)))
    layer = make_layer(py_text(pymod, "LearnedScale"))
    top = [Blob(dtype=np.float64)]
    layer.setup([x], top)
    layer.forward([x], top)
    top[0].diff[...] = 1.0
    x.diff[...] = 9.0
    layer.backward(top, [False], [x])
    layer.backward(top, [False], [x])
    assert (x.diff == 9.0).all()
    np.testing.assert_allclose(layer.blobs[0].diff, [6.0, 6.0])


def test_pyblob_is_a_pycaffe_view():
    b = Blob((2, 3, 4), np.float32)
    v = PyBlob.of(b)
    assert v.count == 24 and v.count(1) == 12 and v.count(1, 2) == 3
    assert v.num == 2 and v.channels == 3 and v.shape == (2, 3, 4)
    v.reshape(4, 6)
    assert b.shape == (4, 6) and b.count() == 24
    v.data[...] = 3
    assert (b.data == 3).all()
    b.diff[...] = 1
    assert (v.diff == 1).all()
    assert PyBlob.of(v) is v


NET = """
name: "pynet"
layer { name: "data" type: "Input" top: "x" top: "t"
        input_param { shape { dim: 2 dim: 3 dim: 4 } shape { dim: 2 dim: 3 dim: 4 } } }
layer { name: "scale" type: "Python" bottom: "x" top: "y"
        python_param { module: "MOD" layer: "LearnedScale" param_str: "{'init': 0.5}" } }
layer { name: "loss" type: "Python" bottom: "y" bottom: "t" top: "loss"
        python_param { module: "MOD" layer: "EuclideanLossLayer" } loss_weight: 1 }
"""


def test_python_layers_in_a_net_learn_save_and_load(pymod, tmp_path):
    from minicaffe.network.net import Net, TRAIN
    path = tmp_path / "net.prototxt"
    path.write_text(NET.replace("MOD", pymod))
    net = Net(str(path), TRAIN)
    assert [b.shape for b in net.params["scale"]] == [(3,), (3,)]
    rs = np.random.RandomState(3)
    net.blobs["x"].data[...] = rs.randn(2, 3, 4)
    net.blobs["t"].data[...] = 2 * net.blobs["x"].data + 1
    losses = []
    for _ in range(200):
        net.clear_param_diffs()
        losses.append(net.forward_backward())
        for b in net.learnable_params:
            b.data[...] -= 0.2 * b.diff
    assert losses[-1] < 1e-3 * losses[0]
    np.testing.assert_allclose(net.params["scale"][0].data, 2.0, atol=0.05)
    weights = tmp_path / "net.caffemodel"
    net.save(str(weights))
    net2 = Net(str(path), TRAIN, weights=str(weights))
    np.testing.assert_array_equal(net2.params["scale"][0].data, net.params["scale"][0].data)


@pytest.mark.parametrize("cls,match", [
    ("Missing", "has no layer class 'Missing'"),
    ("NOT_A_CLASS", "has no layer class 'NOT_A_CLASS'"),
    ("NotALayer", r"has no setup\(\) method"),
])
def test_bad_class_is_one_line_error(pymod, cls, match):
    with pytest.raises(LayerError, match=match) as e:
        make_layer(py_text(pymod, cls))
    assert "\n" not in str(e.value) and "(Python)" in str(e.value)


def test_missing_module_is_one_line_error():
    with pytest.raises(LayerError, match="cannot import module 'mc_no_such_module_xyz'.*"
                                         "PYTHONPATH") as e:
        make_layer(py_text("mc_no_such_module_xyz", "Layer"))
    assert "\n" not in str(e.value)


def test_module_with_syntax_error_is_one_line_error(pymod):
    with pytest.raises(LayerError, match="cannot import module .*SyntaxError") as e:
        make_layer(py_text(pymod + "_bad", "Layer"))
    assert "\n" not in str(e.value)


def test_missing_python_param_is_refused():
    with pytest.raises(LayerError, match="needs both 'module' and 'layer'"):
        make_layer('type: "Python"')


def test_exception_in_forward_names_layer_method_and_line(pymod):
    x = blob(np.zeros((2, 2)))
    layer = make_layer(py_text(pymod, "Broken"))
    top = [Blob(dtype=np.float64)]
    layer.setup([x], top)
    with pytest.raises(LayerError, match=r"forward\(\) raised ValueError: something went "
                                         r"wrong \(.*mc_pylayers_.*\.py:\d+\)") as e:
        layer.forward([x], top)
    assert "\n" not in str(e.value)
    assert isinstance(e.value.__cause__, ValueError)


def test_exception_in_forward_keeps_its_type(pymod):
    x = blob(np.zeros((2, 2)))
    layer = make_layer(py_text(pymod, "Broken"))
    top = [Blob(dtype=np.float64)]
    layer.setup([x], top)
    with pytest.raises(ValueError, match=r"layer '.*' \(Python\): forward\(\) raised ValueError"):
        layer.forward([x], top)


def test_layer_without_forward(pymod):
    x = blob(np.zeros((2, 2)))
    layer = make_layer(py_text(pymod, "NoForward"))
    top = [Blob(dtype=np.float64)]
    layer.setup([x], top)
    with pytest.raises(LayerError, match="NotImplementedError: NoForward does not implement"):
        layer.forward([x], top)


def test_base_class_is_caffe_layer():
    minicaffe = pytest.importorskip("minicaffe")
    try:
        base = minicaffe.Layer
    except AttributeError:
        pytest.skip("minicaffe.Layer not exported")
    assert base is PythonLayerBase
    obj = PythonLayerBase()
    assert obj.param_str == "" and obj.phase == caffe_pb2.TRAIN and obj.blobs == []
    assert obj.type == "Python"


@pytest.mark.gpu
def test_python_layer_in_gpu_mode(pymod):
    rs = np.random.RandomState(4)
    values = rs.randn(2, 3, 4)
    results = []
    for gpu in (False, True):
        if gpu:
            context.set_mode_gpu()
        x = make_blob(values.shape, dtype=np.float32, values=values)
        layer = make_layer(py_text(pymod, "LearnedScale", "{'init': 1.5}"))
        top = [Blob(dtype=np.float32)]
        layer.setup([x], top)
        layer.forward([x], top)
        top[0].diff[...] = 1.0
        layer.backward(top, [True], [x])
        results.append((top[0].data.copy(), x.diff.copy(), layer.blobs[0].diff.copy()))
        context.set_mode_cpu()
    for c, g in zip(*results):
        np.testing.assert_allclose(g, c, rtol=1e-6)


def test_user_attributes_reachable_through_the_net_layer(tmp_path, monkeypatch):
    mod = tmp_path / "attr_layer_mod.py"
    mod.write_text(
        "import minicaffe as caffe\n"
        "class L(caffe.Layer):\n"
        "    def setup(self, bottom, top):\n"
        "        self.greeting = 'hi ' + self.param_str\n"
        "    def reshape(self, bottom, top):\n"
        "        top[0].reshape(*bottom[0].data.shape)\n"
        "    def forward(self, bottom, top):\n"
        "        top[0].data[...] = bottom[0].data\n"
        "    def backward(self, top, propagate_down, bottom):\n"
        "        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from minicaffe.compat.testing import make_layer
    layer = make_layer('type: "Python" python_param { module: "attr_layer_mod" layer: "L" '
                       'param_str: "there" }')
    x = Blob((2,), np.float32)
    layer.setup([x], [Blob((), np.float32)])
    assert layer.greeting == "hi there"
    with pytest.raises(AttributeError):
        layer.no_such_attribute


# -- pycaffe's own Python-layer files ---------------------------------------------------------
CAFFE_MODULE = '''
import caffe                       # as BVLC's examples/pycaffe/layers/pyloss.py says
from caffe.proto import caffe_pb2


class ExceptionLayer(caffe.Layer):
    """BVLC's python/caffe/test/test_python_layer.py: setup raises RuntimeError."""

    def setup(self, bottom, top):
        raise RuntimeError


class Twice(caffe.Layer):
    def setup(self, bottom, top):
        assert caffe_pb2.TEST == caffe.TEST

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 2 * bottom[0].data
'''

CAFFE_NET = """name: 'pythonnet' force_backward: true
input: 'data' input_shape { dim: 2 dim: 3 }
layer { type: 'Python' name: 'one' bottom: 'data' top: 'one'
  python_param { module: 'MOD' layer: 'LAYER' } }
"""


@pytest.fixture
def caffe_module(tmp_path, monkeypatch):
    """A module that imports caffe; sys.meta_path and sys.modules are restored after."""
    import sys
    name = f"mc_caffe_layers_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(CAFFE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path  # minicaffe's caffe alias
                                           if type(f).__module__ != "minicaffe.layers.python_layer"])
    saved = {m: sys.modules.pop(m) for m in list(sys.modules)
             if m == "caffe" or m.startswith("caffe.")}
    yield name
    for m in list(sys.modules):
        if m == "caffe" or m.startswith("caffe.") or m == name:
            del sys.modules[m]
    sys.modules.update(saved)


def _net_file(tmp_path, module, layer):
    path = tmp_path / f"{layer}.prototxt"
    path.write_text(CAFFE_NET.replace("MOD", module).replace("LAYER", layer))
    return str(path)


def test_module_that_imports_caffe_gets_minicaffe(caffe_module, tmp_path):
    import minicaffe
    from test_solver_nets import captured_log
    with captured_log() as lines:
        net = minicaffe.Net(_net_file(tmp_path, caffe_module, "Twice"), minicaffe.TEST)
    net.blobs["data"].data[...] = 1.5
    np.testing.assert_array_equal(net.forward()["one"], 3.0)
    assert sum("'import caffe' gets minicaffe" in l for l in lines) == 1


def test_python_layer_exception_keeps_its_type(caffe_module, tmp_path):
    """BVLC's test_python_layer.test_exception: assertRaises(RuntimeError, caffe.Net, ...)."""
    import minicaffe
    with pytest.raises(RuntimeError, match=r"layer 'one' \(Python\): setup\(\) raised "
                                           r"RuntimeError") as e:
        minicaffe.Net(_net_file(tmp_path, caffe_module, "ExceptionLayer"), minicaffe.TEST)
    assert isinstance(e.value, LayerError) and "\n" not in str(e.value)
