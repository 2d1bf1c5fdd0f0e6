"""The ``minicaffe`` command line: Caffe's flags and spellings, train/test/time/
device_query output, resume and finetune, YAML, signals, the progress bar, and bad
input as one line with exit status 1."""
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from minicaffe.core import backend, protoio
from minicaffe.cli import parse_args
from minicaffe.core.errors import MinicaffeError
from minicaffe.proto import caffe_pb2
from test_solver_nets import CONST_NET, DUMMY_NET

REPO = pathlib.Path(__file__).resolve().parents[1]
NO_GPU = backend.gpu_count() == 0

SOLVER = """net: "net.prototxt"
test_iter: 2
test_interval: 5
base_lr: 0.05
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 5
max_iter: 10
snapshot: 5
snapshot_prefix: "snap/dummy"
random_seed: 7
solver_mode: CPU
"""

GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ")


def _messages(err):
    return [l.split("] ", 1)[1] for l in err.splitlines() if GLOG.match(l)]


def _error_line(err):
    lines = [l for l in err.splitlines() if l.startswith("minicaffe: error: ")]
    assert len(lines) == 1, err
    assert err.rstrip("\n").splitlines()[-1] == lines[0]  # the last line, alone
    return lines[0]


def _setup(tmp_path, net=DUMMY_NET, solver=SOLVER):
    (tmp_path / "net.prototxt").write_text(net)
    (tmp_path / "solver.prototxt").write_text(solver)
    (tmp_path / "snap").mkdir(exist_ok=True)


def _weights(path):
    p = protoio.read_binary(str(path), caffe_pb2.NetParameter())
    return {(l.name, i): np.asarray(b.data, np.float32) for l in p.layer
            for i, b in enumerate(l.blobs)}


# -- flags ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["train", "-solver=s.prototxt"], ["train", "--solver=s.prototxt"],
    ["train", "--solver", "s.prototxt"], ["train", "-solver", "s.prototxt"],
    ["-solver", "s.prototxt", "train"],
])
def test_gflags_spellings(argv):
    command, flags = parse_args(argv)
    assert command == "train" and flags.solver == "s.prototxt"


def test_flag_kinds():
    _, f = parse_args(["test", "-gpu", "0", "--iterations=7", "-level", "-1", "--debug_info",
                       "--stage=a,b", "-phase=TEST"])
    assert (f.gpu, f.iterations, f.level, f.debug_info, f.stage, f.phase) == \
        ("0", 7, -1, True, "a,b", "TEST")
    _, f = parse_args(["train", "--nodebug_info"])
    assert f.debug_info is False and f.iterations == 50 and f.sigint_effect == "stop"
    assert f.sighup_effect == "snapshot"
    with pytest.raises(MinicaffeError, match="illegal value 'abc' specified for int32 flag "
                                             "'iterations'"):
        parse_args(["test", "--iterations", "abc"])
    with pytest.raises(MinicaffeError, match="unknown command line flag 'solvr'"):
        parse_args(["train", "--solvr", "x"])
    with pytest.raises(MinicaffeError, match="missing its argument"):
        parse_args(["train", "--solver"])


def test_help_version_and_unknown_commands(cli):
    rc, out, err = cli("--help")
    assert rc == 0 and "usage: minicaffe <command> <args>" in out and "device_query" in out
    rc, out, err = cli("--version")
    assert rc == 0 and out.startswith("minicaffe ")
    rc, out, err = cli()
    assert rc == 1 and "usage:" in err
    rc, out, err = cli("brew")
    assert rc == 1 and "unknown action: brew" in _error_line(err)


# -- train -----------------------------------------------------------------------------------
def test_train_end_to_end_with_log_file(cli, tmp_path):
    _setup(tmp_path)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--log", "train.log")
    assert rc == 0, err
    msgs = _messages(err)
    for line in ("Use CPU.", "Starting Optimization", "Solving dummy", "Learning Rate Policy: inv",
                 "Iteration 0, Testing net (#0)", "Iteration 5, lr = 0.0499813",
                 "Snapshotting to binary proto file snap/dummy_iter_5.caffemodel",
                 "Snapshotting solver state to binary proto file snap/dummy_iter_10.solverstate",
                 "Iteration 10, Testing net (#0)"):
        assert line in msgs, line
    assert msgs.count("Optimization Done.") == 2  # the solver's and the tool's, as Caffe prints
    assert sorted(os.listdir("snap")) == ["dummy_iter_10.caffemodel", "dummy_iter_10.solverstate",
                                          "dummy_iter_5.caffemodel", "dummy_iter_5.solverstate"]
    logged = (tmp_path / "train.log").read_text().splitlines()
    # from "Solving" on (what Caffe's parse_log.py reads) every line is a glog line
    start = [k for k, l in enumerate(logged) if l.endswith("] Solving dummy")][0]
    assert all(GLOG.match(l) for l in logged[start:])
    assert [l.split("] ", 1)[1] for l in logged if "Test net output" in l] == \
        [m for m in msgs if "Test net output" in m]
    assert "\r" not in (tmp_path / "train.log").read_text()


