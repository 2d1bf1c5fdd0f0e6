"""CPU replicas (``--replicas N``, ``RunConfig.cpu_replicas``; engine/replicas.py): the
batch of each iteration split across worker processes, their gradients summed before one
update.  Trained k steps with 2 replicas, a net gives the losses, outputs and weights of
one process up to float rounding; a net that cannot be split says why in one line and
trains in one process; a killed worker ends the run in one line with no process or
shared-memory file left."""
import multiprocessing
import os
import re
import signal

import numpy as np
import pytest
from google.protobuf import text_format

from minicaffe.core import log
from minicaffe.core.config import RunConfig
from minicaffe.core.errors import ConfigError, MinicaffeError
from minicaffe.proto import caffe_pb2
from minicaffe.solvers import get_solver
from test_cli import LONG_SOLVER, _Proc, _error_line, _messages, _setup, _weights
from test_solver_nets import CONST_NET

NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: %(batch)d dim: 2 dim: 8 dim: 8 } shape { dim: %(batch)d } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
%(extra)s
layer { name: "ip" type: "InnerProduct" bottom: "%(ip_in)s" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
  %(loss)s }
"""
# one parameter blob of 250 floats, which the flat parameter buffer holds in 256 (16 cache
# lines of 16 floats): with 18 replicas, the gradient sum's last two shares are empty
TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: %(batch)d dim: 2 dim: 10 dim: 10 } shape { dim: %(batch)d } } }
layer { name: "pool" type: "Pooling" bottom: "data" top: "pool"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 5 bias_term: false
    weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
  %(loss)s }
"""
BN = """layer { name: "bn" type: "BatchNorm" bottom: "pool" top: "bn" }"""
STEPS = 3


def _train(replicas, batch=8, loss="", extra="", ip_in="pool", solver_type="SGD", net=NET,
           iter_size=1):
    """(smoothed loss and accuracy after each step, weights, the solver's replica pids
    during the run) of STEPS steps of NET in one process or across ``replicas``."""
    sp = caffe_pb2.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=0.001,
                                   lr_policy="fixed", display=0, random_seed=1701,
                                   snapshot_after_train=False, type=solver_type,
                                   iter_size=iter_size,
                                   solver_mode=caffe_pb2.SolverParameter.CPU)
    text_format.Parse(net % dict(batch=batch, loss=loss, extra=extra, ip_in=ip_in),
                      sp.net_param)
    s = get_solver(sp, config=RunConfig.from_environment(cpu_replicas=replicas))
    rs = np.random.RandomState(0)
    s.net.blobs["data"].data[...] = rs.randn(*s.net.blobs["data"].shape)
    s.net.blobs["label"].data[...] = rs.randint(0, 5, batch)
    seen, pids = [], set()
    try:
        for _ in range(STEPS):
            s.step(1)
            seen.append((float(s.smoothed_loss), float(s.net.blobs["accuracy"].data)))
            pids.update(s.replica_pids())
        weights = [b.data.copy() for blobs in s.net.params.values() for b in blobs]
    finally:
        s.close()
    return np.array(seen), weights, pids


def _same(a, b):
    seen1, w1, _ = a
    seen2, w2, _ = b
    np.testing.assert_allclose(seen2, seen1, rtol=1e-5, atol=1e-6)
    assert len(w1) == len(w2)
    for x, y in zip(w1, w2):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [8, 7])     # slices 4+4, and 3+4
@pytest.mark.parametrize("solver_type", ["SGD", "Adam"])
def test_two_replicas_train_as_one_process(batch, solver_type):
    one = _train(1, batch=batch, solver_type=solver_type)
    two = _train(2, batch=batch, solver_type=solver_type)
    assert not one[2] and len(two[2]) == 2        # two workers ran, none for one process
    _same(one, two)
    assert not multiprocessing.active_children()  # close() joined them


@pytest.mark.parametrize("replicas", [2, 5])     # 3+4; 1+1+2+1+2
def test_normalization_none_sums_the_slices(replicas):
    loss = "loss_param { normalization: NONE }"
    _same(_train(1, batch=7, loss=loss), _train(replicas, batch=7, loss=loss))


