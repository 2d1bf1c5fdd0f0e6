"""Python layers: ``type: "Python"`` (Caffe's python_layer.hpp and pycaffe's ``caffe.Layer``).

A prototxt names a class in an importable module::

    layer { name: "loss" type: "Python" bottom: "pred" bottom: "label" top: "loss"
            python_param { module: "pyloss" layer: "EuclideanLossLayer" param_str: "..." }
            loss_weight: 1 }

and the module defines it as pycaffe users do::

    import minicaffe as caffe          # caffe.Layer is PythonLayerBase

    class EuclideanLossLayer(caffe.Layer):
        def setup(self, bottom, top): ...                 # once; self.param_str, self.phase set
        def reshape(self, bottom, top): top[0].reshape(1) # before every forward
        def forward(self, bottom, top): top[0].data[...] = ...
        def backward(self, top, propagate_down, bottom): bottom[0].diff[...] = ...

The module is imported when the layer is created (its directory must be on
``sys.path``/``PYTHONPATH``, as with Caffe).  A module that says ``import caffe`` (as
BVLC's do) gets minicaffe when no real caffe is installed (one info line says so).
The blobs a Python layer sees are the net's blobs themselves (:class:`PyBlob`):
``data``/``diff`` are numpy arrays that write through, ``reshape(*shape)``, ``shape``,
``num``/``channels``/``height``/``width`` and ``count`` as a number.  ``self.blobs``
holds the layer's parameters (``self.blobs.add_blob(*shape)`` adds one); they are the
net's learnable parameters, saved to and loaded from ``.caffemodel`` files like any
layer's.

Python layers run on the CPU; in GPU mode the data moves to the host and back, as in
Caffe.  An exception raised by the layer's code reaches the caller as its own type (a
RuntimeError is still a RuntimeError, as pycaffe's tests expect) that is also a
one-line LayerError naming the layer, the method and the file:line where it was
raised (the original exception is its ``__cause__``).  ``share_in_parallel`` is
deprecated and ignored: every solver thread builds its own net, so each gets its own
Python layer object.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import traceback

import numpy as np

from ..core import log
from ..core.blob import Blob
from ..core.errors import MinicaffeError, layer_failure
from .layer import Layer
from ..proto import caffe_pb2
from .registry import register_layer


class PyBlob(Blob):
    """A blob as pycaffe hands it to Python layers.  minicaffe's :class:`Blob` already is
    one (``count`` is both pycaffe's number and Caffe's method), so ``of`` returns the
    blob itself and new parameter blobs are plain Blobs of this class."""

    @classmethod
    def of(cls, blob):
        return blob


class BlobVec(list):
    """pycaffe's ``layer.blobs``: a list of blobs with ``add_blob(*shape)``."""

    dtype = np.float32

    def add_blob(self, *shape):
        """Append a new zero-filled blob of the given shape (the layer's parameter)."""
        if len(shape) == 1 and not np.isscalar(shape[0]):
            shape = tuple(shape[0])
        b = PyBlob(tuple(int(d) for d in shape), self.dtype)
        self.append(b)
        return b


class PythonLayerBase:
    """pycaffe's ``caffe.Layer``: the base class of layers written in Python.

    Override ``setup(bottom, top)`` (called once), ``reshape(bottom, top)`` (before every
    forward; give the tops their shapes), ``forward(bottom, top)`` and, to learn or pass
    gradients, ``backward(top, propagate_down, bottom)``.  Attributes set by the net:
    ``param_str`` (python_param.param_str), ``phase`` (0 TRAIN, 1 TEST), ``blobs``
    (parameter blobs; ``self.blobs.add_blob(*shape)``) and ``layer_param``."""

    type = "Python"

    def __init__(self, layer_param=None):
        self.layer_param = layer_param
        self.param_str = layer_param.python_param.param_str if layer_param is not None else ""
        self.phase = layer_param.phase if layer_param is not None else caffe_pb2.TRAIN
        self.blobs = BlobVec()

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        raise NotImplementedError(f"{type(self).__name__} does not implement forward(bottom, top)")

    def backward(self, top, propagate_down, bottom):
        pass


def _views(blobs):
    return list(blobs)


def _where(exc):
    """' (file:line)' of the innermost frame of the exception's traceback."""
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return ""
    frame = tb[-1]
    return f" ({frame.filename}:{frame.lineno})"