def test_python_m_minicaffe_and_bad_input_without_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "minicaffe", "train", "-solver=missing.prototxt"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "minicaffe: error: missing.prototxt: no such file"


@pytest.mark.parametrize("args,solver_edit,match", [
    (["--snapshot", "a.solverstate", "--weights", "b.caffemodel"], None, "not both"),
    ([], lambda s: s.replace('net: "net.prototxt"\n', ""), "defines no net"),
    ([], lambda s: s.replace('lr_policy: "inv"', 'lr_policy: "cosine"'), "unknown lr_policy"),
    ([], lambda s: s + 'type: "Adamax"\n', "unknown solver type 'Adamax'"),
    ([], lambda s: s.replace("base_lr: 0.05", "base_lr: fast"), r"solver\.prototxt:4:"),
    ([], lambda s: s.replace('net: "net.prototxt"', 'net: "nonet.prototxt"'),
     "nonet.prototxt: no such file"),
    (["--level", "high"], None, "illegal value 'high' specified for int32 flag 'level'"),
    (["--snapshot", "nothere.solverstate"], None, "nothere.solverstate: no such file"),
    (["--weights", "a.caffemodel,nothere.caffemodel"], None, "no such file"),
    (["--sigint_effect", "explode"], None, 'invalid signal effect "explode"'),
    (["--log", "/nonexistent/dir/x.log"], None, "cannot write the log there"),
])
def test_bad_train_input_is_one_line(cli, tmp_path, args, solver_edit, match):
    _setup(tmp_path, solver=solver_edit(SOLVER) if solver_edit else SOLVER)
    (tmp_path / "a.caffemodel").write_bytes(b"")
    rc, out, err = cli("train", "--solver", "solver.prototxt", *args)
    assert rc == 1
    assert re.search(match, _error_line(err)), err
    assert "Traceback" not in err


def test_mismatched_snapshot_is_one_line(cli, tmp_path):
    _setup(tmp_path)
    assert cli("train", "--solver", "solver.prototxt")[0] == 0
    (tmp_path / "net.prototxt").write_text(DUMMY_NET.replace("num_output: 6", "num_output: 9"))
    rc, out, err = cli("train", "--solver", "solver.prototxt",
                       "--snapshot", "snap/dummy_iter_5.solverstate")
    assert rc == 1
    assert "shape mismatch" in _error_line(err) or "does not match" in _error_line(err)


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU messages")
def test_gpu_asked_without_gpu(cli, tmp_path):
    _setup(tmp_path)
    for g in ("0", "0,1", "all"):
        rc, out, err = cli("train", "--solver", "solver.prototxt", "--gpu", g)
        assert rc == 1 and "none is usable" in _error_line(err)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--gpu", "zero")
    assert rc == 1 and "illegal value 'zero' specified for flag 'gpu'" in _error_line(err)
    rc, out, err = cli("device_query")
    assert rc == 1 and "device_query needs a GPU" in _error_line(err)
    for g in ("0", "all"):
        rc, out, err = cli("time", "--model", "net.prototxt", "--gpu", g)
        assert rc == 1 and "none is usable" in _error_line(err)
        rc, out, err = cli("test", "--model", "net.prototxt", "--weights", "w", "--gpu", g)
        assert rc == 1 and "none is usable" in _error_line(err)


def test_several_gpus_without_cupy_or_nccl_is_a_clear_error(cli, tmp_path, monkeypatch):
    _setup(tmp_path)
    monkeypatch.setattr(backend, "gpu_count", lambda: 4)
    monkeypatch.setattr(backend, "cp", None)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--gpu", "0,1")
    assert rc == 1 and "--gpu 0,1: multi-GPU training needs CuPy" in _error_line(err)

    class CupyWithoutNccl:  # cupy.cuda.nccl fails to import
        cuda = None
    monkeypatch.setattr(backend, "cp", CupyWithoutNccl())
    monkeypatch.setattr("minicaffe.multigpu.comm.nccl_module", lambda: None)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--gpu", "all")
    assert rc == 1 and "--gpu 0,1,2,3: multi-GPU training needs NCCL" in _error_line(err)