@pytest.mark.parametrize("iter_size", [1, 2])
def test_five_replicas_with_an_odd_batch(iter_size):
    """A batch of 9 in 1+2+2+2+2, the gradients summed in five shares (16 floats apart
    at most) by the workers: one process's losses and weights, the same bits twice."""
    one = _train(1, batch=9, iter_size=iter_size)
    five = _train(5, batch=9, iter_size=iter_size)
    assert len(five[2]) == 5
    _same(one, five)
    again = _train(5, batch=9, iter_size=iter_size)
    assert np.array_equal(five[0], again[0])
    assert all(np.array_equal(x, y) for x, y in zip(five[1], again[1]))


def test_more_replicas_than_cache_lines_of_parameters(monkeypatch):
    """16 cache lines of parameters summed by 18 replicas: two shares are empty (their
    workers are not woken for the sum); the result is one process's.  (18 replicas are
    allowed from 5 CPUs on: the test says there are 8.)"""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    one = _train(1, batch=18, net=TINY)
    many = _train(18, batch=18, net=TINY)
    assert len(many[2]) == 18
    _same(one, many)


@pytest.mark.parametrize("total,n", [(431080, 2), (431080, 16), (45, 4), (3, 8),
                                     (0, 3), (16 * 7 + 5, 7), (16 * 9, 4)])
def test_the_sum_shares_cover_the_parameters_in_cache_lines(total, n):
    from minicaffe.engine.replicas import shares
    cuts = shares(total, n)
    assert len(cuts) == n and cuts[0][0] == 0 and cuts[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))            # contiguous
    assert all(lo % 16 == 0 for lo, _ in cuts)                          # whole lines
    sizes = [hi - lo for lo, hi in cuts]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 16
    if total < 16 * (n - 1):
        assert 0 in sizes


def test_the_same_bits_run_to_run():
    a, b = _train(3, batch=7), _train(3, batch=7)
    assert np.array_equal(a[0], b[0])
    assert all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("extra,ip_in,loss,words", [
    (BN, "bn", "", "layer 'bn' (BatchNorm): its mean and variance span the batch"),
    ("", "pool", "loss_param { ignore_label: 4 }",
     "layer 'loss' (SoftmaxWithLoss): normalization VALID with an ignore_label"),
])
def test_a_net_that_cannot_be_split_says_why_and_trains_in_one_process(
        caplog, extra, ip_in, loss, words):
    caplog.set_level("INFO", logger=log.logger.name)
    one = _train(1, extra=extra, ip_in=ip_in, loss=loss)
    caplog.clear()
    two = _train(2, extra=extra, ip_in=ip_in, loss=loss)
    said = _warnings(caplog)
    assert len(said) == 1 and said[0].startswith("--replicas 2: not split: ") and \
        words in said[0] and said[0].endswith("training runs in one process"), said
    assert not two[2]                          # no worker started
    assert np.array_equal(one[0], two[0])      # the one-process run, bit for bit
    assert all(np.array_equal(x, y) for x, y in zip(one[1], two[1]))


def _shm(*pids):
    """minicaffe's /dev/shm entries made by this process or ``pids`` (their names carry the
    maker's pid: data/workers.map_shared_file) -- another test run on the machine (a
    developer's, beside CI) makes its own."""
    if not os.path.isdir("/dev/shm"):
        return set()
    mine = {str(p) for p in (os.getpid(),) + pids}
    return {f for f in os.listdir("/dev/shm") if f.startswith("minicaffe")
            and any(f"-{p}-" in f for p in mine)}


