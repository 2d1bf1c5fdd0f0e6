"""Process-wide GPU engine defaults.

``tf32``: let cuDNN and cuBLAS use TensorFloat-32 tensor cores for float32 (faster,
about 1e-3 relative error).  Off by default: strict fp32 (cuDNN's FMA math mode,
cuBLAS's default math), the same numbers a CPU would give up to summation order.  This is
the default of nets built without a RunConfig saying otherwise (``config.RunConfig.tf32``:
a solver's ``minicaffe_precision`` or the CLI's ``--tf32`` set it for that run's nets only).

``deterministic``: choose only cuDNN algorithms that give bit-identical results run to
run (some backward algorithms use atomics).  Off by default, as in Caffe and PyTorch;
tests that compare runs bit for bit switch it on.

``cudnn``: False forbids the cuDNN engine (every layer takes Caffe's engine), as if cuDNN
were not installed.

Set them before the nets are built: layers read them when they choose algorithms.
``MINICAFFE_TF32``, ``MINICAFFE_DETERMINISTIC`` and ``MINICAFFE_CUDNN`` give their initial
values (read, and validated, by ``config.env`` on first use).  The values themselves are
kept by ``core/config.py`` (``config.default``/``set_default``), which a RunConfig reads
without importing gpu/.
"""
from ..core import config


def __getattr__(name):        # options.tf32 etc.: from the environment on first use
    if name in ("tf32", "deterministic", "cudnn"):
        return config.default(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_tf32(on):
    config.set_default("tf32", on)


def set_deterministic(on):
    config.set_default("deterministic", on)


def set_cudnn(on):
    config.set_default("cudnn", on)


def describe(tf32=None):
    """One line for logs and benchmark headers (``tf32``: a run's, else the default)."""
    tf32 = __getattr__("tf32") if tf32 is None else tf32
    det = __getattr__("deterministic")
    return (f"fp32 {'with TF32' if tf32 else 'strict (TF32 off)'}, "
            f"{'deterministic' if det else 'fastest'} algorithms")
