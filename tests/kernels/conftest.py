"""Local pytest setup for the kernel tests.

The ``gpu`` marker is declared by the root ``pyproject.toml``; this file only
provides the ``cp`` fixture, which skips unless CuPy imports and sees a CUDA
device.
"""
import pytest


@pytest.fixture(scope="session")
def cp():
    cupy = pytest.importorskip("cupy")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver / no device
        n = 0
    if n < 1:
        pytest.skip("no CUDA device available")
    return cupy
