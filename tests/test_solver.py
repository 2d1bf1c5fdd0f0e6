"""Solvers against hand-computed references (numpy formulas written from Caffe's
sgd_solver.cpp and friends), lr policies against their formulas, the training loop's
log lines, testing, callbacks, action requests, determinism and bad input."""
import math
import re

import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.errors import ConfigError, MinicaffeError
from minicaffe.proto import caffe_pb2
from minicaffe.solvers import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,
                               NonFiniteLossError, RMSPropSolver, SGDSolver, SolverAction,
                               get_solver, learning_rate)
from test_solver_nets import (CONST_NET, DUMMY_NET, LENET_SOLVER, captured_log, feed_memory,
                              linear_net, memory_net, messages, param_arrays, solver_param)

# -- the hand-computed reference ----------------------------------------------------------------
RNG = np.random.RandomState(7)
X = RNG.uniform(-1, 1, (4, 3))
Y = np.array([0, 2, 1, 2])


def softmax_grads(W, b, x, y):
    """Gradients of SoftmaxWithLoss (normalized by the batch) of a linear layer."""
    z = x @ W.T + b
    z = z - z.max(1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(1, keepdims=True)
    n = len(y)
    dz = p.copy()
    dz[np.arange(n), y] -= 1
    dz /= n
    return dz.T @ x, dz.sum(0)


def reference(kind, W, b, steps, base_lr, lr_fn=None, momentum=0.0, momentum2=0.999,
              delta=1e-8, rms_decay=0.99, weight_decay=0.0, reg="L2", clip=-1.0,
              lr_mult=(1, 2), decay_mult=(1, 0)):
    params = [W.astype(np.float64), b.astype(np.float64)]
    h = [np.zeros_like(p) for p in params]
    h2 = [np.zeros_like(p) for p in params]
    for it in range(steps):
        grads = list(softmax_grads(params[0], params[1], X, Y))
        rate = lr_fn(it) if lr_fn else base_lr
        if clip >= 0:
            norm = math.sqrt(sum((g * g).sum() for g in grads))
            if norm > clip:
                grads = [g * (clip / norm) for g in grads]
        for i in range(2):
            w, g = params[i], grads[i]
            decay = weight_decay * decay_mult[i]
            g = g + decay * (w if reg == "L2" else np.sign(w))
            lr = rate * lr_mult[i]
            if kind == "SGD":
                h[i] = momentum * h[i] + lr * g
                upd = h[i]
            elif kind == "Nesterov":
                old = h[i]
                h[i] = momentum * h[i] + lr * g
                upd = (1 + momentum) * h[i] - momentum * old
            elif kind == "AdaGrad":
                h[i] = h[i] + g * g
                upd = lr * g / (np.sqrt(h[i]) + delta)
            elif kind == "RMSProp":
                h[i] = rms_decay * h[i] + (1 - rms_decay) * g * g
                upd = lr * g / (np.sqrt(h[i]) + delta)
            elif kind == "AdaDelta":
                h[i] = momentum * h[i] + (1 - momentum) * g * g
                step = g * np.sqrt((h2[i] + delta) / (h[i] + delta))
                h2[i] = momentum * h2[i] + (1 - momentum) * step * step
                upd = lr * step
            elif kind == "Adam":
                t = it + 1
                h[i] = momentum * h[i] + (1 - momentum) * g
                h2[i] = momentum2 * h2[i] + (1 - momentum2) * g * g
                corr = math.sqrt(1 - momentum2 ** t) / (1 - momentum ** t)
                upd = lr * corr * h[i] / (np.sqrt(h2[i]) + delta)
            params[i] = w - upd
    return params


CASES = {
    "sgd": ("SGD", dict(base_lr=0.5, momentum=0.9, weight_decay=0.01)),
    "sgd_l1": ("SGD", dict(base_lr=0.5, momentum=0.5, weight_decay=0.05, reg="L1")),
    "sgd_clip": ("SGD", dict(base_lr=0.5, momentum=0.9, clip=0.05)),
    "nesterov": ("Nesterov", dict(base_lr=0.5, momentum=0.9, weight_decay=0.01)),
    "adagrad": ("AdaGrad", dict(base_lr=0.3, delta=1e-6, weight_decay=0.01)),
    "rmsprop": ("RMSProp", dict(base_lr=0.1, delta=1e-6, rms_decay=0.9)),
    "adadelta": ("AdaDelta", dict(base_lr=1.0, momentum=0.95, delta=1e-6, weight_decay=0.01)),
    "adam": ("Adam", dict(base_lr=0.05, momentum=0.9, momentum2=0.999, delta=1e-8,
                          weight_decay=0.01)),
}


def make_solver(kind, steps=3, lr_policy="fixed", extra="", **kw):
    fields = dict(type=kind, base_lr=kw["base_lr"], lr_policy=lr_policy, max_iter=steps,
                  display=0, snapshot_after_train=False, random_seed=3)
    for src, dst in (("momentum", "momentum"), ("momentum2", "momentum2"), ("delta", "delta"),
                     ("rms_decay", "rms_decay"), ("weight_decay", "weight_decay"),
                     ("reg", "regularization_type"), ("clip", "clip_gradients")):
        if src in kw:
            fields[dst] = kw[src]
    s = get_solver(solver_param(linear_net(), extra, **fields))
    s.net.blobs["data"].data[...] = X
    s.net.blobs["label"].data[...] = Y
    return s


@pytest.mark.parametrize("case", sorted(CASES))
def test_update_matches_hand_computed_reference(case):
    kind, kw = CASES[case]
    s = make_solver(kind, **kw)
    W0, b0 = param_arrays(s.net)
    steps = 3
    s.step(steps)
    W, b = param_arrays(s.net)
    rW, rb = reference(kind, W0, b0, steps, **kw)
    assert not np.allclose(W, W0)
    np.testing.assert_allclose(W, rW, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(b, rb, rtol=2e-5, atol=1e-6)
    assert s.iter == steps


def test_solver_classes_by_type():
    kinds = {"SGD": SGDSolver, "Nesterov": NesterovSolver, "AdaGrad": AdaGradSolver,
             "RMSProp": RMSPropSolver, "AdaDelta": AdaDeltaSolver, "Adam": AdamSolver}
    for name, cls in kinds.items():
        momentum = 0 if name in ("AdaGrad", "RMSProp") else 0.9
        s = get_solver(solver_param(linear_net(), type=name, base_lr=0.1, lr_policy="fixed",
                                    momentum=momentum))
        assert type(s) is cls and s.type == name
        n_sets = 2 if name in ("AdaDelta", "Adam") else 1
        assert len(s.history) == n_sets * len(s.net.learnable_params)


def test_step_policy_with_sgd_matches_reference():
    kw = dict(base_lr=0.5, momentum=0.9)
    s = make_solver("SGD", lr_policy="step", extra="stepsize: 2 gamma: 0.1", **kw)
    W0, b0 = param_arrays(s.net)
    s.step(3)
    rW, rb = reference("SGD", W0, b0, 3, lr_fn=lambda it: 0.5 * 0.1 ** (it // 2), **kw)
    np.testing.assert_allclose(param_arrays(s.net)[0], rW, rtol=2e-5, atol=1e-6)


def test_clip_gradients_logs_caffe_line():
    kind, kw = CASES["sgd_clip"]
    s = make_solver(kind, **kw)
    with captured_log() as lines:
        s.step(1)
    msg = [m for m in messages(lines) if m.startswith("Gradient clipping")]
    assert len(msg) == 1
    m = re.match(r"Gradient clipping: scaling down gradients \(L2 norm (\S+) > 0\.05\) by scale "
                 r"factor (\S+)$", msg[0])
    gW, gb = softmax_grads(*[a.astype(np.float64) for a in param_arrays(make_solver(kind, **kw).net)],
                           X, Y)
    norm = math.sqrt((gW ** 2).sum() + (gb ** 2).sum())
    assert float(m.group(1)) == pytest.approx(norm, rel=1e-5)
    assert float(m.group(2)) == pytest.approx(0.05 / norm, rel=1e-5)


def test_iter_size_accumulates_like_a_bigger_batch():
    rng = np.random.RandomState(0)
    data = rng.randn(8, 4, 1, 1).astype(np.float32)
    labels = rng.randint(0, 3, 8).astype(np.float32)
    results = []
    for batch, iter_size in ((4, 1), (2, 2)):
        s = get_solver(solver_param(memory_net(batch), type="SGD", base_lr=0.2, momentum=0.9,
                                    lr_policy="fixed", random_seed=11, iter_size=iter_size,
                                    weight_decay=0.001))
        feed_memory(s.net, data, labels)
        s.step(4)
        results.append(param_arrays(s.net))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lr_mult_zero_freezes_a_param():
    text = linear_net().replace("param { lr_mult: 2 decay_mult: 0 }",
                                "param { lr_mult: 0 decay_mult: 0 }")
    s = get_solver(solver_param(text, type="SGD", base_lr=0.5, momentum=0.9, lr_policy="fixed"))
    s.net.blobs["data"].data[...] = X
    s.net.blobs["label"].data[...] = Y
    b0 = s.net.learnable_params[1].data.copy()
    s.step(2)
    np.testing.assert_array_equal(s.net.learnable_params[1].data, b0)


# -- learning-rate policies ------------------------------------------------------------------
def _lr_param(policy, **kw):
    p = caffe_pb2.SolverParameter(lr_policy=policy, base_lr=0.01)
    for k, v in kw.items():
        if k == "stepvalue":
            p.stepvalue.extend(v)
        else:
            setattr(p, k, v)
    return p


POLICY_CASES = [
    ("fixed", {}, lambda it: 0.01),
    ("step", dict(gamma=0.5, stepsize=30), lambda it: 0.01 * 0.5 ** (it // 30)),
    ("exp", dict(gamma=0.99), lambda it: 0.01 * 0.99 ** it),
    ("inv", dict(gamma=0.0001, power=0.75), lambda it: 0.01 * (1 + 0.0001 * it) ** -0.75),
    ("multistep", dict(gamma=0.1, stepvalue=[20, 50, 70]),
     lambda it: 0.01 * 0.1 ** sum(it >= v for v in (20, 50, 70))),
    ("poly", dict(power=2.0, max_iter=100), lambda it: 0.01 * (1 - it / 100) ** 2),
    ("sigmoid", dict(gamma=-0.1, stepsize=40), None),  # negative gamma is refused
    ("sigmoid", dict(gamma=0.1, stepsize=40),
     lambda it: 0.01 / (1 + math.exp(-0.1 * (it - 40)))),
]


@pytest.mark.parametrize("policy,kw,formula", POLICY_CASES,
                         ids=[f"{c[0]}{i}" for i, c in enumerate(POLICY_CASES)])
def test_lr_policy_matches_formula(policy, kw, formula):
    from minicaffe.solvers.lr_policy import check_policy
    p = _lr_param(policy, **kw)
    if formula is None:
        with pytest.raises(ConfigError, match="gamma >= 0"):
            check_policy(p)
        return
    check_policy(p)
    step = 0
    for it in range(0, 100):
        rate, step = learning_rate(p, it, step)
        assert rate.dtype == np.float32
        assert float(rate) == pytest.approx(formula(it), rel=2e-6), it


def test_lenet_inv_rate_at_iteration_100_prints_as_caffe():
    p = _lr_param("inv", gamma=0.0001, power=0.75)
    rate, _ = learning_rate(p, 100, 0)
    assert "%g" % rate == "0.00992565"


def test_lenet_solver_logs_caffe_lines():
    """lenet_solver.prototxt's schedule on a small net: the lines of Caffe's log."""
    p = solver_param(linear_net(), LENET_SOLVER.replace("test_iter: 100\ntest_interval: 500\n", ""),
                     max_iter=101, snapshot=0, snapshot_after_train=False)
    s = get_solver(p)
    s.net.blobs["data"].data[...] = X
    s.net.blobs["label"].data[...] = Y
    with captured_log() as lines:
        s.solve()
    msgs = messages(lines)
    assert msgs[0] == "Solving linear"
    assert msgs[1] == "Learning Rate Policy: inv"
    assert "Iteration 100, lr = 0.00992565" in msgs
    assert "Iteration 0, lr = 0.01" in msgs
    it100 = [m for m in msgs if m.startswith("Iteration 100 (")]
    assert len(it100) == 1
    assert re.match(r"Iteration 100 \(\S+ iter/s, \S+s/100 iters\), loss = \S+$", it100[0])
    train_out = [m for m in msgs if "Train net output" in m]
    assert len(train_out) == 2
    m = re.match(r"    Train net output #0: loss = (\S+) \(\* 1 = (\S+) loss\)$", train_out[1])
    assert m and m.group(1) == m.group(2)
    assert msgs[-1] == "Optimization Done."
    # lines carry the glog header Caffe's tools expect
    assert all(re.match(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ", l) for l in lines)


def test_display_zero_logs_no_iterations():
    s = make_solver("SGD", base_lr=0.1)
    with captured_log() as lines:
        s.step(3)
    assert not [m for m in messages(lines) if m.startswith("Iteration")]


def test_smoothed_loss_is_a_running_mean_over_average_loss():
    s = make_solver("SGD", base_lr=0.1)
    s.param.average_loss = 3
    losses = [4.0, 1.0, 2.0, 8.0, 5.0, 3.0]
    s.losses, s.smoothed_loss = [], np.float32(0)
    for k, loss in enumerate(losses):
        s.iter = k
        s.update_smoothed_loss(loss, 0, 3)
        window = losses[max(0, k - 2):k + 1]
        assert float(s.smoothed_loss) == pytest.approx(sum(window) / len(window), rel=1e-6)


def test_debug_info_prints_blob_norms_at_display():
    s = make_solver("SGD", base_lr=0.1)
    s.param.debug_info = True
    s.param.display = 2
    with captured_log() as lines:
        s.step(3)
    fwd = [m for m in messages(lines) if "[Forward] Layer ip, top blob ip data:" in m]
    assert len(fwd) == 2  # iterations 0 and 2
    assert any("[Backward] All net params (data, diff)" in m for m in messages(lines))


# -- testing -------------------------------------------------------------------------------------
def _memory_solver(n_test_batches=3, **fields):
    text = memory_net(2).replace(
        'layer { name: "loss"',
        'layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy" '
        'include { phase: TEST } }\nlayer { name: "loss"')
    fields.setdefault("test_iter", [n_test_batches])
    fields.setdefault("test_interval", 5)
    s = get_solver(solver_param(text, type="SGD", base_lr=0.1, lr_policy="fixed",
                                random_seed=5, **fields))
    rng = np.random.RandomState(1)
    for net in [s.net] + s.test_nets:
        feed_memory(net, rng.randn(6, 4, 1, 1), rng.randint(0, 3, 6))
    return s


def test_test_outputs_are_averaged_over_test_iter_and_logged():
    s = _memory_solver(3, test_compute_loss=True)
    net = s.test_nets[0]
    assert net.phase == caffe_pb2.TEST and "accuracy" in net.outputs
    net.share_trained_layers_with(s.net)
    acc, loss = [], []
    for _ in range(3):
        net.forward_prefilled()
        acc.append(float(net.blobs["accuracy"].data))
        loss.append(float(net.blobs["loss"].data))
    with captured_log() as lines:
        means = s.test(0)
    assert means == pytest.approx([np.mean(acc), np.mean(loss)], rel=1e-6)
    msgs = messages(lines)
    assert msgs[0] == "Iteration 0, Testing net (#0)"
    assert msgs[1] == "Test loss: %g" % np.float32(np.mean(loss))
    assert msgs[2] == "    Test net output #0: accuracy = %g" % np.float32(means[0])
    lw = "%g" % np.float32(means[1])
    assert msgs[3] == f"    Test net output #1: loss = {lw} (* 1 = {lw} loss)"


def test_test_net_shares_the_trained_weights():
    s = _memory_solver(1)
    s.step(2)
    s.test(0)
    for a, b in zip(s.net.learnable_params, s.test_nets[0].learnable_params):
        np.testing.assert_array_equal(a.data, b.data)


def test_tests_run_every_test_interval_and_at_the_end():
    s = _memory_solver(1, test_interval=4, max_iter=8, display=0, snapshot_after_train=False)
    with captured_log() as lines:
        s.solve()
    tests = [m for m in messages(lines) if "Testing net" in m]
    assert tests == ["Iteration 0, Testing net (#0)", "Iteration 4, Testing net (#0)",
                     "Iteration 8, Testing net (#0)"]
    s2 = _memory_solver(1, test_interval=4, max_iter=4, test_initialization=False,
                        snapshot_after_train=False)
    with captured_log() as lines:
        s2.solve()
    assert [m for m in messages(lines) if "Testing net" in m] == ["Iteration 4, Testing net (#0)"]


def test_loss_weight_appears_in_test_output():
    text = CONST_NET.replace('top: "loss" }', 'top: "loss" loss_weight: 2 }')
    s = get_solver(solver_param(text, base_lr=0.1, lr_policy="fixed", test_iter=[2],
                                test_interval=10))
    with captured_log() as lines:
        s.test(0)
    out = [m for m in messages(lines) if "Test net output" in m][0]
    m = re.match(r"    Test net output #0: loss = (\S+) \(\* 2 = (\S+) loss\)$", out)
    assert float(m.group(2)) == pytest.approx(2 * float(m.group(1)), rel=1e-5)


def test_several_test_nets_with_test_state_and_train_state():
    text = DUMMY_NET.replace(
        'layer { name: "loss"',
        'layer { name: "extra" type: "Accuracy" bottom: "ip2" bottom: "label" top: "extra_acc" '
        'include { stage: "b" } }\nlayer { name: "loss"')
    p = solver_param(text, base_lr=0.1, lr_policy="fixed", test_iter=[1, 2], test_interval=5,
                     text='test_state { stage: "a" } test_state { stage: "b" } '
                          'train_state { stage: "b" }')
    tp = p.test_net_param.add()
    tp.CopyFrom(p.net_param)
    p.test_iter.append(1)
    p.test_state.add(stage=["c"])
    s = get_solver(p)
    assert len(s.test_nets) == 3
    assert [list(n.net_param.state.stage) for n in s.test_nets] == [["a"], ["b"], ["c"]]
    assert all(n.phase == caffe_pb2.TEST for n in s.test_nets)
    assert "extra_acc" in s.test_nets[1].outputs and "extra_acc" not in s.test_nets[0].outputs
    assert s.net.phase == caffe_pb2.TRAIN and "extra_acc" in s.net.outputs
    with captured_log() as lines:
        s.test_all()
    assert [m for m in messages(lines) if "Testing net" in m] == [
        "Iteration 0, Testing net (#0)", "Iteration 0, Testing net (#1)",
        "Iteration 0, Testing net (#2)"]


def test_test_net_files_resolve_relative_to_solver(tmp_path, monkeypatch):
    (tmp_path / "net.prototxt").write_text(DUMMY_NET)
    (tmp_path / "solver.prototxt").write_text(
        'train_net: "net.prototxt"\ntest_net: "net.prototxt"\ntest_iter: 1\ntest_interval: 2\n'
        'base_lr: 0.1\nlr_policy: "fixed"\nsolver_mode: CPU\n')
    monkeypatch.chdir("/")
    s = get_solver(str(tmp_path / "solver.prototxt"))
    assert len(s.test_nets) == 1
    assert s.param.snapshot_prefix == str(tmp_path / "solver")


# -- determinism, callbacks, actions, root ------------------------------------------------------
def _dummy_solver(seed=42, **fields):
    fields.setdefault("max_iter", 12)
    fields.setdefault("snapshot_after_train", False)
    return get_solver(solver_param(DUMMY_NET, type="SGD", base_lr=0.1, momentum=0.9,
                                   lr_policy="fixed", random_seed=seed, **fields))


def test_random_seed_makes_a_cpu_run_bit_identical():
    runs = []
    for _ in range(2):
        s = _dummy_solver()
        s.solve()
        runs.append(param_arrays(s.net))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
    s = _dummy_solver(seed=43)
    s.solve()
    assert not np.array_equal(param_arrays(s.net)[0], runs[0][0])


def test_callbacks_run_as_caffe_step_calls_them():
    s = _dummy_solver()
    events = []

    class CB:
        def on_start(self):
            events.append(("start", s.iter))

        def on_gradients_ready(self):
            # the diffs hold this iteration's raw gradient, not yet applied
            events.append(("ready", s.iter, float(np.abs(s.net.learnable_params[0].diff).sum())))

    s.add_callback(CB())
    s.step(3)
    assert [e[:2] for e in events] == [("start", 0), ("ready", 0), ("start", 1), ("ready", 1),
                                       ("start", 2), ("ready", 2)]
    assert all(e[2] > 0 for e in events if e[0] == "ready")


def test_action_requests_snapshot_and_stop(tmp_path):
    s = _dummy_solver(snapshot_prefix=str(tmp_path / "a"), max_iter=10, snapshot_after_train=True)
    requests = {3: SolverAction.SNAPSHOT, 5: SolverAction.STOP}
    s.set_action_function(lambda: requests.get(s.iter, SolverAction.NONE))
    with captured_log() as lines:
        s.solve()
    assert s.iter == 5
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["a_iter_3.caffemodel", "a_iter_3.solverstate",
                     "a_iter_5.caffemodel", "a_iter_5.solverstate"]
    msgs = messages(lines)
    assert "Optimization stopped early." in msgs and "Optimization Done." not in msgs


def test_only_the_root_solver_logs_tests_and_snapshots():
    context.set_solver_rank(1)
    try:
        with captured_log() as lines:
            s = _dummy_solver(test_iter=[1], test_interval=2, display=1)
            s.step(3)
        assert s.test_nets == []
        assert not any("Iteration" in m or "Testing" in m for m in messages(lines))
        with pytest.raises(MinicaffeError, match="root"):
            s.snapshot()
    finally:
        context.set_solver_rank(0)


def test_nonfinite_loss_names_iteration_and_layer():
    text = CONST_NET.replace("value: 0.3", "value: 1e30").replace(
        "weight_filler { type: \"gaussian\" std: 0.3 }",
        "weight_filler { type: \"constant\" value: 1e30 }")
    s = get_solver(solver_param(text, base_lr=0.1, lr_policy="fixed", max_iter=5))
    with pytest.raises(NonFiniteLossError) as e, np.errstate(all="ignore"):
        s.step(5)
    msg = str(e.value)
    assert "Iteration 0" in msg and "layer 'ip1'" in msg and "top 'ip1'" in msg
    assert "\n" not in msg


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,text,match", [
    (dict(type="Foo"), "", "unknown solver type 'Foo'"),
    (dict(lr_policy="cosine"), "", "unknown lr_policy 'cosine'"),
    (dict(lr_policy=""), "", "lr_policy is not set"),
    (dict(lr_policy="step"), "", "needs stepsize > 0"),
    (dict(type="AdaGrad", momentum=0.9), "", "momentum cannot be used with AdaGrad"),
    (dict(type="RMSProp", rms_decay=1.5), "", "rms_decay"),
    (dict(regularization_type="L3"), "", "regularization_type"),
    (dict(average_loss=0), "", "average_loss"),
    (dict(test_iter=[1]), "", "test_interval must be positive"),
    (dict(test_state=None), 'test_state { stage: "a" } test_state { stage: "b" }', "test_state"),
    (dict(snapshot=5), "", "snapshot_prefix"),
    (dict(snapshot=5, snapshot_prefix="/nonexistent/dir/x"), "", "cannot write to snapshot"),
])
def test_bad_solver_parameters_are_one_line_errors(fields, text, match):
    base = dict(base_lr=0.1, lr_policy="fixed")
    base.update({k: v for k, v in fields.items() if v is not None})
    p = solver_param(linear_net(), text, **base)
    if "test_state" in fields:
        p.test_iter.append(1)
        p.test_interval = 1
    with pytest.raises(MinicaffeError, match=match) as e:
        get_solver(p)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field,value,match", [
    ("max_iter", -5, "max_iter must be >= 0, got -5"),
    ("snapshot", -1, "snapshot must be >= 0"),
    ("display", -10, "display must be >= 0"),
    ("base_lr", -0.01, "base_lr must be >= 0"),
    ("weight_decay", -0.0005, "weight_decay must be >= 0"),
    ("clip_gradients", -5, "clip_gradients must be >= 0 .or -1"),
    ("stepvalue", [300, 200], "stepvalue must increase .got 300, 200."),
    ("test_iter", [0], "test_iter must be positive"),
])
def test_nonsense_solver_values_name_file_and_field(tmp_path, field, value, match):
    (tmp_path / "net.prototxt").write_text(linear_net())
    p = solver_param(None, net=str(tmp_path / "net.prototxt"), base_lr=0.1, lr_policy="fixed",
                     test_interval=5)
    if field != "test_iter":
        p.test_iter.append(1)
    f = getattr(p, field)
    if hasattr(f, "extend"):
        del f[:]
        f.extend(value)
    else:
        setattr(p, field, value)
    path = tmp_path / "solver.prototxt"
    from minicaffe.core.protoio import write_text
    write_text(str(path), p)
    with pytest.raises(ConfigError, match=match) as e:
        get_solver(str(path))
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("net,match", [
    ("", "the train net has no layers"),
    ('name: "x"\nlayer { name: "d" type: "DummyData" top: "d" dummy_data_param { shape { dim: 2 '
     'dim: 3 } } }\nlayer { name: "ip" type: "InnerProduct" bottom: "d" top: "ip" '
     'inner_product_param { num_output: 2 } }', "the train net has no loss"),
])
def test_train_net_that_cannot_learn_names_its_file(tmp_path, net, match):
    (tmp_path / "net.prototxt").write_text(net)
    p = solver_param(None, net=str(tmp_path / "net.prototxt"), base_lr=0.1, lr_policy="fixed")
    with pytest.raises(ConfigError, match=match) as e:
        get_solver(p)
    assert str(e.value).startswith(str(tmp_path / "net.prototxt") + ": ")


def test_unwritable_snapshot_folder_is_found_before_training(tmp_path):
    """snapshot: 0 still writes the final snapshot (snapshot_after_train): check at start."""
    p = solver_param(linear_net(), base_lr=0.1, lr_policy="fixed", max_iter=3,
                     snapshot_prefix=str(tmp_path / "missing" / "run"))
    with pytest.raises(MinicaffeError, match="cannot write to snapshot prefix"):
        get_solver(p)
    p.snapshot_after_train = False  # nothing will be written: nothing to check
    get_solver(p)


def test_solver_without_net_or_with_two_nets():
    p = solver_param(None, base_lr=0.1, lr_policy="fixed")
    with pytest.raises(ConfigError, match="defines no net"):
        get_solver(p)
    p = solver_param(linear_net(), base_lr=0.1, lr_policy="fixed", train_net="x.prototxt")
    with pytest.raises(ConfigError, match="more than one"):
        get_solver(p)


def test_test_iter_must_match_test_nets():
    p = solver_param(None, base_lr=0.1, lr_policy="fixed", test_iter=[1, 2], test_interval=2)
    parse_net = caffe_pb2.NetParameter()
    from minicaffe.core.protoio import parse_text
    parse_text(linear_net(), parse_net)
    p.train_net_param.CopyFrom(parse_net)
    p.test_net_param.add().CopyFrom(parse_net)
    with pytest.raises(ConfigError, match="test_iter must be specified for each test network"):
        get_solver(p)


def test_deprecated_solver_type_is_upgraded():
    p = solver_param(linear_net(), base_lr=0.1, lr_policy="fixed", momentum=0.9)
    p.solver_type = caffe_pb2.SolverParameter.NESTEROV
    s = get_solver(p)
    assert isinstance(s, NesterovSolver) and s.param.type == "Nesterov"
    assert not s.param.HasField("solver_type")
    p.type = "SGD"
    with pytest.raises(ConfigError, match="cannot both be given"):
        get_solver(p)


FUSED_KINDS = {
    "SGD": dict(momentum=0.9), "Nesterov": dict(momentum=0.9),
    "AdaGrad": dict(delta=1e-6), "RMSProp": dict(rms_decay=0.9, delta=1e-6),
    "AdaDelta": dict(momentum=0.95, delta=1e-6),
    "Adam": dict(momentum=0.9, momentum2=0.999, delta=1e-8),
}


def _fused_body(rule, scalars, g, h, h2, lr, extra):
    """Run a ``fused_rule``'s CUDA body on float32 numpy arrays, statement by statement
    (each element as the GPU kernel computes it: one float32 operation at a time)."""
    params, n_hist, body = rule
    env = {p.split()[-1]: v for p, v in zip(params.split(","), scalars)}
    # flat arrays indexed by every i at once (a fancy index reads a copy, as a register)
    env.update(g=g.ravel().copy(), h=h.ravel().copy(), h2=h2.ravel().copy(),
               i=np.arange(g.size), lr=np.float32(lr), sc=[None, np.float32(extra)],
               sqrt=np.sqrt, T=np.float32)
    for stmt in body.replace("(T)1", "T(1)").split(";"):
        stmt = stmt.strip()
        if stmt:
            exec(stmt[2:] if stmt.startswith("T ") else stmt, env)
    return tuple(env[k].reshape(g.shape) for k in ("u", "h", "h2")) + (n_hist,)


@pytest.mark.parametrize("kind", sorted(FUSED_KINDS))
def test_each_rules_fused_kernel_body_rounds_as_its_array_body(kind):
    """Each SGD-family rule is written once per form, side by side in its class: the array
    body (``compute_update_value``, numpy/CuPy) and the fused GPU kernel's body
    (``fused_rule``).  Run here on the CPU, the kernel's body gives the same bits, and
    the history sets it uses are the solver's."""
    s = get_solver(solver_param(memory_net(4), type=kind, base_lr=0.1, lr_policy="fixed",
                                **FUSED_KINDS[kind]))
    rng = np.random.RandomState(3)
    n = len(s.net.learnable_params)
    b = s.net.learnable_params[0]
    g0 = rng.randn(*b.shape).astype(np.float32)
    h0 = np.abs(rng.randn(*b.shape)).astype(np.float32)
    h20 = np.abs(rng.randn(*b.shape)).astype(np.float32)
    b.diff[...] = g0
    s.history[0].data[...] = h0
    if s.n_history_sets > 1:
        s.history[n].data[...] = h20
    s.iter = 3
    rate = np.float32(0.1)
    local = np.float32(rate * np.float32(s.net.params_lr[0]))
    u, h, h2, n_hist = _fused_body(s.fused_rule, s.fused_scalars(), g0, h0, h20, local,
                                   s.fused_extra())
    s.compute_update_value(np, 0, rate)
    assert n_hist == s.n_history_sets
    np.testing.assert_array_equal(b.diff, u)
    np.testing.assert_array_equal(s.history[0].data, h)
    if n_hist > 1:
        np.testing.assert_array_equal(s.history[n].data, h2)
    assert not np.array_equal(u, g0)


class _SignSGD(SGDSolver):
    """A user's rule (signSGD: w -= lr * sign(g)), its array body only."""

    def compute_update_value(self, xp, i, rate):
        dt, local_rate, g, h = self._update_inputs(xp, i, rate)
        xp.sign(g, out=g)
        g *= local_rate


def test_a_subclass_with_its_own_update_gets_no_inherited_fused_kernel(monkeypatch):
    """A subclass of an SGD-family solver that writes its own update without its own
    ``fused_rule`` has none (the parent's kernel would compute the parent's rule on the
    GPU): on a GPU it runs layer by layer, its array body on CuPy.  A built-in rule keeps
    its kernel."""
    param = dict(base_lr=0.1, lr_policy="fixed", momentum=0.9)
    mine = _SignSGD(solver_param(memory_net(4), **param))
    plain = SGDSolver(solver_param(memory_net(4), **param))
    adam = AdamSolver(solver_param(memory_net(4), base_lr=0.1, lr_policy="fixed"))
    assert mine.fused_rule is None
    assert plain.fused_rule is not None and adam.fused_rule is not None
    monkeypatch.setattr(context, "is_gpu", lambda: True)   # what the solver would choose
    assert not mine.uses_gpu_step
    assert plain.uses_gpu_step and adam.uses_gpu_step
    monkeypatch.undo()
    # its own rule is the one that runs: each weight moves by lr x lr_mult x sign(g)
    rng = np.random.RandomState(5)
    feed_memory(mine.net, rng.randn(16, 4, 1, 1), rng.randint(0, 3, 16))
    before = param_arrays(mine.net)
    mine.step(1)
    for a, b, mult in zip(before, param_arrays(mine.net), mine.net.params_lr):
        moved = np.abs(a - b)[a != b]
        assert moved.size
        np.testing.assert_allclose(moved, 0.1 * mult, rtol=1e-5)