def test_bad_multi_gpu_requests_are_one_clear_line(cli, tmp_path, monkeypatch):
    _setup(tmp_path)
    monkeypatch.setattr(backend, "gpu_count", lambda: 2)
    cases = [(["--gpu", "7"], "GPU 7 requested but only 2 device(s) exist"),
             (["--gpu", "0,1,7"], "GPU 7 requested but only 2 device(s) exist"),
             (["--gpu", "1,1"], "GPU 1 is listed more than once in --gpu 1,1"),
             (["--gpu", "0,1", "--parallel", "mpi"], "--parallel must be thread or process"),
             (["--gpu", "0", "--rank", "1"], "needs --rank, --world_size and --init_file"),
             (["--gpu", "0", "--rank", "2", "--world_size", "2", "--init_file", "f"],
              "--rank 2 is not below --world_size 2"),
             (["--rank", "0", "--world_size", "2", "--init_file", "f"],
              "the process mode needs GPUs")]
    for extra, words in cases:
        rc, out, err = cli("train", "--solver", "solver.prototxt", *extra)
        lines = [l for l in err.splitlines() if l.startswith("minicaffe: error")]
        assert rc == 1 and len(lines) == 1 and words in lines[0], (extra, err)


@pytest.mark.skipif(not NO_GPU, reason="checks the CPU fallback")
@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU message")
def test_solver_mode_gpu_falls_back_to_cpu_with_an_info_line(cli, tmp_path):
    """Caffe's example solvers say solver_mode: GPU; the README promises the CPU by default,
    so a CPU-only machine gets an info line, not a warning."""
    _setup(tmp_path, solver=SOLVER.replace("solver_mode: CPU", "solver_mode: GPU"))
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    assert rc == 0
    said = [l for l in err.splitlines() if "solver_mode is GPU but no GPU is usable" in l]
    assert len(said) == 1 and said[0].startswith("I"), said
    assert not any(l.startswith("W") for l in err.splitlines())
    assert "Use CPU." in _messages(err)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_log_on_a_full_disk_is_one_warning_and_exit_1(cli, tmp_path):
    _setup(tmp_path)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--log", "/dev/full")
    assert rc == 1
    assert "Traceback" not in err and "Logging error" not in err
    warned = [l for l in err.splitlines() if l.startswith("W")]
    assert len(warned) == 1 and "cannot write the log file /dev/full" in warned[0]
    assert _error_line(err) == ("minicaffe: error: /dev/full: cannot write the log (No space "
                                "left on device); it is incomplete")
    assert sorted(os.listdir("snap"))[-1] == "dummy_iter_5.solverstate"  # training went on


def test_resume_with_snapshot_continues_exactly(cli, tmp_path):
    solver = SOLVER.replace("test_iter: 2\ntest_interval: 5\n", "").replace(
        "max_iter: 10", "max_iter: 8").replace("snapshot: 5", "snapshot: 4")
    _setup(tmp_path, net=CONST_NET, solver=solver)
    assert cli("train", "--solver", "solver.prototxt")[0] == 0
    straight = _weights(tmp_path / "snap/dummy_iter_8.caffemodel")
    os.remove(tmp_path / "snap/dummy_iter_8.caffemodel")
    rc, out, err = cli("train", "-solver=solver.prototxt", "-snapshot=snap/dummy_iter_4.solverstate")
    assert rc == 0, err
    msgs = _messages(err)
    assert "Resuming from snap/dummy_iter_4.solverstate" in msgs
    assert not any(m.startswith("Iteration 0") for m in msgs)
    resumed = _weights(tmp_path / "snap/dummy_iter_8.caffemodel")
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert np.array_equal(straight[k], resumed[k]), k


