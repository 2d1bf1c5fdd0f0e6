"""GPU parity: each solver's fused CuPy update against the numpy body on the same
inputs, a training run on CPU vs GPU, snapshot/restore across modes, and the CLI's
GPU paths (run on a GPU machine; skipped elsewhere)."""
import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.solvers import get_solver
from test_solver_nets import (DUMMY_NET, captured_log, feed_memory, linear_net, memory_net,
                              param_arrays, solver_param)

pytestmark = pytest.mark.gpu

KINDS = {
    "SGD": dict(momentum=0.9, weight_decay=0.01),
    "Nesterov": dict(momentum=0.9, weight_decay=0.01, regularization_type="L1"),
    "AdaGrad": dict(delta=1e-6, weight_decay=0.01),
    "RMSProp": dict(rms_decay=0.9, delta=1e-6),
    "AdaDelta": dict(momentum=0.95, delta=1e-6, base_lr=1.0),
    "Adam": dict(momentum=0.9, momentum2=0.999, delta=1e-8, clip_gradients=0.5),
}


def _run(kind, gpu, steps=4, debug_info=False):
    kw = dict(KINDS[kind])
    if debug_info:      # the layer-by-layer executor: the array body of the rule on CuPy
        kw["debug_info"] = True
    kw.setdefault("base_lr", 0.1)
    if gpu:
        context.set_mode_gpu()
    else:
        context.set_mode_cpu()
    try:
        s = get_solver(solver_param(memory_net(4), type=kind, lr_policy="step", stepsize=2,
                                    gamma=0.5, random_seed=21, iter_size=2, **kw))
        rng = np.random.RandomState(5)
        feed_memory(s.net, rng.randn(16, 4, 1, 1), rng.randint(0, 3, 16))
        s.step(steps)
        return param_arrays(s.net), [h.data.copy() for h in s.history]
    finally:
        context.set_mode_cpu()


@pytest.mark.parametrize("eager", [False, True], ids=["fused", "array_body"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_gpu_update_matches_cpu(kind, eager):
    """The GPU step's fused kernel (``fused_rule``) and, with debug_info, the array body
    on CuPy (``compute_update_value``): each rule's two writings, against the CPU."""
    cpu_w, cpu_h = _run(kind, False)
    gpu_w, gpu_h = _run(kind, True, debug_info=eager)
    for a, b in zip(cpu_w + cpu_h, gpu_w + gpu_h):
        scale = max(np.abs(a).max(), 1e-12)
        assert np.abs(a - b).max() / scale < 1e-5


def test_a_user_rule_without_a_fused_kernel_runs_its_own_body_on_the_gpu():
    """A subclass that writes its own update (no ``fused_rule`` of its own) trains on the
    GPU with its own array body on CuPy, layer by layer, as on the CPU; never with the
    parent's fused kernel."""
    from minicaffe.solvers import SGDSolver

    class PlainGD(SGDSolver):     # momentum ignored: SGD's kernel would differ
        def compute_update_value(self, xp, i, rate):
            dt, local_rate, g, h = self._update_inputs(xp, i, rate)
            g *= local_rate

    out = []
    for gpu in (False, True):
        context.set_mode_gpu() if gpu else context.set_mode_cpu()
        try:
            s = PlainGD(solver_param(memory_net(4), base_lr=0.01, lr_policy="fixed",
                                     momentum=0.9, random_seed=21))
            assert not s.uses_gpu_step
            rng = np.random.RandomState(5)
            feed_memory(s.net, rng.randn(16, 4, 1, 1), rng.randint(0, 3, 16))
            s.step(4)
            out.append(param_arrays(s.net))
        finally:
            context.set_mode_cpu()
    for a, b in zip(*out):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_gpu_snapshot_restores_on_cpu(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    context.set_mode_gpu()
    try:
        s = get_solver(solver_param(DUMMY_NET, type="Adam", base_lr=0.01, lr_policy="fixed",
                                    momentum=0.9, random_seed=3, snapshot_prefix="g"))
        s.step(3)
        s.snapshot()
        w, h = param_arrays(s.net), [x.data.copy() for x in s.history]
    finally:
        context.set_mode_cpu()
    c = get_solver(solver_param(DUMMY_NET, type="Adam", base_lr=0.01, lr_policy="fixed",
                                momentum=0.9, random_seed=4, snapshot_prefix="c"))
    c.restore("g_iter_3.solverstate")
    for a, b in zip(w + h, param_arrays(c.net) + [x.data for x in c.history]):
        np.testing.assert_array_equal(a, b)


def test_gpu_training_logs_and_learns():
    context.set_mode_gpu()
    try:
        s = get_solver(solver_param(linear_net(), type="SGD", base_lr=0.5, momentum=0.9,
                                    lr_policy="fixed", display=5, max_iter=20,
                                    snapshot_after_train=False))
        rng = np.random.RandomState(0)
        s.net.blobs["data"].data[...] = rng.randn(4, 3)
        s.net.blobs["label"].data[...] = [0, 1, 2, 0]
        with captured_log() as lines:
            s.solve()
        losses = [float(l.rsplit("= ", 1)[1]) for l in lines if "Iteration" in l and "loss = " in l
                  and "(" in l]
        assert losses[-1] < losses[0]
    finally:
        context.set_mode_cpu()


def test_cli_gpu_train_time_and_device_query(tmp_path, monkeypatch, capsys):
    from minicaffe.core import log
    from minicaffe.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(DUMMY_NET)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 5\ndisplay: 1\n'
        'snapshot_prefix: "s"\nsolver_mode: CPU\n')
    handlers, level = list(log.logger.handlers), log.logger.level
    try:
        assert main(["train", "--solver", "solver.prototxt", "--gpu", "0"]) == 0
        err = capsys.readouterr().err
        assert "Using GPUs 0" in err and "GPU 0: " in err
        assert main(["time", "--model", "net.prototxt", "--gpu", "0", "--iterations", "2"]) == 0
        assert "Average Forward-Backward" in capsys.readouterr().err
        assert main(["device_query", "--gpu", "0"]) == 0
        err = capsys.readouterr().err
        assert "Device id:                     0" in err and "Total global memory:" in err
    finally:
        context.set_mode_cpu()
        for h in list(log.logger.handlers):
            log.logger.removeHandler(h)
        for h in handlers:
            log.logger.addHandler(h)
        log.logger.setLevel(level)