@register_layer("Python")
class PythonLayer(Layer):
    """Runs a user's :class:`PythonLayerBase` subclass named by ``python_param``
    (``module``, ``layer``, ``param_str``).  Its object is ``self.py_layer``; its
    ``blobs`` are this layer's parameter blobs."""

    def __getattr__(self, name):
        """pycaffe's ``net.layers[i]`` is the user's object; attributes this wrapper does
        not have are looked up on it."""
        obj = self.__dict__.get("py_layer")
        if obj is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(obj, name)

    def __init__(self, param):
        self.py_layer = None
        self._pending_blobs = []
        super().__init__(param)
        pp = param.python_param
        if not pp.module or not pp.layer:
            raise self.error("python_param needs both 'module' and 'layer' "
                             f"(got module '{pp.module}', layer '{pp.layer}')")
        serve_caffe_import()
        try:
            module = importlib.import_module(pp.module)
        except Exception as e:
            hint = ""
            if isinstance(e, ModuleNotFoundError) and e.name == pp.module.split(".")[0]:
                hint = "; is its directory on PYTHONPATH?"
            raise self.error(f"cannot import module '{pp.module}' "
                             f"({type(e).__name__}: {_one_line(e)}{_where(e)}){hint}") from e
        cls = getattr(module, pp.layer, None)
        if cls is None or not isinstance(cls, type):
            where = getattr(module, "__file__", None) or pp.module
            raise self.error(f"module '{pp.module}' ({where}) has no layer class '{pp.layer}'")
        for method in ("setup", "reshape", "forward"):
            if not callable(getattr(cls, method, None)):
                raise self.error(f"{pp.module}.{pp.layer} has no {method}() method "
                                 f"(derive it from caffe.Layer)")
        try:
            obj = cls(param)
        except Exception as e:
            raise self.error(f"creating {pp.module}.{pp.layer} failed: {type(e).__name__}: "
                             f"{_one_line(e)}{_where(e)}") from e
        obj.layer_param = param
        obj.param_str = pp.param_str
        obj.phase = param.phase
        if not isinstance(getattr(obj, "blobs", None), BlobVec):
            obj.blobs = BlobVec()
        obj.blobs[:] = _views(self._pending_blobs)
        self.py_layer = obj
        self._pending_blobs = None

    # The layer's parameter blobs are the Python object's ``blobs``.
    @property
    def blobs(self):
        return self.py_layer.blobs if self.py_layer is not None else self._pending_blobs

    @blobs.setter
    def blobs(self, value):
        if self.py_layer is None:
            self._pending_blobs = list(value)
        else:
            self.py_layer.blobs[:] = _views(value)

    def _call(self, method, *args):
        try:
            return getattr(self.py_layer, method)(*args)
        except MinicaffeError:
            raise
        except Exception as e:  # its own type still, with the layer named (pycaffe)
            raise layer_failure(self.name, self.type, e, f"{method}() raised "
                                f"{type(e).__name__}: {_one_line(e)}{_where(e)}") from e

    def layer_setup(self, bottom, top):
        obj = self.py_layer
        obj.param_str = self.layer_param.python_param.param_str
        obj.phase = self.phase
        obj.blobs.dtype = bottom[0].dtype if bottom else np.float32
        self._call("setup", _views(bottom), _views(top))
        self.param_propagate_down = [True] * len(obj.blobs)

    def reshape(self, bottom, top):
        self._call("reshape", _views(bottom), _views(top))

    def forward_cpu(self, bottom, top):
        self._call("forward", _views(bottom), _views(top))

    def backward_cpu(self, top, propagate_down, bottom):
        if not callable(getattr(self.py_layer, "backward", None)):
            return
        self._call("backward", _views(top), [bool(p) for p in propagate_down], _views(bottom))

    def __repr__(self):
        pp = self.layer_param.python_param
        return f"<PythonLayer '{self.name}' {pp.module}.{pp.layer}>"


class _MinicaffeAsCaffe(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import caffe`` and ``import caffe.X`` with minicaffe's own module objects
    (installed only where no real caffe is importable; first on sys.meta_path, so that
    ``caffe.proto`` is minicaffe's module, not a second copy of it)."""

    said = False

    def find_spec(self, name, path=None, target=None):
        if name != "caffe" and not name.startswith("caffe."):
            return None
        try:
            importlib.util.find_spec("mini" + name)
        except ImportError:
            return None
        if not self.said:
            log.info("No caffe module is installed: 'import caffe' gets minicaffe")
            self.said = True
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        module = importlib.import_module("mini" + spec.name)
        self._spec = module.__spec__   # the import system sets the alias's spec on it
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec


def serve_caffe_import():
    """BVLC's Python layer modules (``examples/pycaffe/pyloss.py``) say ``import caffe``:
    when no real caffe is importable, that import gets minicaffe (said in one info line)."""
    if any(isinstance(f, _MinicaffeAsCaffe) for f in sys.meta_path):
        return
    if "caffe" in sys.modules or importlib.util.find_spec("caffe") is not None:
        return
    sys.meta_path.insert(0, _MinicaffeAsCaffe())


def _one_line(e):
    return " ".join(str(e).split()) or type(e).__name__