def test_weights_finetune_from_several_models(cli, tmp_path):
    solver = SOLVER.replace("test_iter: 2\ntest_interval: 5\n", "").replace("max_iter: 10",
                                                                              "max_iter: 3")
    _setup(tmp_path, solver=solver)
    assert cli("train", "--solver", "solver.prototxt")[0] == 0
    os.rename("snap/dummy_iter_3.caffemodel", "a.caffemodel")
    (tmp_path / "solver.prototxt").write_text(solver.replace("random_seed: 7", "random_seed: 8"))
    assert cli("train", "--solver", "solver.prototxt")[0] == 0
    os.rename("snap/dummy_iter_3.caffemodel", "b.caffemodel")
    # keep only ip2 in b: finetuning copies ip1 from a and ip2 from b
    p = protoio.read_binary("b.caffemodel", caffe_pb2.NetParameter())
    keep = [l for l in p.layer if l.name == "ip2"]
    del p.layer[:]
    p.layer.extend(keep)
    protoio.write_binary("b.caffemodel", p)
    (tmp_path / "solver.prototxt").write_text(solver.replace("max_iter: 3", "max_iter: 0")
                                              .replace("snapshot: 5", "snapshot: 0"))
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--weights", "a.caffemodel,b.caffemodel")
    assert rc == 0, err
    msgs = _messages(err)
    assert "Finetuning from a.caffemodel" in msgs and "Finetuning from b.caffemodel" in msgs
    got = _weights(tmp_path / "snap/dummy_iter_0.caffemodel")
    a, b = _weights(tmp_path / "a.caffemodel"), _weights(tmp_path / "b.caffemodel")
    assert np.array_equal(got[("ip1", 0)], a[("ip1", 0)])
    assert np.array_equal(got[("ip2", 0)], b[("ip2", 0)])
    assert not np.array_equal(a[("ip2", 0)], b[("ip2", 0)])


def test_debug_info_flag_prints_blob_norms(cli, tmp_path):
    _setup(tmp_path, solver=SOLVER.replace("max_iter: 10", "max_iter: 6"))
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--debug_info")
    assert rc == 0, err
    msgs = _messages(err)
    fwd = [m for m in msgs if m.startswith("    [Forward] Layer ip1, top blob ip1 data: ")]
    # train net at display iterations 0 and 5; test nets (as Caffe) at each of their
    # 2 forwards in the tests at iterations 0 and 5
    assert len(fwd) == 2 + 2 * 2
    assert any(m.startswith("    [Backward] Layer ip2, bottom blob ip1 diff: ") for m in msgs)
    assert any(m.startswith("    [Backward] All net params (data, diff): L1 norm = (")
               for m in msgs)


@pytest.mark.filterwarnings("always::RuntimeWarning")
def test_nonfinite_loss_stops_with_exit_1(cli, tmp_path):
    net = CONST_NET.replace("value: 0.3", "value: 1e30").replace(
        'weight_filler { type: "gaussian" std: 0.3 }', 'weight_filler { type: "constant" value: 1e30 }')
    _setup(tmp_path, net=net, solver=SOLVER.replace("test_iter: 2\ntest_interval: 5\n", ""))
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    assert rc == 1
    line = _error_line(err)
    assert "Iteration 0: the loss is" in line and "layer 'ip1'" in line
    # numpy's overflow warning went into the log as a glog line, not raw text
    assert any(l.startswith("W") and "RuntimeWarning" in l for l in err.splitlines())


def test_yaml_solver_and_net_train_like_prototxt(cli, tmp_path):
    yaml = pytest.importorskip("yaml")
    from google.protobuf import json_format
    _setup(tmp_path)
    net = protoio.read_text("net.prototxt", caffe_pb2.NetParameter())
    solver = protoio.read_text("solver.prototxt", caffe_pb2.SolverParameter())
    solver.net = "net.yaml"
    solver.snapshot_prefix = "snap/yaml"
    (tmp_path / "net.yaml").write_text(yaml.safe_dump(
        json_format.MessageToDict(net, preserving_proto_field_name=True)))
    (tmp_path / "solver.yaml").write_text(yaml.safe_dump(
        json_format.MessageToDict(solver, preserving_proto_field_name=True)))
    # hand-written YAML may drop the list around a repeated field given once
    text = (tmp_path / "solver.yaml").read_text().replace("test_iter:\n- 2", "test_iter: 2")
    assert "test_iter: 2" in text
    (tmp_path / "solver.yaml").write_text(text)
    rc, out, err = cli("train", "--solver", "solver.yaml")
    assert rc == 0, err
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    assert rc == 0, err
    a = _weights(tmp_path / "snap/yaml_iter_10.caffemodel")
    b = _weights(tmp_path / "snap/dummy_iter_10.caffemodel")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# -- test, time, device_query --------------------------------------------------------------------
