"""minicaffe: Caffe, rebuilt in Python (numpy on the CPU, CuPy on the GPU).

``import minicaffe as caffe`` gives pycaffe's module surface, so pycaffe scripts run with
one changed import line:

- ``Net``, ``TRAIN``/``TEST``, ``layer_type_list()``, ``Classifier``;
- the solvers ``SGDSolver`` ... ``AdamSolver``, ``get_solver(file)`` (from ``.solvers``,
  imported on first use);
- ``set_mode_cpu/gpu``, ``set_device``, ``set_random_seed``, ``solver_count``,
  ``set_solver_count``, ``solver_rank``, ``set_solver_rank``, ``set_multiprocess``;
- ``Layer``: the base class of Python layers (``type: "Python"``);
- ``set_num_threads(n)``/``get_num_threads()``: numpy's BLAS threads (one by default,
  unless OPENBLAS_NUM_THREADS/OMP_NUM_THREADS/MKL_NUM_THREADS say otherwise: threads.py);
- ``Timer``, ``init_log``, ``log`` (``caffe.log("text")`` logs a line; ``caffe.log.info``
  works too), ``has_nccl()``, ``NCCL``, ``__version__``;
- submodules ``io``, ``draw``, ``proto.caffe_pb2``, and NetSpec's ``layers``/``params``
  (``from minicaffe import layers as L, params as P``), ``NetSpec``, ``to_proto``.
"""
__version__ = "0.1.0"

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys
import types as _types

# -- the old flat module paths (before the packages of docs/architecture.md) ----------------
# ``minicaffe.context`` and ``minicaffe.core.context`` are THE SAME module object (one set
# of thread-locals, one allocator, one config table): importing an old path returns the new
# module.  For users' code and old pickles; minicaffe itself imports the new paths.
MOVED = {
    **{f"{__name__}.{m}": f"{__name__}.core.{m}" for m in (
        "backend", "context", "config", "synced_memory", "blob", "filler", "flat_params",
        "log", "errors", "threads", "fileio", "protoio")},
    f"{__name__}.blas": f"{__name__}.kernels.blas",
    f"{__name__}.layer": f"{__name__}.layers.layer",
    f"{__name__}.registry": f"{__name__}.layers.registry",
    **{f"{__name__}.{m}": f"{__name__}.network.{m}" for m in ("net", "upgrade", "upgrade_v0")},
    f"{__name__}.offload": f"{__name__}.engine.offload",
    **{f"{__name__}.{m}": f"{__name__}.multigpu.{m}" for m in (
        "parallel", "parallel_launch", "comm")},
    **{f"{__name__}.{m}": f"{__name__}.compat.{m}" for m in (
        "io", "pycaffe", "net_spec", "draw", "classify", "testing")},
    f"{__name__}.datasets": f"{__name__}.data.datasets",
}


class _MovedModule(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Finds an old path of MOVED and loads it as the new module itself; ``python -m``
    of an old path runs the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return _importlib_util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = _importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__     # the import system sets __spec__: put it back
        return module

    def exec_module(self, module):
        # the new module ran when it was imported; it keeps its own name and spec
        if isinstance(module.__spec__.loader, _MovedModule):
            module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname):   # runpy (python -m minicaffe.draw)
        return compile(f"import runpy\nrunpy.run_module({MOVED[fullname]!r}, "
                       f"run_name='__main__', alter_sys=True)\n", MOVED[fullname], "exec")


if not any(isinstance(f, _MovedModule) for f in _sys.meta_path):
    _sys.meta_path.append(_MovedModule())

from .core import threads as _threads
_threads.apply_default()    # one BLAS thread per process unless asked (threads.py)
from .core.threads import set_num_threads, get_num_threads  # noqa: E402

from .core.context import (set_mode_cpu, set_mode_gpu, set_device, set_random_seed,
                      solver_count, set_solver_count, solver_rank, set_solver_rank,
                      set_multiprocess, root_solver)
