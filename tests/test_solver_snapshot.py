"""Snapshots: file names, both formats, atomic writes, and restores that continue
training exactly (in a new process), plus BVLC's LeNet .solverstate."""
import os
import pathlib
import stat
import subprocess
import sys

import numpy as np
import pytest

from minicaffe.core import protoio
from minicaffe.core.errors import MinicaffeError
from minicaffe.proto import caffe_pb2
from minicaffe.solvers import get_solver
from minicaffe.solvers import snapshot as snap
from test_solver_nets import (LENET_SOLVER, captured_log, feed_memory, lenet_memory,
                              memory_net, messages, param_arrays, solver_param)

REPO = pathlib.Path(__file__).resolve().parents[1]
TESTS = pathlib.Path(__file__).resolve().parent

SOLVER_TEXT = """net: "net.prototxt"
type: "%(type)s"
base_lr: 0.05
momentum: 0.9
weight_decay: 0.001
lr_policy: "multistep"
gamma: 0.5
stepvalue: 4
stepvalue: 13
max_iter: 20
display: 0
snapshot_prefix: "snaps/run"
snapshot_format: %(format)s
snapshot_after_train: false
random_seed: 17
solver_mode: CPU
"""

DATA = np.random.RandomState(3)
X = DATA.randn(10, 4, 1, 1).astype(np.float32)  # 5 batches of 2: after 10 iterations the
Y = DATA.randint(0, 3, 10).astype(np.float32)   # MemoryData position is back at 0

RESUME_SCRIPT = r"""
import sys
import numpy as np
from minicaffe.solvers import get_solver
from test_solver_nets import feed_memory
solver_file, state, iters, out, data = sys.argv[1:6]
s = get_solver(solver_file)
d = np.load(data)
feed_memory(s.net, d["x"], d["y"])
s.restore(state)
assert s.iter == 10, s.iter
s.step(int(iters))
np.savez(out, *[b.data for b in s.net.learnable_params], iter=s.iter, step=s.current_step)
"""


def _write_run(tmp_path, kind, fmt):
    (tmp_path / "net.prototxt").write_text(memory_net(2))
    (tmp_path / "solver.prototxt").write_text(SOLVER_TEXT % {"type": kind, "format": fmt})
    (tmp_path / "snaps").mkdir()
    np.savez(tmp_path / "data.npz", x=X, y=Y)


def _solver(tmp_path):
    s = get_solver(str(tmp_path / "solver.prototxt"))
    feed_memory(s.net, X, Y)
    return s


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize("kind", ["SGD", "Adam"])
@pytest.mark.parametrize("fmt", ["BINARYPROTO", "HDF5"])
def test_restore_in_a_new_process_continues_exactly(tmp_path, monkeypatch, kind, fmt):
    if fmt == "HDF5":
        pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, kind, fmt)
    full = _solver(tmp_path)
    full.step(20)
    half = _solver(tmp_path)
    half.step(10)
    model = half.snapshot()
    ext = ".h5" if fmt == "HDF5" else ""
    assert model == f"snaps/run_iter_10.caffemodel{ext}"
    state = f"snaps/run_iter_10.solverstate{ext}"
    assert os.path.isfile(state) and os.path.isfile(model)
    subprocess.run([sys.executable, "-c", RESUME_SCRIPT, "solver.prototxt", state, "10",
                    "out.npz", "data.npz"], check=True, env=_env(), cwd=tmp_path)
    out = np.load(tmp_path / "out.npz")
    assert int(out["iter"]) == 20 and int(out["step"]) == full.current_step == 2
    for i, b in enumerate(full.net.learnable_params):
        assert np.array_equal(out[f"arr_{i}"], b.data), i


def test_snapshot_names_logs_and_schedule(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "SGD", "BINARYPROTO")
    s = _solver(tmp_path)
    s.param.snapshot = 4
    s.param.max_iter = 10
    s.param.snapshot_after_train = True
    with captured_log() as lines:
        s.solve()
    files = sorted(os.listdir("snaps"))
    assert files == [f"run_iter_{i}.{e}" for i in (10, 4, 8) for e in ("caffemodel", "solverstate")]
    msgs = messages(lines)
    assert "Snapshotting to binary proto file snaps/run_iter_4.caffemodel" in msgs
    assert "Snapshotting solver state to binary proto file snaps/run_iter_4.solverstate" in msgs
    # snapshot_after_train does not repeat a snapshot taken at the last iteration
    s2 = _solver(tmp_path)
    s2.param.snapshot, s2.param.max_iter, s2.param.snapshot_after_train = 5, 5, True
    with captured_log() as lines:
        s2.solve()
    assert sum("Snapshotting to" in m for m in messages(lines)) == 1