def test_a_killed_replica_ends_the_run_in_one_line_and_leaves_nothing():
    before = _shm()
    sp = caffe_pb2.SolverParameter(base_lr=0.1, lr_policy="fixed", display=0,
                                   random_seed=1, snapshot_after_train=False,
                                   solver_mode=caffe_pb2.SolverParameter.CPU)
    text_format.Parse(NET % dict(batch=8, loss="", extra="", ip_in="pool"), sp.net_param)
    s = get_solver(sp, config=RunConfig(cpu_replicas=2))
    try:
        s.step(1)
        pids = s.replica_pids()
        assert len(pids) == 2 and not _shm() - before    # unlinked once mapped
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(MinicaffeError) as e:
            s.step(1)
        assert str(e.value) == (f"replica 1 (pid {pids[1]}) died (killed by SIGKILL); "
                                "training stops")
        assert not multiprocessing.active_children()
        assert s.replica_pids() == []
    finally:
        s.close()
    assert not multiprocessing.active_children()
    assert not _shm() - before


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_stop_the_replicas(tmp_path, sig):
    """The signal goes to the whole process group (a terminal's Ctrl-C, systemd's stop):
    the workers ignore it, the training process stops after the iteration and stops
    them; nothing is left."""
    before = _shm()
    _setup(tmp_path, net=CONST_NET, solver=LONG_SOLVER)
    proc = _Proc(tmp_path, "--replicas", "2")
    i = proc.wait_for(r"CPU replicas: 2 worker processes")
    pids = [int(x) for x in re.search(r"pids ([\d, ]+)\)", proc.lines[i]).group(1).split(",")]
    proc.wait_for(r"Iteration \d+ \(")
    for pid in pids + [proc.p.pid]:     # as to a process group (not pytest's own)
        os.kill(pid, getattr(signal, sig))
    rc = proc.finish()
    assert rc == (128 + signal.SIGTERM if sig == "SIGTERM" else 0), proc.lines[-5:]
    msgs = [l.split("] ", 1)[-1] for l in proc.lines]
    assert any(m.startswith(f"Stopped by {sig} at iteration ") for m in msgs), msgs[-5:]
    assert not any("Traceback" in l or "replica" in l and "died" in l for l in proc.lines)
    assert not [p for p in pids if _alive(p)]
    assert not _shm(proc.p.pid, *pids) - before


def test_no_room_in_dev_shm_is_one_line(monkeypatch):
    """A container's /dev/shm too small for the replicas' file: one line, not a SIGBUS."""
    import errno
    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    before = _shm()
    sp = caffe_pb2.SolverParameter(base_lr=0.1, lr_policy="fixed", display=0,
                                   snapshot_after_train=False,
                                   solver_mode=caffe_pb2.SolverParameter.CPU)
    text_format.Parse(NET % dict(batch=8, loss="", extra="", ip_in="pool"), sp.net_param)
    s = get_solver(sp, config=RunConfig(cpu_replicas=2))
    try:
        with pytest.raises(MinicaffeError, match=r"no room for [\d.]+ MiB of shared memory "
                                                 r"\(No space left on device\).*--shm-size"):
            s.step(1)
    finally:
        s.close()
    assert not _shm() - before and not multiprocessing.active_children()


def test_run_config_refuses_a_bad_count():
    for bad in (0, -2, "many", "", 1.5, True):
        with pytest.raises(ConfigError, match="expected a whole number of worker processes"):
            RunConfig(cpu_replicas=bad)
    assert RunConfig(cpu_replicas="3").cpu_replicas == 3


def _cpus(monkeypatch, n, affinity=True):
    """This process may run on ``n`` CPUs (its affinity mask; or, ``affinity=False``, a
    system without ``sched_getaffinity`` whose ``cpu_count`` is ``n``)."""
    if affinity:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)
    else:
        monkeypatch.delattr(os, "sched_getaffinity", raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: n)


@pytest.mark.parametrize("cpus,affinity,auto", [
    (16, True, 15), (3, True, 2), (2, True, 2), (1, True, 1), (8, False, 7), (1, False, 1)])
def test_auto_is_the_usable_cpus_less_one(monkeypatch, caplog, cpus, affinity, auto):
    """``auto``: the CPUs of the affinity mask (else cpu_count) less one for the main
    process, but 2 on two CPUs (measured faster than one process there, where 3 were
    slower) and 1 on one (one process); said once, when the RunConfig is made."""
    from minicaffe.core.config import auto_replicas, usable_cpus
    _cpus(monkeypatch, cpus, affinity)
    if affinity:
        monkeypatch.setattr(os, "cpu_count", lambda: 64)      # the mask wins
    assert usable_cpus() == cpus and auto_replicas() == auto
    with caplog.at_level("INFO"):
        config = RunConfig(cpu_replicas=" Auto ")
        assert config.cpu_replicas == auto
        assert config.replace(tf32=True).cpu_replicas == auto
    said = [r.getMessage() for r in caplog.records if "auto" in r.getMessage()]
    assert said == [{1: "replicas: auto = 1 (1 CPU: one process, no workers)",
                     2: "replicas: auto = 2 (2 CPUs: with two workers the main process "
                        "mostly waits)"}.get(cpus, f"replicas: auto = {auto} ({cpus} CPUs, "
                                                   "one for the main process)")]


