"""Finding and loading the CUDA libraries minicaffe calls through ctypes.

cuBLAS: the copy CuPy already loaded (so that one process holds one cuBLAS), else pip's
``nvidia-cublas*`` wheel, else the system's.  cuDNN: ``MINICAFFE_CUDNN_LIBRARY`` if set,
else a copy already in the process (PyTorch's, say), else pip's ``nvidia-cudnn-cu12/13``
wheel, else the system's ``libcudnn.so.9``/``.8``.  Each loader returns ``(CDLL, path)`` or
raises ``OSError`` saying where it looked.
"""
import ctypes
import glob
import importlib.util
import os

from ..core import config

_cache = {}


def _loaded_in_process(stem):
    """Paths of shared objects named ``stem*`` mapped into this process."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                base = os.path.basename(path)
                if base.startswith(stem + ".so") and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _pip_dirs(package):
    """``site-packages/nvidia/<package>/lib`` folders of pip's NVIDIA wheels."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [os.path.join(p, package, "lib") for p in spec.submodule_search_locations
            if os.path.isdir(os.path.join(p, package, "lib"))]


def _try(paths, tried):
    for p in paths:
        tried.append(p)
        try:
            return ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL), p
        except OSError:
            continue
    return None


def load_cublas():
    if "cublas" in _cache:
        return _cache["cublas"]
    tried = []
    from ..core import backend
    if backend.cp is not None:
        try:  # makes CuPy load its libcublas, which we then share
            backend.cp.cuda.device.get_cublas_handle()
        except Exception:
            pass
    cands = _loaded_in_process("libcublas")
    for d in _pip_dirs("cublas"):
        cands += sorted(glob.glob(os.path.join(d, "libcublas.so.*")), reverse=True)
    cands += ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    r = _try([c for c in cands if "Lt" not in os.path.basename(c)], tried)
    if r is None:
        raise OSError("libcublas not found (tried: " + ", ".join(tried) + ")")
    _cache["cublas"] = r
    return r


def load_cudnn():
    if "cudnn" in _cache:
        return _cache["cudnn"]
    tried = []
    cands = []
    env = config.env("MINICAFFE_CUDNN_LIBRARY")
    if env:
        cands.append(env)
    cands += _loaded_in_process("libcudnn")
    cands = [c for c in cands if os.path.basename(c).startswith("libcudnn.so")]
    for d in _pip_dirs("cudnn"):
        cands += sorted(glob.glob(os.path.join(d, "libcudnn.so.*")), reverse=True)
    cands += ["libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"]
    r = _try(cands, tried)
    if r is None:
        raise OSError("libcudnn not found (tried: " + ", ".join(tried) + "); install "
                      "pip's nvidia-cudnn wheel (pip install nvidia-cudnn-cu12, or -cu13)")
    _cache["cudnn"] = r
    return r