def test_binary_state_holds_caffe_fields(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "Adam", "BINARYPROTO")
    s = _solver(tmp_path)
    s.step(6)
    s.snapshot()
    st = protoio.read_binary("snaps/run_iter_6.solverstate", caffe_pb2.SolverState())
    assert st.iter == 6 and st.current_step == 1
    assert st.learned_net == "snaps/run_iter_6.caffemodel"
    assert len(st.history) == 2 * len(s.net.learnable_params)
    for bp, h in zip(st.history, s.history):
        assert tuple(bp.shape.dim) == h.shape
        np.testing.assert_array_equal(np.asarray(bp.data, np.float32).reshape(h.shape), h.data)
    net = protoio.read_binary("snaps/run_iter_6.caffemodel", caffe_pb2.NetParameter())
    ip1 = [l for l in net.layer if l.name == "ip1"][0]
    assert len(ip1.blobs) == 2 and len(ip1.blobs[0].diff) == 0


def test_hdf5_state_layout_is_caffes(tmp_path, monkeypatch):
    h5py = pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "SGD", "HDF5")
    s = _solver(tmp_path)
    s.step(3)
    s.snapshot()
    with h5py.File("snaps/run_iter_3.solverstate.h5", "r") as f:
        assert sorted(f.keys()) == ["current_step", "history", "iter", "learned_net",
                                    "minicaffe_resume"]  # the last, Caffe does not read
        assert f["iter"].shape == (1,) and int(f["iter"][0]) == 3  # hdf5_save_int's rank 1
        assert f["current_step"].shape == (1,)
        assert f["iter"].dtype == np.int32
        name = f["learned_net"]
        assert name.shape == () and name.id.get_type().get_strpad() == h5py.h5t.STR_NULLTERM
        assert name[()].rstrip(b"\0") == b"snaps/run_iter_3.caffemodel.h5"
        assert sorted(f["history"].keys()) == ["0", "1", "2", "3"]
        for i, h in enumerate(s.history):
            np.testing.assert_array_equal(f["history"][str(i)][()], h.data)
    with h5py.File("snaps/run_iter_3.caffemodel.h5", "r") as f:
        assert list(f.keys()) == ["data"]
        np.testing.assert_array_equal(f["data/ip1/0"][()], s.net.params["ip1"][0].data)


def test_snapshot_diff_writes_diffs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "SGD", "BINARYPROTO")
    s = _solver(tmp_path)
    s.param.snapshot_diff = True
    s.step(2)
    s.snapshot()
    net = protoio.read_binary("snaps/run_iter_2.caffemodel", caffe_pb2.NetParameter())
    ip1 = [l for l in net.layer if l.name == "ip1"][0]
    np.testing.assert_array_equal(np.asarray(ip1.blobs[0].diff, np.float32).reshape(5, 4),
                                  s.net.params["ip1"][0].diff)


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "SGD", "BINARYPROTO")
    s = _solver(tmp_path)
    s.step(1)

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(MinicaffeError, match=r"^snaps/run_iter_1\.caffemodel: cannot write "
                                             r"\(No space left on device\)$"):
        s.snapshot()
    monkeypatch.undo()
    assert os.listdir(tmp_path / "snaps") == []


@pytest.mark.parametrize("fmt", ["BINARYPROTO", "HDF5"])
def test_full_disk_names_the_snapshot_file(tmp_path, monkeypatch, fmt):
    if fmt == "HDF5":
        pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "SGD", fmt)
    s = _solver(tmp_path)
    s.step(1)
    real_replace = os.replace

    def full_for_states(src, dst):  # the weights are written, the state finds the disk full
        if ".solverstate" in dst:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_for_states)
    with pytest.raises(MinicaffeError, match=r"^snaps/run_iter_1\.solverstate(\.h5)?: cannot "
                                             r"write \(No space left on device\)$"):
        s.snapshot()
    assert not [f for f in os.listdir("snaps") if ".solverstate" in f or ".tmp-" in f]


@pytest.mark.parametrize("umask", [0o022, 0o002])
@pytest.mark.parametrize("fmt", ["BINARYPROTO", "HDF5"])
def test_snapshots_get_the_mode_of_a_plain_write(tmp_path, monkeypatch, umask, fmt):
    if fmt == "HDF5":
        pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "SGD", fmt)
    old = os.umask(umask)
    try:
        s = _solver(tmp_path)
        s.step(1)
        s.snapshot()
    finally:
        os.umask(old)
    files = os.listdir("snaps")
    assert len(files) == 2
    for f in files:
        assert stat.S_IMODE(os.stat(os.path.join("snaps", f)).st_mode) == 0o666 & ~umask, f


