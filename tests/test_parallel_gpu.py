"""Multi-GPU training with real NCCL (marked multi_gpu: skipped without 2 GPUs).

Thread mode through the Python API, process mode through the CLI (``--parallel process``),
equivalence with one GPU at the same global batch, LeNet's learning curve, failure
propagation with real communicators (no rank may hang), and SIGINT -> one snapshot."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from minicaffe.core import backend, context, protoio
from minicaffe.multigpu import parallel
from minicaffe.proto import caffe_pb2

from test_parallel import (assert_same_weights, make_db, single_rank, solver_param, weights)

pytestmark = pytest.mark.multi_gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpus_or_skip(n):
    if backend.gpu_count() < n:
        pytest.skip(f"needs {n} GPUs")
    from minicaffe.multigpu.comm import nccl_module
    if nccl_module() is None:
        pytest.skip("CuPy has no NCCL")
    return list(range(n))


@pytest.fixture
def gpu0():
    context.set_device(0)
    context.set_mode_gpu()
    yield
    context.set_mode_cpu()


def assert_gpu_close(a, b):
    # fp32 on GPUs: summation order differs between one GPU and an NCCL all-reduce
    assert_same_weights(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [2, 4])
def test_nccl_threads_equal_one_gpu_at_the_same_global_batch(tmp_path, gpu0, n):
    gpus = gpus_or_skip(n)
    param = solver_param(tmp_path, batch=12, max_iter=8, extra="reduce_buckets: 3")
    ref_w, ref_scores, _ = single_rank(param)
    m = parallel.train_threads(param, gpus)
    root = m.syncs[0].solver
    assert root.iter == 8 and root.net.blobs["data"].shape[0] == 12 // n
    assert_gpu_close(weights(root.net), ref_w)
    for s in m.syncs[1:]:       # identical reduced gradients: identical weights
        for k, v in weights(s.solver.net).items():
            for x, y in zip(v, weights(root.net)[k]):
                np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(root.mean_scores[0], ref_scores[0], rtol=1e-3, atol=1e-4)
    assert all(r > 0 for r in m.rates)


def test_nccl_threads_with_clipping_and_iter_size(tmp_path, gpu0):
    gpus = gpus_or_skip(2)
    param = solver_param(tmp_path, batch=6, max_iter=6, extra="clip_gradients: 0.05 iter_size: 2")
    ref_w, _, _ = single_rank(param)
    m = parallel.train_threads(param, gpus)
    assert_gpu_close(weights(m.syncs[0].solver.net), ref_w)


def test_nccl_failure_in_one_rank_ends_every_rank(tmp_path, gpu0, monkeypatch, finishes):
    gpus = gpus_or_skip(2)
    param = solver_param(tmp_path, max_iter=3000, test_interval=0)
    param.ClearField("test_iter")
    # the host side of every iteration (a replayed graph runs no per-layer hook)
    orig = parallel.P2PSync.agree

    def agree(self):
        if self.rank == 1 and self.solver.iter == 20:
            raise RuntimeError("injected after backward")
        orig(self)
    monkeypatch.setattr(parallel.P2PSync, "agree", agree)
    with finishes():
        with pytest.raises(parallel.ParallelError,
                           match="^rank 1 \\(GPU 1\\): RuntimeError: injected after backward$"):
            parallel.train_threads(param, gpus)


# -- process mode through the CLI ----------------------------------------------------------------
def write_solver(tmp_path, param, name):
    path = tmp_path / name
    param.solver_mode = caffe_pb2.SolverParameter.GPU
    protoio.write_text(str(path), param)
    return str(path)


def run_cli(args, tmp_path, timeout=300, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "minicaffe", "train"] + args, cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=timeout, **kw)


def final_weights(prefix, it):
    p = protoio.read_binary(f"{prefix}_iter_{it}.caffemodel", caffe_pb2.NetParameter())
    return {l.name: [np.asarray(b.data, np.float32) for b in l.blobs] for l in p.layer if l.blobs}


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_cli_multi_gpu_equals_one_gpu(tmp_path, mode):
    gpus_or_skip(2)
    param = solver_param(tmp_path, batch=12, max_iter=8)
    param.snapshot_after_train = True
    param.snapshot_prefix = str(tmp_path / "one")
    one = write_solver(tmp_path, param, "one.prototxt")
    param.snapshot_prefix = str(tmp_path / "two")
    two = write_solver(tmp_path, param, "two.prototxt")
    r1 = run_cli(["--solver", one, "--gpu", "0"], tmp_path)
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run_cli(["--solver", two, "--gpu", "0,1", "--parallel", mode], tmp_path)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "P2PManager: total" in r2.stderr
    assert_gpu_close(final_weights(tmp_path / "two", 8), final_weights(tmp_path / "one", 8))


def test_cli_process_mode_data_error_is_one_line_and_no_rank_hangs(tmp_path):
    gpus_or_skip(2)
    db = make_db(tmp_path / "bad_db", bad={9})           # record 9 is rank 1's
    param = solver_param(tmp_path, db=db, max_iter=1000, test_interval=0)
    param.ClearField("test_iter")
    s = write_solver(tmp_path, param, "bad.prototxt")
    # liveness: run_cli's timeout ends a hang (TimeoutExpired fails the test)
    r = run_cli(["--solver", s, "--gpu", "0,1", "--parallel", "process"], tmp_path, timeout=300)
    errors = [l for l in r.stderr.splitlines() if l.startswith("minicaffe: error")]
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("minicaffe: error: rank 1 (GPU 1): ") and "00000009" in errors[0]


def test_cli_sigint_snapshot_once_from_the_root(tmp_path):
    gpus_or_skip(2)
    param = solver_param(tmp_path, max_iter=3000, test_interval=0)
    param.ClearField("test_iter")
    param.display = 100
    param.snapshot_prefix = str(tmp_path / "snap")
    s = write_solver(tmp_path, param, "s.prototxt")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOG_minloglevel="0")
    p = subprocess.Popen([sys.executable, "-m", "minicaffe", "train", "--solver", s, "--gpu",
                          "0,1", "--parallel", "process", "--sigint_effect", "snapshot"],
                         cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in p.stderr:               # wait for training to run, then Ctrl-C
        lines.append(line)
        if "Iteration 200" in line:
            p.send_signal(signal.SIGINT)
            break
    rest, _ = p.communicate(timeout=300)
    assert p.returncode == 0, "".join(lines) + rest
    snaps = [f for f in os.listdir(tmp_path) if f.startswith("snap_") and
             f.endswith(".caffemodel")]
    assert len(snaps) == 1 and "snap_iter_3000.caffemodel" not in snaps, snaps


def test_lenet_on_all_gpus_learns(tmp_path, mnist_dir):
    """Caffe's LeNet recipe for 1,000 iterations with --gpu all (the global batch of 64
    divided among the GPUs): the test accuracy gets past 0.97 (1 GPU: about 0.98)."""
    gpus_or_skip(2)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MINICAFFE_MNIST_DIR=str(mnist_dir))
    log_file = tmp_path / "lenet.log"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "mnist", "train_lenet.py"),
                        "--max_iter", "1000", "--gpu", "all", "--log", str(log_file)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    acc = [float(l.rsplit("=", 1)[1]) for l in log_file.read_text().splitlines()
           if "Test net output #0: accuracy" in l]
    assert acc and acc[-1] > 0.97, acc


def test_processes_started_by_hand_equal_one_gpu(tmp_path):
    gpus_or_skip(2)
    param = solver_param(tmp_path, batch=12, max_iter=8)
    param.snapshot_after_train = True
    param.snapshot_prefix = str(tmp_path / "one")
    one = write_solver(tmp_path, param, "one.prototxt")
    param.snapshot_prefix = str(tmp_path / "two")
    two = write_solver(tmp_path, param, "two.prototxt")
    assert run_cli(["--solver", one, "--gpu", "0"], tmp_path).returncode == 0
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    init = str(tmp_path / "run.id")
    procs = [subprocess.Popen([sys.executable, "-m", "minicaffe", "train", "--solver", two,
                               "--gpu", str(r), "--rank", str(r), "--world_size", "2",
                               "--init_file", init], cwd=tmp_path, env=env,
                              stderr=subprocess.PIPE, text=True) for r in (1, 0)]
    outs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert_gpu_close(final_weights(tmp_path / "two", 8), final_weights(tmp_path / "one", 8))


def test_mpirun_ranks_equal_one_gpu(tmp_path):
    import shutil
    gpus_or_skip(2)
    pytest.importorskip("mpi4py")
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun")
    param = solver_param(tmp_path, batch=12, max_iter=8)
    param.snapshot_after_train = True
    param.snapshot_prefix = str(tmp_path / "one")
    one = write_solver(tmp_path, param, "one.prototxt")
    param.snapshot_prefix = str(tmp_path / "two")
    two = write_solver(tmp_path, param, "two.prototxt")
    assert run_cli(["--solver", one, "--gpu", "0"], tmp_path).returncode == 0
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run(["mpirun", "-np", "2", sys.executable, "-m", "minicaffe", "train",
                        "--solver", two, "--gpu", "0,1"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_gpu_close(final_weights(tmp_path / "two", 8), final_weights(tmp_path / "one", 8))