def test_test_command_prints_batches_and_means(cli, tmp_path):
    _setup(tmp_path)
    assert cli("train", "--solver", "solver.prototxt")[0] == 0
    rc, out, err = cli("test", "--model", "net.prototxt", "--weights",
                       "snap/dummy_iter_10.caffemodel", "-iterations", "3")
    assert rc == 0, err
    msgs = _messages(err)
    assert "Running for 3 iterations." in msgs
    acc = [float(m.split(" = ")[1]) for m in msgs if re.match(r"Batch \d, accuracy = ", m)]
    loss = [float(m.split(" = ")[1]) for m in msgs if re.match(r"Batch \d, loss = ", m)]
    assert len(acc) == len(loss) == 3
    assert [m for m in msgs if m.startswith("Batch ")][:2] == \
        [m for m in msgs if m.startswith("Batch 0")]
    mean_acc = [m for m in msgs if m.startswith("accuracy = ")]
    mean_loss = [m for m in msgs if m.startswith("loss = ")]
    assert float(mean_acc[0].split(" = ")[1]) == pytest.approx(np.mean(acc), rel=1e-4)
    m = re.match(r"loss = (\S+) \(\* 1 = (\S+) loss\)$", mean_loss[0])
    assert float(m.group(1)) == pytest.approx(np.mean(loss), rel=1e-4)
    assert any(re.match(r"Loss: \S+$", m) for m in msgs)
    rc, out, err = cli("test", "--model", "net.prototxt")
    assert rc == 1 and "need model weights" in _error_line(err)


def test_time_command_prints_caffe_benchmark(cli, tmp_path):
    _setup(tmp_path)
    rc, out, err = cli("time", "--model", "net.prototxt", "--iterations", "3")
    assert rc == 0, err
    msgs = _messages(err)
    for line in ("Performing Forward", "Performing Backward", "*** Benchmark begins ***",
                 "Testing for 3 iterations.", "Average time per layer: ", "*** Benchmark ends ***"):
        assert line in msgs
    assert len([m for m in msgs if re.match(r"Iteration: \d forward-backward time: \S+ ms\.$", m)]) == 3
    layers = ["data", "ip1", "relu1", "ip2", "loss"]
    for name in layers:
        assert "%10s\tforward: " % name in "\n".join(msgs)
        assert any(re.match(r" *%s\tbackward: \S+ ms\.$" % name, m) for m in msgs)
    for head in ("Average Forward pass: ", "Average Backward pass: ", "Average Forward-Backward: ",
                 "Total Time: "):
        assert any(re.match(re.escape(head) + r"\S+ ms\.$", m) for m in msgs), head
    rc, out, err = cli("time", "--model", "net.prototxt", "--phase", "VALIDATE")
    assert rc == 1 and 'phase must be "TRAIN" or "TEST"' in _error_line(err)
    rc, out, err = cli("time", "--model", "net.prototxt", "--phase", "TEST", "--iterations", "1")
    assert rc == 0 and "acc\tforward" in err


# -- signals and the progress bar (real processes) ----------------------------------------------
LONG_SOLVER = """net: "net.prototxt"
base_lr: 0.01
lr_policy: "fixed"
display: 50
max_iter: 1000000
snapshot_prefix: "snap/long"
solver_mode: CPU
"""