def test_leftovers_of_a_killed_write_are_removed_at_the_next_snapshot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "SGD", "BINARYPROTO")
    s = _solver(tmp_path)
    s.step(1)
    leftovers = [".tmp-run_iter_1.caffemodel-ab12cd", ".tmp-run_iter_1.solverstate-x9"]
    for name in leftovers + [".tmp-other_iter_1.caffemodel-zz"]:
        (tmp_path / "snaps" / name).write_bytes(b"half")
    s.step(1)
    s.snapshot()
    assert sorted(os.listdir("snaps")) == [".tmp-other_iter_1.caffemodel-zz",
                                           "run_iter_2.caffemodel", "run_iter_2.solverstate"]


def test_restore_finds_weights_next_to_a_moved_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "SGD", "BINARYPROTO")
    s = _solver(tmp_path)
    s.step(5)
    s.snapshot()
    moved = tmp_path / "elsewhere"
    os.rename(tmp_path / "snaps", moved)
    s2 = _solver(tmp_path)
    s2.restore(str(moved / "run_iter_5.solverstate"))
    assert s2.iter == 5
    for a, b in zip(param_arrays(s.net), param_arrays(s2.net)):
        np.testing.assert_array_equal(a, b)
    os.remove(moved / "run_iter_5.caffemodel")
    with pytest.raises(MinicaffeError, match="were not found"):
        _solver(tmp_path).restore(str(moved / "run_iter_5.solverstate"))


def test_mismatched_state_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "Adam", "BINARYPROTO")
    s = _solver(tmp_path)
    s.step(1)
    s.snapshot()
    (tmp_path / "solver.prototxt").write_text(SOLVER_TEXT % {"type": "SGD", "format": "BINARYPROTO"})
    with pytest.raises(MinicaffeError, match="holds 8 history blobs, a SGD solver for this net "
                                             "needs 4"):
        _solver(tmp_path).restore("snaps/run_iter_1.solverstate")
    (tmp_path / "net.prototxt").write_text(memory_net(2).replace("num_output: 5", "num_output: 7"))
    (tmp_path / "solver.prototxt").write_text(SOLVER_TEXT % {"type": "Adam", "format": "BINARYPROTO"})
    with pytest.raises(MinicaffeError, match=r"history blob 0 has shape \(5, 4\), param 'ip1' #0 "
                                             r"has shape \(7, 4\)"):
        _solver(tmp_path).restore("snaps/run_iter_1.solverstate")
    with pytest.raises(MinicaffeError, match="no such file"):
        _solver(tmp_path).restore("snaps/missing.solverstate")


def test_snapshot_prefix_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(memory_net(2))
    base = 'net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nsolver_mode: CPU\n'
    (tmp_path / "a.prototxt").write_text(base)
    assert get_solver("a.prototxt").param.snapshot_prefix == "a"
    (tmp_path / "out").mkdir()
    (tmp_path / "b.prototxt").write_text(base + 'snapshot_prefix: "out"\n')
    s = get_solver("b.prototxt")
    assert s.param.snapshot_prefix == os.path.join("out", "b")
    assert s.snapshot_filename(".caffemodel") == os.path.join("out", "b") + "_iter_0.caffemodel"


def test_hdf5_state_roundtrip_and_missing_keys(tmp_path):
    pytest.importorskip("h5py")
    st = snap.SolverStateData(7, "x.caffemodel.h5", 2,
                              [((2, 3), np.arange(6, dtype=np.float32)),
                               ((4,), np.ones(4, np.float32))])
    path = str(tmp_path / "s.solverstate.h5")
    snap.write_hdf5_state(path, st)
    back = snap.read_state(path)
    assert (back.iter, back.learned_net, back.current_step) == (7, "x.caffemodel.h5", 2)
    assert [h[0] for h in back.history] == [(2, 3), (4,)]
    import h5py
    with h5py.File(tmp_path / "bad.solverstate.h5", "w") as f:
        f.create_dataset("x", data=1)
    with pytest.raises(MinicaffeError, match="no 'iter'"):
        snap.read_state(str(tmp_path / "bad.solverstate.h5"))


