"""Local pytest setup for the kernel tests.

Registers the ``gpu`` marker (no root pytest configuration exists yet; a
duplicate registration from a later root config is harmless) and provides
the ``cp`` fixture, which skips unless CuPy imports and sees a CUDA device.
"""
import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs CuPy and a CUDA device (skipped otherwise)")


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