from .core.blob import Blob
from .network.net import Net, TRAIN, TEST
from .layers.registry import layer_type_list
from .core.errors import MinicaffeError, ConfigError, LayerError
from .proto import caffe_pb2
from . import proto
from .core import log as _log_module
from .compat.pycaffe import Timer, NCCL, has_nccl
from .compat import io
from .compat import net_spec
from .compat.net_spec import NetSpec, to_proto, params

# Caffe's log(text) is a function and minicaffe.log a module: make the module callable,
# so ``caffe.log("msg")`` and ``from . import log; log.info(...)`` both work.


class _CallableLogModule(_types.ModuleType):
    def __call__(self, message):
        """Log one INFO line, as pycaffe's ``caffe.log(message)``."""
        self.info("%s", message)


_log_module.__class__ = _CallableLogModule
log = _log_module


def init_log(level=None, stderr=True, log_file=None, volume="caffe"):
    """pycaffe's ``init_log()`` / ``init_log(level)`` / ``init_log(level, stderr)``: glog
    levels 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL; logs go to stderr (unless ``stderr`` is
    False) and to ``log_file`` if given.  ``volume``: "caffe" (every INFO line, as Caffe),
    "normal" (the net set-up report only with GLOG_v=1) or "quiet" (progress and results);
    without any ``init_log`` call the Python API logs at "normal" (minicaffe/log.py)."""
    import io as _pyio
    lvl = None
    if level is not None:
        lvl = _log_module._LEVELS.get(int(level))
        if lvl is None:
            raise ValueError(f"init_log: level must be 0 (INFO) .. 3 (FATAL), got {level}")
    stream = None if stderr else _pyio.StringIO()
    _log_module.init_log(lvl, log_file=log_file, stream=stream, volume=volume)


# The layer package doubles as NetSpec's ``layers`` pseudo-module (``L.Convolution(...)``):
# layer types are CamelCase, the family submodules lower case, so they never collide.
from . import layers as _layers_pkg  # noqa: E402  (registers the built-in layers)
from .watch import tensorboard as _tensorboard  # noqa: E402,F401  (registers its solver observer)


class _LayersModule(_types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(net_spec.layers, name)


_layers_pkg.__class__ = _LayersModule
layers = _layers_pkg

# -- names provided by packages other engineers are still writing: imported on first use --
_SOLVER_NAMES = ("Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
                 "AdaDeltaSolver", "AdamSolver", "get_solver")


def _lazy(name):
    # draw and classify are also ``python -m`` entry points: importing them here eagerly
    # would make runpy warn that the module was imported before it ran
    if name == "draw":
        import importlib
        return importlib.import_module(".compat.draw", __name__)
    if name == "Classifier":
        from .compat.classify import Classifier
        return Classifier
    if name in _SOLVER_NAMES:
        try:
            from . import solvers
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.solvers":
                raise
            solvers = None
        value = getattr(solvers, name, None)
        if value is None:
            raise AttributeError(f"minicaffe.{name} is not available: the solvers package "
                                 f"(minicaffe.solvers) does not provide it yet")
        return value
    if name == "Layer":
        try:
            from .layers import python_layer
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.layers.python_layer":
                raise
            python_layer = None
        value = getattr(python_layer, "PythonLayerBase", None)
        if value is None:
            raise AttributeError("minicaffe.Layer (the Python-layer base) is not available: "
                                 "minicaffe.layers.python_layer does not provide it yet")
        return value
    if f"{__name__}.{name}" in MOVED:      # ``minicaffe.context`` without importing it
        return _importlib.import_module(MOVED[f"{__name__}.{name}"])
    raise AttributeError(f"module 'minicaffe' has no attribute '{name}'")


def __getattr__(name):
    value = _lazy(name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_SOLVER_NAMES) | {"Layer", "draw", "Classifier"}
                  | {m.rsplit(".", 1)[1] for m in MOVED})