@pytest.mark.parametrize("n,cpus,warned", [(15, 16, False), (16, 16, True), (20, 16, True),
                                           (2, 3, False), (3, 3, True), (2, 2, False),
                                           (3, 2, True), (1, 1, False), (2, 1, True)])
def test_the_warning_when_the_replicas_outnumber_the_cpus(monkeypatch, caplog, n, cpus,
                                                          warned):
    from minicaffe.engine.replicas import warn_oversubscribed
    _cpus(monkeypatch, cpus)
    assert warn_oversubscribed(n) is warned
    lines = _warnings(caplog)
    assert len(lines) == warned
    if warned:
        assert lines[0].startswith(f"--replicas {n}: the main process and {n} workers share "
                                   f"{cpus} CPU(s), so workers are preempted each step")
        assert lines[0].endswith(f"--replicas auto = {cpus if cpus <= 2 else cpus - 1} here")


@pytest.mark.parametrize("value,words", [
    ("0", "--replicas 0: expected a whole number of worker processes, at least 1"),
    ("-2", "--replicas -2: expected a whole number"),
    ("many", "--replicas 'many': expected a whole number of worker processes, at least 1 "
             "(1: one process), or auto (the usable CPUs less one for the main process)"),
    ("2.5", "--replicas '2.5': expected a whole number"),
    ("100000", "more than 4x")])
def test_bad_replicas_is_one_line(cli, tmp_path, value, words):
    _setup(tmp_path)
    for command in (("train", "--solver", "solver.prototxt"),
                    ("time", "--model", "net.prototxt"),
                    ("bench", "--model", "net.prototxt")):
        rc, out, err = cli(*command, "--replicas", value)
        assert rc == 1 and words in _error_line(err), (command, err)
        assert not os.listdir(tmp_path / "snap")       # nothing ran


def test_train_with_replicas_gives_the_weights_of_one_process(cli, tmp_path):
    """The CLI end to end: data layer (DummyData) in the main process, test net, display,
    snapshots; the snapshot's weights match a one-process run's."""
    _setup(tmp_path)
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    assert rc == 0, err
    one = _weights(tmp_path / "snap" / "dummy_iter_10.caffemodel")
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--replicas", "2")
    assert rc == 0, err
    said = [m for m in _messages(err) if m.startswith("CPU replicas")]
    assert len(said) == 1 and "2 worker processes" in said[0] and "slices 4+4" in said[0]
    two = _weights(tmp_path / "snap" / "dummy_iter_10.caffemodel")
    assert one.keys() == two.keys()
    for k in one:
        np.testing.assert_allclose(two[k], one[k], rtol=1e-4, atol=1e-6)
    # resumed from iteration 5 with replicas: the uninterrupted replicas run's bits
    os.remove(tmp_path / "snap" / "dummy_iter_10.caffemodel")
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--replicas", "2",
                       "--snapshot", "snap/dummy_iter_5.solverstate")
    assert rc == 0, err
    resumed = _weights(tmp_path / "snap" / "dummy_iter_10.caffemodel")
    for k in two:
        assert np.array_equal(resumed[k], two[k]), k
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("value,cpus", [("2", 1), ("auto", 3)])
def test_time_with_replicas(cli, tmp_path, monkeypatch, value, cpus):
    """Two replicas, given on 1 CPU (one warning line: three processes on one CPU) or
    ``auto`` on 3 (said once; no warning)."""
    _setup(tmp_path)
    _cpus(monkeypatch, cpus)
    rc, out, err = cli("time", "--model", "net.prototxt", "--iterations", "2",
                       "--replicas", value)
    assert rc == 0, err
    msgs = _messages(err)
    assert any(m.startswith("CPU replicas: 2 worker processes") for m in msgs)
    assert any(m.startswith("Average Forward-Backward (2 replicas): ") for m in msgs), msgs
    said = [m for m in msgs if m.startswith("replicas: auto")]
    warned = [m for m in msgs if "workers share" in m]
    if value == "auto":
        assert said == ["replicas: auto = 2 (3 CPUs, one for the main process)"] and \
            not warned, msgs
    else:
        assert not said and len(warned) == 1 and warned[0].startswith(
            "--replicas 2: the main process and 2 workers share 1 CPU(s)"), msgs
    assert not multiprocessing.active_children()