def test_weights_finetune_into_train_and_test_nets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, "SGD", "BINARYPROTO")
    s = _solver(tmp_path)
    s.step(3)
    s.snapshot()
    text = memory_net(2).replace('layer { name: "loss"', 'layer { name: "acc" type: "Accuracy" '
                                 'bottom: "ip2" bottom: "label" top: "accuracy" '
                                 'include { phase: TEST } }\nlayer { name: "loss"')
    t = get_solver(solver_param(text, base_lr=0.1, lr_policy="fixed", test_iter=[1],
                                test_interval=5, random_seed=99))
    with captured_log() as lines:
        t.copy_weights("snaps/run_iter_3.caffemodel")
    assert "Finetuning from snaps/run_iter_3.caffemodel" in messages(lines)
    for net in (t.net, t.test_nets[0]):
        for a, b in zip(param_arrays(s.net), param_arrays(net)):
            np.testing.assert_array_equal(a, b)
    assert t.iter == 0


def test_bvlc_lenet_solverstate_restores_and_training_continues(fixtures_dir, tmp_path,
                                                                  monkeypatch, request):
    """Caffe's own lenet_iter_10000.solverstate (V1 era; history in 4-D legacy shapes)
    restores into minicaffe's LeNet; with MNIST at hand the net scores ~99% and keeps
    training from iteration 10000 with Caffe's momentum history."""
    monkeypatch.chdir(tmp_path)
    state_file = fixtures_dir / "lenet_v1_iter_10000.solverstate"
    if not state_file.exists():
        pytest.skip("lenet_v1_iter_10000.solverstate not present")
    p = solver_param(lenet_memory(64, 100), LENET_SOLVER.replace("test_iter: 100", "test_iter: 5"),
                     snapshot=0, snapshot_after_train=False, random_seed=1)
    s = get_solver(p)
    try:  # MNIST from the example's cache (fetched there), else random stand-ins
        mnist = request.getfixturevalue("mnist_dir")
    except pytest.skip.Exception:
        mnist = None
    have_mnist = mnist is not None
    if have_mnist:
        from minicaffe.data.datasets import find_mnist_files, read_idx
        files = find_mnist_files(str(mnist))
        images = read_idx(files["test_images"])[:, None] * np.float32(1 / 256)
        labels = read_idx(files["test_labels"]).astype(np.float32)
    else:
        rng = np.random.RandomState(0)
        images = rng.rand(4064, 1, 28, 28).astype(np.float32)   # [4000:4064] below
        labels = rng.randint(0, 10, 4064).astype(np.float32)
    feed_memory(s.net, images[4000:4064], labels[4000:4064])
    feed_memory(s.test_nets[0], images[:500], labels[:500])
    with captured_log() as lines:
        s.restore(str(state_file))
    assert "SGDSolver: restoring history" in messages(lines)
    assert s.iter == 10000 and s.current_step == 0
    assert len(s.history) == len(s.net.learnable_params) == 8
    from minicaffe.network.net import read_weights
    ref = read_weights(str(fixtures_dir / "lenet_v1_iter_10000.caffemodel"))
    conv1 = [l for l in ref.layer if l.name == "conv1"][0]
    np.testing.assert_array_equal(s.net.params["conv1"][0].data.reshape(-1),
                                  np.asarray(conv1.blobs[0].data, np.float32))
    w0 = param_arrays(s.net)
    h0 = [h.data.copy() for h in s.history]
    assert [h.shape for h in h0] == [w.shape for w in w0]
    assert all(np.abs(h).sum() > 0 for h in h0)
    # this batch's gradient at the restored weights, then one solver step on the same batch
    s.net.clear_param_diffs()
    s.net.forward_backward()
    g = [b.diff.copy() for b in s.net.learnable_params]
    s.net.layers[0].pos = 0
    with captured_log() as lines:
        s.step(1)
    assert "Iteration 10000, lr = 0.00594604" in messages(lines)
    rate = 0.01 * (1 + 0.0001 * 10000) ** -0.75
    for i, w1 in enumerate(param_arrays(s.net)):
        lr = rate * s.net.params_lr[i]
        wd = 0.0005 * s.net.params_weight_decay[i]
        expected = w0[i] - (0.9 * h0[i] + lr * (g[i] + wd * w0[i]))
        np.testing.assert_allclose(w1, expected, rtol=1e-4, atol=1e-8)
    assert s.iter == 10001
    acc, loss = s.test(0)
    if have_mnist:
        assert acc >= 0.97 and loss < 0.15
    s.step(2)
    assert s.iter == 10003 and np.isfinite(param_arrays(s.net)[0]).all()