class _Proc:
    """A ``minicaffe train`` process whose stderr lines are collected by a thread."""

    def __init__(self, tmp_path, *args):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.p = subprocess.Popen([sys.executable, "-m", "minicaffe", "train",
                                   "--solver", "solver.prototxt", *args], cwd=tmp_path, env=env,
                                  stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern, after=0, timeout=60):
        end = time.time() + timeout
        while time.time() < end:
            for i, l in enumerate(self.lines[after:], after):
                if re.search(pattern, l):
                    return i
            if self.p.poll() is not None and not self.t.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"'{pattern}' not seen:\n" + "\n".join(self.lines[-20:]))

    def finish(self, timeout=60):
        try:
            rc = self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
            self.t.join(5)
            self.p.stderr.close()
        return rc


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_sigint_stops_and_snapshots_sighup_snapshots(tmp_path):
    _setup(tmp_path, net=CONST_NET, solver=LONG_SOLVER)
    proc = _Proc(tmp_path)
    i = proc.wait_for(r"Iteration \d+ \(")
    proc.p.send_signal(signal.SIGHUP)
    j = proc.wait_for(r"Snapshotting solver state to binary proto file snap/long_iter_\d+", i)
    k = proc.wait_for(r"Iteration \d+ \(", j + 1)
    proc.p.send_signal(signal.SIGINT)
    assert proc.finish() == 0
    msgs = [l.split("] ", 1)[-1] for l in proc.lines]
    assert "Caught SIGHUP: snapshot" in msgs and "Caught SIGINT: stop" in msgs
    assert "Optimization stopped early." in msgs
    snaps = [re.search(r"_iter_(\d+)\.caffemodel", m).group(1) for m in msgs
             if m.startswith("Snapshotting to binary proto file")]
    assert len(snaps) == 2 and int(snaps[1]) > int(snaps[0]) > 0
    for n in snaps:
        assert (tmp_path / f"snap/long_iter_{n}.caffemodel").is_file()
        assert (tmp_path / f"snap/long_iter_{n}.solverstate").is_file()
    assert not any("Traceback" in l for l in proc.lines)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_signal_effects_from_flags(tmp_path):
    _setup(tmp_path, net=CONST_NET, solver=LONG_SOLVER + "snapshot_after_train: false\n")
    proc = _Proc(tmp_path, "--sigint_effect", "none", "-sighup_effect=stop")
    i = proc.wait_for(r"Iteration \d+ \(")
    proc.p.send_signal(signal.SIGINT)
    i = proc.wait_for("Caught SIGINT: none", i)
    proc.wait_for(r"Iteration \d+ \(", i + 1)  # still training
    proc.p.send_signal(signal.SIGHUP)
    assert proc.finish() == 0
    msgs = [l.split("] ", 1)[-1] for l in proc.lines]
    assert "Caught SIGHUP: stop" in msgs and "Optimization stopped early." in msgs
    assert os.listdir(tmp_path / "snap") == []