def test_auto_on_one_cpu_is_one_process(cli, tmp_path, monkeypatch):
    _setup(tmp_path)
    _cpus(monkeypatch, 1)
    rc, out, err = cli("time", "--model", "net.prototxt", "--iterations", "1",
                       "--replicas", "auto")
    assert rc == 0, err
    msgs = _messages(err)
    assert "replicas: auto = 1 (1 CPU: one process, no workers)" in msgs
    assert not any(m.startswith("CPU replicas") or m.startswith("--replicas") for m in msgs)
    assert any(m.startswith("Average Forward-Backward: ") for m in msgs), msgs


def test_bench_with_replicas(cli, tmp_path, monkeypatch):
    from test_bench import LENET, QUICK
    monkeypatch.setenv("GLOG_minloglevel", "0")      # bench's INFO lines too
    rc, out, err = cli("bench", "--model", LENET, "--batch", "6", "--replicas", "2",
                       "--json", "r.json", *QUICK)
    assert rc == 0, err
    assert "minicaffe: 2 replica processes of one thread each (--replicas)" in out
    assert any(m.startswith("CPU replicas: 2 worker processes of one thread each, slices "
                            "3+3 of the batch of 6") for m in _messages(err))
    import json
    assert json.loads((tmp_path / "r.json").read_text())["cpu_replicas"] == 2
    assert not multiprocessing.active_children()          # the solver was closed


# -- the solver's update in the workers (solvers/shares.py) ------------------------------
# conv's weights at lr_mult 1, its bias at lr_mult 2 without decay; ip at lr_mult 0.5
MULTS = NET.replace('convolution_param {', 'param { lr_mult: 1 } param { lr_mult: 2 '
                    'decay_mult: 0 }\n  convolution_param {').replace(
    'inner_product_param {', 'param { lr_mult: 0.5 decay_mult: 3 }\n  inner_product_param {')
SOLVER_FIELDS = {"SGD": {}, "Nesterov": {}, "AdaGrad": {"momentum": 0.0},
                 "RMSProp": {"momentum": 0.0, "rms_decay": 0.95},
                 "AdaDelta": {"base_lr": 1.0, "momentum": 0.95, "delta": 1e-6},
                 "Adam": {"base_lr": 0.01, "momentum2": 0.999}}


class _Ready:
    """An on_gradients_ready callback: the update then runs in the main process."""

    def __init__(self):
        self.calls = 0

    def on_start(self):
        pass

    def on_gradients_ready(self):
        self.calls += 1


def _train_update(replicas, solver_type="SGD", callback=None, steps=STEPS, data=None,
                  **fields):
    """(smoothed losses, weights, diffs after the last step) of ``steps`` steps of MULTS
    (batch 7, lr policy step) with ``fields`` set on the solver."""
    sp = caffe_pb2.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=0.001,
                                   lr_policy="step", gamma=0.5, stepsize=2, display=0,
                                   random_seed=1701, snapshot_after_train=False,
                                   type=solver_type, solver_mode=caffe_pb2.SolverParameter.CPU)
    for k, v in {**SOLVER_FIELDS[solver_type], **fields}.items():
        setattr(sp, k, v)
    text_format.Parse(MULTS % dict(batch=7, loss="", extra="", ip_in="pool"), sp.net_param)
    return _run(sp, replicas, callback, steps, data)


def _run(sp, replicas, callback, steps, data=None):
    """(smoothed losses, weights, diffs) of ``steps`` steps of the solver ``sp`` (a
    batch of 7, random data unless ``data``), ``callback`` added."""
    s = get_solver(sp, config=RunConfig.from_environment(cpu_replicas=replicas))
    if callback is not None:
        s.add_callback(callback)
    rs = np.random.RandomState(0)
    s.net.blobs["data"].data[...] = rs.randn(*s.net.blobs["data"].shape) \
        if data is None else data
    s.net.blobs["label"].data[...] = rs.randint(0, 5, 7)
    seen = []
    try:
        for _ in range(steps):
            s.step(1)
            seen.append(float(s.smoothed_loss))
    finally:
        params = [b for blobs in s.net.params.values() for b in blobs]
        weights = [b.data.copy() for b in params]
        diffs = [b.diff.copy() for b in params]
        s.close()
    return np.array(seen), weights, diffs


