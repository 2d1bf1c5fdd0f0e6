"""Process-wide GPU engine switches.

``tf32``: let cuDNN and cuBLAS use TensorFloat-32 tensor cores for float32 (faster,
about 1e-3 relative error).  Off by default: strict fp32 (cuDNN's FMA math mode,
cuBLAS's default math), the same numbers a CPU would give up to summation order.

``deterministic``: choose only cuDNN algorithms that give bit-identical results run to
run (some backward algorithms use atomics).  Off by default, as in Caffe and PyTorch;
tests that compare runs bit for bit switch it on.

``cudnn``: False forbids the cuDNN engine (every layer takes Caffe's engine), as if cuDNN
were not installed.

Set them before the nets are built: layers read them when they choose algorithms.
``MINICAFFE_TF32=1``, ``MINICAFFE_DETERMINISTIC=1`` and ``MINICAFFE_CUDNN=0`` set them
from the environment.
"""
import os


def _env(name, default):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


tf32 = _env("MINICAFFE_TF32", False)
deterministic = _env("MINICAFFE_DETERMINISTIC", False)
cudnn = _env("MINICAFFE_CUDNN", True)


def set_tf32(on):
    global tf32
    tf32 = bool(on)


def set_deterministic(on):
    global deterministic
    deterministic = bool(on)


def set_cudnn(on):
    global cudnn
    cudnn = bool(on)


def describe():
    """One line for logs and benchmark headers."""
    return (f"fp32 {'with TF32' if tf32 else 'strict (TF32 off)'}, "
            f"{'deterministic' if deterministic else 'fastest'} algorithms")