@pytest.mark.skipif(sys.platform != "linux", reason="needs a pseudo-terminal")
def test_progress_bar_on_a_terminal_only(tmp_path, on_a_tty):
    _setup(tmp_path, net=CONST_NET,
           solver=LONG_SOLVER.replace("max_iter: 1000000", "max_iter: 300"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    status, tty = on_a_tty([sys.executable, "-m", "minicaffe", "train", "--solver",
                            "solver.prototxt", "--log", "run.log"], tmp_path, env)
    assert status == 0
    assert re.search(r"\d+/300 \[", tty), tty[-2000:]  # tqdm's bar
    assert "Optimization Done." in tty
    logged = (tmp_path / "run.log").read_text()
    assert "/300 [" not in logged and "\r" not in logged
    assert logged.count("Train net output #0") == tty.count("Train net output #0") == 6
    # through a pipe: no bar
    r = subprocess.run([sys.executable, "-m", "minicaffe", "train", "--solver", "solver.prototxt"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "/300 [" not in r.stderr and "\r" not in r.stderr


def test_draw_subcommand_writes_dot(tmp_path):
    from minicaffe import cli
    net = tmp_path / "n.prototxt"
    net.write_text('name: "n" layer { name: "d" type: "Input" top: "x" '
                   'input_param { shape { dim: 1 dim: 2 } } } '
                   'layer { name: "r" type: "ReLU" bottom: "x" top: "y" }')
    out = tmp_path / "n.dot"
    assert cli.main(["draw", str(net), str(out)]) in (0, None)
    text = out.read_text()
    assert text.startswith('digraph "n"')
    assert '"x_blob" -> "r_ReLU"' in text and '"r_ReLU" -> "y_blob"' in text


def test_gpu_only_train_flags_warn_in_cpu_mode(cli, tmp_path):
    _setup(tmp_path)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--nocuda_graph", "--tf32")
    assert rc == 0, err
    msgs = _messages(err)
    assert "--cuda_graph has no effect in CPU mode" in msgs
    assert "--tf32 has no effect in CPU mode" in msgs


def test_minicaffe_precision_sets_the_gpu_math_and_rejects_nonsense(cli, tmp_path):
    from minicaffe.gpu import options
    _setup(tmp_path)
    text = (tmp_path / "solver.prototxt").read_text()
    (tmp_path / "solver.prototxt").write_text(text + 'minicaffe_precision: "HALF"\n')
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    assert rc == 1 and "minicaffe_precision" in err and "HALF" in err
    old = options.tf32
    try:
        (tmp_path / "solver.prototxt").write_text(text + 'minicaffe_precision: "TF32"\n')
        rc, out, err = cli("train", "--solver", "solver.prototxt")
        assert rc == 0, err
        assert "GPU math: fp32 with TF32" in err
        # the solver's nets only (RunConfig.tf32): the process default is left alone
        assert options.tf32 is old
        (tmp_path / "solver.prototxt").write_text(text + 'minicaffe_precision: "FLOAT"\n')
        rc, out, err = cli("train", "--solver", "solver.prototxt")
        assert rc == 0 and "GPU math: fp32 strict (TF32 off)" in err and options.tf32 is old
    finally:
        options.set_tf32(old)


def test_memory_prints_the_plan_before_running_anything(cli):
    rc, out, err = cli("memory", "--model", str(REPO / "models/lenet/train_val.prototxt"),
                       "--batch", "32", "--offload", "NONE")   # a GPU flag: the GPU plan
    assert rc == 0, err
    assert "memory plan of LeNet: batch 32" in out
    assert "planned peak" in out and "conv1" in out and "sharing memory too" in out
    rc, out, err = cli("memory")
    assert rc == 1 and "need a model" in err and err.count("\n") == 1


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_sigterm_stops_with_a_snapshot_and_a_line(tmp_path):
    """docker stop, Slurm preemption and timeout send SIGTERM: training stops after the
    iteration, writes its snapshot, says where, and exits as SIGTERM's status (143)."""
    _setup(tmp_path, net=CONST_NET, solver=LONG_SOLVER)
    proc = _Proc(tmp_path, "--sigint_effect", "none")  # SIGTERM stops whatever SIGINT does
    proc.wait_for(r"Iteration \d+ \(")
    proc.p.send_signal(signal.SIGTERM)
    assert proc.finish() == 128 + signal.SIGTERM
    msgs = [l.split("] ", 1)[-1] for l in proc.lines]
    assert "Caught SIGTERM: stop" in msgs
    said = [m for m in msgs if m.startswith("Stopped by SIGTERM at iteration ")]
    assert len(said) == 1, msgs[-10:]
    n = int(re.search(r"iteration (\d+);", said[0]).group(1))
    assert said[0].endswith(f"resume with --snapshot snap/long_iter_{n}.solverstate")
    assert (tmp_path / f"snap/long_iter_{n}.solverstate").is_file()
    assert (tmp_path / f"snap/long_iter_{n}.caffemodel").is_file()
    assert not any("Traceback" in l for l in proc.lines)


def _ctrl_c_during_snapshot(monkeypatch, extra_signals):
    """Ctrl-C after iteration 3's update; ``extra_signals`` more while the solver state is
    being written."""
    from minicaffe.solvers import SGDSolver
    real_update, real_state = SGDSolver.apply_update, SGDSolver.snapshot_solver_state

    def update(self):
        real_update(self)
        if self.iter == 3:
            os.kill(os.getpid(), signal.SIGINT)

    def state(self, model_filename):
        for _ in range(extra_signals):
            os.kill(os.getpid(), signal.SIGINT)
        return real_state(self, model_filename)

    monkeypatch.setattr(SGDSolver, "apply_update", update)
    monkeypatch.setattr(SGDSolver, "snapshot_solver_state", state)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_second_ctrl_c_waits_for_the_stop_snapshot(cli, tmp_path, monkeypatch):
    _setup(tmp_path, net=CONST_NET, solver=LONG_SOLVER)
    _ctrl_c_during_snapshot(monkeypatch, 1)
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    assert rc == 0, err
    assert sorted(os.listdir("snap")) == ["long_iter_4.caffemodel", "long_iter_4.solverstate"]
    warned = [l for l in err.splitlines() if l.startswith("W")]
    assert len(warned) == 1 and "Caught SIGINT again: stopping after the snapshot" in warned[0]
    assert "Stopped by SIGINT at iteration 4; resume with --snapshot " \
           "snap/long_iter_4.solverstate" in _messages(err)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_third_ctrl_c_aborts(cli, tmp_path, monkeypatch):
    _setup(tmp_path, net=CONST_NET, solver=LONG_SOLVER)
    _ctrl_c_during_snapshot(monkeypatch, 2)
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    assert rc == 130 and err.rstrip().endswith("minicaffe: interrupted")
    assert not [f for f in os.listdir("snap") if "solverstate" in f]  # nothing half-written


def _stalled_image_list(tmp_path):
    """An ImageData net whose fourth image is a FIFO nobody writes: a read that hangs, as a
    hung network file does."""
    from PIL import Image
    rs = np.random.RandomState(0)
    (tmp_path / "img").mkdir()
    for i in range(3):
        Image.fromarray(rs.randint(0, 256, (6, 6, 3)).astype(np.uint8)).save(
            tmp_path / "img" / f"{i}.png")
    os.mkfifo(tmp_path / "img" / "hung.png")
    (tmp_path / "list.txt").write_text("img/0.png 0\nimg/1.png 1\nimg/2.png 0\nimg/hung.png 1\n")
    return ('name: "stall"\nlayer { name: "data" type: "ImageData" top: "data" top: "label"\n'
            '  image_data_param { source: "list.txt" batch_size: 1 } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"\n'
            '  inner_product_param { num_output: 2 } }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" '
            'top: "loss" }\n')


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO (POSIX)")
def test_ctrl_c_during_a_stalled_read_stops_training(tmp_path):
    pytest.importorskip("PIL")
    _setup(tmp_path, net=_stalled_image_list(tmp_path),
           solver=LONG_SOLVER.replace("display: 50", "display: 1"))
    proc = _Proc(tmp_path)
    proc.wait_for(r"Iteration 2, lr = ")
    time.sleep(0.5)  # the training thread now waits for the image that never comes
    proc.p.send_signal(signal.SIGINT)
    assert proc.finish(timeout=30) == 0
    msgs = [l.split("] ", 1)[-1] for l in proc.lines]
    assert "layer 'data' (ImageData): stopped while waiting for data" in msgs
    assert "Stopped by SIGINT at iteration 3; resume with --snapshot " \
           "snap/long_iter_3.solverstate" in msgs
    assert (tmp_path / "snap/long_iter_3.solverstate").is_file()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO (POSIX)")
def test_ctrl_c_during_a_stalled_read_ends_minicaffe_test(tmp_path):
    pytest.importorskip("PIL")
    from minicaffe.network.net import Net, TEST
    (tmp_path / "net.prototxt").write_text(_stalled_image_list(tmp_path))
    same = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 '
            'dim: 3 dim: 6 dim: 6 } } }\nlayer { name: "ip" type: "InnerProduct" bottom: "data" '
            'top: "ip" inner_product_param { num_output: 2 } }\n')
    (tmp_path / "weights.prototxt").write_text(same)
    Net(str(tmp_path / "weights.prototxt"), TEST).save(str(tmp_path / "w.caffemodel"))
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1")
    # a shell without job control starts background jobs (CI) with SIGINT ignored, and
    # Python keeps it so: give the command a terminal's Ctrl-C
    run = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "from minicaffe.cli import main; sys.exit(main(sys.argv[1:]))")
    p = subprocess.Popen([sys.executable, "-c", run, "test", "--model", "net.prototxt",
                          "--weights", "w.caffemodel", "--iterations", "10"], cwd=tmp_path,
                         env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    try:
        for line in p.stderr:
            lines.append(line)
            if "Batch 2, loss = " in line:
                break
        time.sleep(0.5)  # now waiting for the image that never comes
        p.send_signal(signal.SIGINT)
        try:
            _, rest = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # show where every thread is (faulthandler)
            p.send_signal(signal.SIGABRT)
            _, rest = p.communicate(timeout=30)
            raise AssertionError("minicaffe test ignored Ctrl-C:\n" + rest[-6000:]) from None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()
    assert p.returncode == 130
    assert "minicaffe: interrupted" in rest and "Traceback" not in rest


def test_cuda_graph_and_tf32_flags_reach_the_solver_parameter(cli, tmp_path, monkeypatch):
    """--nocuda_graph / --tf32 override the solver's cuda_graph / minicaffe_precision (what
    the GPU step and the GPU math read); without them the solver file decides."""
    import minicaffe.solvers as solvers
    from minicaffe.gpu import options
    seen = []
    real = solvers.solver_class

    def recording(name, source="solver"):
        cls = real(name, source)

        class Recorder(cls):
            def __init__(self, param, **kw):
                seen.append((param.cuda_graph, param.minicaffe_precision))
                super().__init__(param, **kw)
        return Recorder

    monkeypatch.setattr(solvers, "solver_class", recording)
    _setup(tmp_path)
    old = options.tf32
    try:
        assert cli("train", "--solver", "solver.prototxt")[0] == 0
        assert cli("train", "--solver", "solver.prototxt", "--nocuda_graph", "--tf32")[0] == 0
    finally:
        options.set_tf32(old)
    assert seen == [(True, "FLOAT"), (False, "TF32")]