def _bits(a, b):
    assert np.array_equal(a[0], b[0])
    for x, y in zip(a[1] + a[2], b[1] + b[2]):
        assert np.array_equal(x, y)


def _close(one, many, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(many[0], one[0], rtol=rtol, atol=atol)
    for x, y in zip(one[1] + one[2], many[1] + many[2]):
        np.testing.assert_allclose(y, x, rtol=rtol, atol=atol)


@pytest.mark.parametrize("solver_type", sorted(SOLVER_FIELDS))
def test_the_workers_update_gives_the_main_process_update_bits(solver_type):
    """Every solver type, lr_mult/decay_mult per parameter, a step lr policy: the workers'
    update of their shares gives the bits of the update in the main process (which a
    callback wanting the summed gradients first makes it run), and one process's weights,
    diffs (the update value, as Caffe leaves it) and losses up to rounding."""
    ready = _Ready()
    main = _train_update(3, solver_type, callback=ready)
    assert ready.calls == STEPS
    workers = _train_update(3, solver_type)
    _bits(main, workers)
    _close(_train_update(1, solver_type), workers)


@pytest.mark.parametrize("fields", [{"iter_size": 2}, {"regularization_type": "L1"},
                                    {"clip_gradients": 0.05}])
def test_the_workers_update_with_iter_size_l1_and_clipping(fields, caplog):
    """iter_size 2 (the first pass's sum overwrites the diffs, the second adds), L1 decay,
    clip_gradients (each share's sum of squares, the scale sent back): one process's
    results up to rounding, the same bits run to run; the clipping is logged as one
    process logs it."""
    one = _train_update(1, "Nesterov", **fields)
    with caplog.at_level("INFO"):
        five = _train_update(5, "Nesterov", **fields)
    _close(one, five)
    _bits(five, _train_update(5, "Nesterov", **fields))
    clipped = [r.getMessage() for r in caplog.records if "Gradient clipping" in r.getMessage()]
    assert len(clipped) == (STEPS if "clip_gradients" in fields else 0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_non_finite_loss_stops_before_the_workers_update(replicas):
    """A NaN in a weight: the run stops on the loss, in one process and with replicas,
    the weights as they were (the workers are not told to update)."""
    from minicaffe.solvers import NonFiniteLossError
    sp = caffe_pb2.SolverParameter(base_lr=0.1, momentum=0.9, lr_policy="fixed",
                                   display=0, random_seed=1701, snapshot_after_train=False,
                                   solver_mode=caffe_pb2.SolverParameter.CPU)
    text_format.Parse(MULTS % dict(batch=7, loss="", extra="", ip_in="pool"), sp.net_param)
    s = get_solver(sp, config=RunConfig.from_environment(cpu_replicas=replicas))
    try:
        s.net.blobs["data"].data[...] = np.random.RandomState(0).randn(7, 2, 8, 8)
        s.net.params["ip"][0].data[0, 0] = np.nan
        before = [b.data.copy() for blobs in s.net.params.values() for b in blobs]
        with pytest.raises(NonFiniteLossError):
            s.step(1)
        after = [b.data.copy() for blobs in s.net.params.values() for b in blobs]
        assert len(s.replica_pids()) == (replicas if replicas > 1 else 0)
    finally:
        s.close()
    for x, y in zip(before, after):
        assert np.array_equal(x, y, equal_nan=True)


def test_the_history_in_the_shared_file_snapshots_and_restores(tmp_path):
    """The solver's history lives in the replicas' shared file: a snapshot after 3 steps
    with replicas, restored in one process and trained 2 more steps, gives one process's
    5 steps up to rounding."""
    def solver(replicas, prefix):
        sp = caffe_pb2.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=0.001,
                                       lr_policy="fixed", display=0, random_seed=1701,
                                       snapshot_after_train=False, type="Adam",
                                       momentum2=0.999, snapshot_prefix=str(prefix),
                                       solver_mode=caffe_pb2.SolverParameter.CPU)
        text_format.Parse(MULTS % dict(batch=7, loss="", extra="", ip_in="pool"),
                          sp.net_param)
        s = get_solver(sp, config=RunConfig.from_environment(cpu_replicas=replicas))
        rs = np.random.RandomState(0)
        s.net.blobs["data"].data[...] = rs.randn(*s.net.blobs["data"].shape)
        s.net.blobs["label"].data[...] = rs.randint(0, 5, 7)
        return s
    s = solver(3, tmp_path / "rep")
    try:
        s.step(3)
        s.snapshot()
    finally:
        s.close()
    resumed = solver(1, tmp_path / "one")
    resumed.restore(str(tmp_path / "rep_iter_3.solverstate"))
    resumed.step(2)
    straight = solver(1, tmp_path / "one")
    straight.step(5)
    for a, b in zip(resumed.net.params.values(), straight.net.params.values()):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.data, y.data, rtol=1e-5, atol=1e-6)
    resumed.close()
    straight.close()


