"""Exact resume: a run resumed from its iteration-K snapshot ends with the same weights, bit
for bit on the CPU, as the run that never stopped.  The solver state carries minicaffe's
ResumeState (SolverState.resume): the training thread's generator (Dropout, DummyData) and
each data layer's position (records read, shuffled orders, the generators of crops and
mirrors), for the train and the test nets.  A solver state Caffe wrote still loads."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from minicaffe.core import protoio
from minicaffe.data.db import array_to_datum, open_db
from minicaffe.proto import caffe_pb2
from minicaffe.solvers import get_solver
from minicaffe.solvers import snapshot as snap
from test_solver_nets import captured_log, messages

REPO = pathlib.Path(__file__).resolve().parents[1]

# Dropout draws from the training thread's generator; the test net reads the same source.
HEAD = """
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param { num_output: 8 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

SOURCES = {
    # 13 records, batches of 3: the cursor wraps; random crops and mirrors
    "lmdb": """layer { name: "data" type: "Data" top: "data" top: "label"
  transform_param { crop_size: 4 mirror: true scale: 0.01 }
  data_param { source: "train_lmdb" backend: LMDB batch_size: 3 } }""",
    # 7 images, shuffled again at each pass
    "images": """layer { name: "data" type: "ImageData" top: "data" top: "label"
  transform_param { mirror: true scale: 0.01 }
  image_data_param { source: "list.txt" batch_size: 3 shuffle: true } }""",
    # two files of 5 and 4 rows, files and rows shuffled
    "hdf5": """layer { name: "data" type: "HDF5Data" top: "data" top: "label"
  hdf5_data_param { source: "h5list.txt" batch_size: 3 shuffle: true } }""",
    # random data drawn by the training thread's generator every forward
    "dummy": """layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 3 dim: 2 dim: 4 dim: 4 } shape { dim: 3 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: 0 max: 2.99 } } }""",
}

SOLVER = """net: "net.prototxt"
test_iter: 2
test_interval: 4
base_lr: 0.1
momentum: 0.9
lr_policy: "fixed"
max_iter: 12
snapshot: 5
snapshot_prefix: "snap/r"
snapshot_format: %s
random_seed: 5
solver_mode: CPU
"""


def _make_data(root):
    rs = np.random.RandomState(0)
    with open_db(str(root / "train_lmdb"), "lmdb", "new") as db:
        t = db.new_transaction()
        for i in range(13):
            img = rs.randint(0, 256, (2, 6, 6)).astype(np.uint8)
            t.put(b"%08d" % i, array_to_datum(img, int(rs.randint(3))).SerializeToString())
        t.commit()
    if _has("PIL"):
        from PIL import Image
        (root / "img").mkdir()
        lines = []
        for i in range(7):
            Image.fromarray(rs.randint(0, 256, (4, 4, 3)).astype(np.uint8)).save(
                root / "img" / f"{i}.png")
            lines.append(f"img/{i}.png {i % 3}")
        (root / "list.txt").write_text("\n".join(lines) + "\n")
    if _has("h5py"):
        import h5py
        for name, n in (("a.h5", 5), ("b.h5", 4)):
            with h5py.File(root / name, "w") as f:
                f["data"] = rs.randn(n, 2, 4, 4).astype(np.float32)
                f["label"] = rs.randint(0, 3, n).astype(np.float32)
        (root / "h5list.txt").write_text("a.h5\nb.h5\n")


def _has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    pytest.importorskip("lmdb")     # the nets read an LMDB (pip install ".[data]")
    monkeypatch.chdir(tmp_path)
    _make_data(tmp_path)
    (tmp_path / "snap").mkdir()
    return tmp_path


def _write(root, source, fmt="BINARYPROTO"):
    (root / "net.prototxt").write_text('name: "r"\n' + SOURCES[source] + HEAD)
    (root / "solver.prototxt").write_text(SOLVER % fmt)


def _weights(path):
    p = protoio.read_binary(str(path), caffe_pb2.NetParameter())
    return {(l.name, i): np.asarray(b.data, np.float32) for l in p.layer
            for i, b in enumerate(l.blobs)}


def _solve(resume_file=None):
    """Train to max_iter (resuming first, if given); the final weights and test scores."""
    s = get_solver("solver.prototxt")
    try:
        s.solve(resume_file)
        return [np.array(b.cpu_data()) for b in s.net.learnable_params], s.mean_scores
    finally:
        for net in [s.net] + s.test_nets:
            net.close()


@pytest.mark.parametrize("source", ["lmdb", "lmdb-2-workers", "images", "hdf5", "dummy"])
def test_resumed_run_ends_with_the_uninterrupted_weights(run_dir, source, monkeypatch):
    if source == "lmdb-2-workers":  # decoded by worker processes (data/workers.py)
        monkeypatch.setenv("MINICAFFE_DECODE_THREADS", "2")
        source = "lmdb"
    if source == "images":
        pytest.importorskip("PIL")
    if source == "hdf5":
        pytest.importorskip("h5py")
    _write(run_dir, source)
    straight, straight_scores = _solve()
    resumed, resumed_scores = _solve("snap/r_iter_5.solverstate")
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)
    assert resumed_scores == straight_scores  # the test net read on where it was, too


