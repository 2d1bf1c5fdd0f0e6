import os
import pathlib

# Tests use small GEMMs: one BLAS thread is faster than two spinning ones, and it keeps
# the suite steady on CI's 2 cores.  Must be set before numpy loads OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"
FIXTURES = SHARED / "fixtures" / "caffe"
MNIST_DIR = SHARED / "data" / "mnist"


def _gpu_count():
    try:
        from minicaffe import backend
        return backend.gpu_count()
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    n = _gpu_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    skip_multi = pytest.mark.skip(reason="needs at least 2 CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n == 0:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _fresh_manager():
    """Each test starts in CPU mode with Caffe's test seed (1701)."""
    from minicaffe import context
    context.set_mode_cpu()
    context.set_random_seed(1701)
    yield
    context.set_mode_cpu()


@pytest.fixture
def fixtures_dir():
    if not FIXTURES.exists():
        pytest.skip("BVLC fixtures (../shared/fixtures/caffe) not present")
    return FIXTURES


@pytest.fixture
def mnist_dir():
    if not MNIST_DIR.exists():
        pytest.skip("MNIST (../shared/data/mnist) not present")
    return MNIST_DIR