# -- the InnerProduct weight gradients computed over the whole batch ----------------------
# 'big' (40 x 128 weights: more than batch 7 x (40 + 128) floats of inputs and top diffs)
# is gathered; with ``share``, 'big2' shares its weights and neither is
WIDE = """
name: "wide"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 7 dim: 2 dim: 8 dim: 8 } shape { dim: 7 } } }
layer { name: "big" type: "InnerProduct" bottom: "data" top: "big" %(param)s
  inner_product_param { num_output: 40 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "big" top: "big" }
%(extra)s
layer { name: "out" type: "InnerProduct" bottom: "%(out_in)s" top: "out"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "out" bottom: "label" top: "loss" }
"""
SHARED = dict(param='param { name: "w" } param { name: "b" }', out_in="both", extra="""
layer { name: "flat" type: "Flatten" bottom: "data" top: "flat" }
layer { name: "big2" type: "InnerProduct" bottom: "flat" top: "big2"
  param { name: "w" } param { name: "b" }
  inner_product_param { num_output: 40 } }
layer { name: "sum" type: "Eltwise" bottom: "big" bottom: "big2" top: "both" }""")


def _train_wide(replicas, callback=None, steps=STEPS, iter_size=1, solver_type="SGD",
                **net):
    fields = {"param": "", "extra": "", "out_in": "big", **net}
    sp = caffe_pb2.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=0.001,
                                   lr_policy="fixed", display=0, random_seed=1701,
                                   snapshot_after_train=False, iter_size=iter_size,
                                   type=solver_type,
                                   solver_mode=caffe_pb2.SolverParameter.CPU)
    if solver_type == "Adam":
        sp.base_lr, sp.momentum2 = 0.01, 0.999
    text_format.Parse(WIDE % fields, sp.net_param)
    return _run(sp, replicas, callback, steps)


def _gathered_lines(caplog):
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("CPU replicas: the weight gradient of")]


@pytest.mark.parametrize("iter_size,solver_type", [(1, "SGD"), (2, "SGD"), (1, "Adam")])
def test_a_wide_inner_product_weight_gradient_over_the_whole_batch(iter_size, solver_type,
                                                                   caplog):
    """The workers compute 'big''s weight gradient as one product over the batch's
    inputs and top diffs, each on the rows of its share (4 replicas: a batch of 7 in
    1+2+2+2): one process's losses, weights and diffs up to rounding; the same bits run to
    run and with the update in the main process."""
    one = _train_wide(1, iter_size=iter_size, solver_type=solver_type)
    with caplog.at_level("INFO"):
        four = _train_wide(4, iter_size=iter_size, solver_type=solver_type)
    assert _gathered_lines(caplog) == [
        "CPU replicas: the weight gradient of 'big' computed over the whole batch by the "
        "workers, each on its share of the rows"]
    _close(one, four)
    _bits(four, _train_wide(4, iter_size=iter_size, solver_type=solver_type))
    _bits(four, _train_wide(4, callback=_Ready(), iter_size=iter_size,
                            solver_type=solver_type))


def test_shared_inner_product_weights_are_summed_as_the_others(caplog):
    """Two layers sharing one weight: its gradient has two parts, so it is not gathered;
    the run is one process's up to rounding."""
    one = _train_wide(1, **SHARED)
    with caplog.at_level("INFO"):
        three = _train_wide(3, **SHARED)
    assert not _gathered_lines(caplog)
    _close(one, three)