def test_hdf5_solver_state_resumes_exactly(run_dir):
    pytest.importorskip("h5py")
    _write(run_dir, "lmdb", "HDF5")
    straight, _ = _solve()
    resumed, _ = _solve("snap/r_iter_5.solverstate.h5")
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)


def test_cli_resume_in_a_new_process_is_exact(run_dir):
    """Without a random_seed too: the state carries the generators."""
    _write(run_dir, "lmdb")
    solver = run_dir / "solver.prototxt"
    solver.write_text(solver.read_text().replace("random_seed: 5\n", ""))
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))  # lmdb may come from the caller's
    cmd = [sys.executable, "-m", "minicaffe", "train", "--solver", "solver.prototxt"]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    straight = _weights("snap/r_iter_12.caffemodel")
    os.remove("snap/r_iter_12.caffemodel")
    r = subprocess.run(cmd + ["--snapshot", "snap/r_iter_5.solverstate"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    resumed = _weights("snap/r_iter_12.caffemodel")
    assert straight.keys() == resumed.keys()
    for k in straight:
        np.testing.assert_array_equal(straight[k], resumed[k], err_msg=str(k))


def test_the_state_holds_generators_and_positions(run_dir):
    _write(run_dir, "lmdb")
    _solve()
    msg = protoio.read_binary("snap/r_iter_5.solverstate", caffe_pb2.SolverState())
    assert msg.HasField("resume") and len(msg.resume.rng.key) == 624
    train, test = sorted(msg.resume.data, key=lambda d: d.net)
    assert (train.net, train.layer, test.net, test.layer) == (0, "data", 1, "data")
    assert train.record == (5 * 3) % 13  # 5 batches of 3 read, the cursor wrapped at 13
    assert test.record == (2 * 2 * 3) % 13  # tests at iterations 0 and 4, 2 batches each
    assert len(train.rng.key) == 624
    # Caffe's reader keeps the fields it knows: the file is still a Caffe solver state
    caffe_fields = caffe_pb2.SolverState()
    caffe_fields.CopyFrom(msg)
    caffe_fields.ClearField("resume")
    assert caffe_fields.iter == 5 and len(caffe_fields.history) == 4


def test_caffe_written_hdf5_state_restores(run_dir):
    """Caffe's SnapshotSolverStateToHDF5: rank-1 one-element iter and current_step, a
    fixed-length learned_net string, history/0..n; no minicaffe_resume."""
    h5py = pytest.importorskip("h5py")
    _write(run_dir, "lmdb", "HDF5")
    s = get_solver("solver.prototxt")
    try:
        s.step(3)
        s.net.save_hdf5("snap/caffe_iter_3.caffemodel.h5")
        with h5py.File("snap/caffe_iter_3.solverstate.h5", "w") as f:
            f.create_dataset("iter", data=np.array([3], np.int32))
            f.create_dataset("current_step", data=np.array([0], np.int32))
            f.create_dataset("learned_net", data=np.bytes_("snap/caffe_iter_3.caffemodel.h5"))
            g = f.create_group("history")
            for i, h in enumerate(s.history):
                g.create_dataset(str(i), data=h.data)
        expect = [b.data.copy() for b in s.net.learnable_params]
    finally:
        for net in [s.net] + s.test_nets:
            net.close()
    s = get_solver("solver.prototxt")
    try:
        with captured_log() as lines:
            s.restore("snap/caffe_iter_3.solverstate.h5")
        assert s.iter == 3
        for a, b in zip(expect, s.net.learnable_params):
            np.testing.assert_array_equal(a, b.data)
        assert any("holds no data positions (written by Caffe?)" in m for m in messages(lines))
    finally:
        for net in [s.net] + s.test_nets:
            net.close()


def test_rng_state_round_trips_through_the_schema():
    rs = np.random.RandomState(3)
    rs.randn(7)  # has_gauss set, a cached gaussian
    state = rs.get_state()
    back = snap.rng_from_proto(snap.rng_to_proto(state, caffe_pb2.RNGState()))
    other = np.random.RandomState(0)
    other.set_state(back)
    np.testing.assert_array_equal(other.randn(5), rs.randn(5))


@pytest.mark.gpu
def test_gpu_resume_reads_on_where_the_run_stopped(run_dir):
    """GPU mode: the prefetch thread uploads batches and records positions the same way.
    The GPU generator is not saved, so the net has no Dropout here; GPU sums may differ
    in the last bits, hence a tolerance."""
    _write(run_dir, "lmdb")
    net = run_dir / "net.prototxt"
    net.write_text(net.read_text().replace(
        'layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" }\n', ""))
    from minicaffe.core import context
    context.set_mode_gpu()  # as `minicaffe train --gpu 0` does (conftest resets it)
    straight, straight_scores = _solve()
    resumed, resumed_scores = _solve("snap/r_iter_5.solverstate")
    for a, b in zip(straight, resumed):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(resumed_scores, straight_scores, rtol=1e-5)
