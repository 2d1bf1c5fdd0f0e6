"""The PyTorch twin computes minicaffe's training step: same loss, same parameter
gradients, same weights after the solver's updates (CPU, fp32).  This is what makes
``minicaffe bench --compare torch`` a comparison of one computation, and it checks
Caffe's convolution, pooling, LRN, BatchNorm, Eltwise and loss semantics against
PyTorch's."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from minicaffe import synthetic  # noqa: E402
from minicaffe.network.net import Net, TEST  # noqa: E402
from minicaffe.proto import caffe_pb2  # noqa: E402
from minicaffe.torch_twin import TorchTwin, UntranslatableError, make_optimizer  # noqa: E402

from bench_nets import SMALL_NETS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _solver(tmp_path, net_text=None, model=None, batch=None, **solver_fields):
    if net_text is not None:
        model = tmp_path / "net.prototxt"
        model.write_text(net_text)
    sp = synthetic.default_solver_param()
    sp.base_lr = 0.05
    for k, v in solver_fields.items():
        setattr(sp, k, v)
    sp.net = str(model)
    solver, _ = synthetic.synthetic_solver(solver=sp, batch=batch)
    return solver


def _initial_blobs(net):
    return [[np.array(b.cpu_data(), copy=True) for b in layer.blobs] for layer in net.layers]


def _learnable(net):
    """(layer name, blob index, blob) of each parameter the solver updates."""
    out = []
    for lid, layer in enumerate(net.layers):
        for j, blob in enumerate(layer.blobs):
            pid = net.param_id_vecs[lid][j]
            if net.param_owners[pid] == -1 and layer.get_param_propagate_down(j):
                out.append((net.layer_names[lid], j, blob))
    return out


def _close(a, b, rtol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), 1e-6)
    err = np.abs(a - b).max() / scale
    assert err <= rtol, f"{what}: max |difference| / max |value| = {err:.2e} > {rtol:.0e}"


def compare_steps(solver, steps=2, rtol=2e-4, same_gradients=False, device="cpu"):
    """Run ``steps`` solver iterations in minicaffe and in the twin from the same
    weights and inputs; compare the first loss, the first gradients and the weights
    after every step.  ``same_gradients``: the twin's optimizer is given minicaffe's
    gradients at every step, so that only the update rules are compared (the adaptive
    rules turn rounding noise in near-zero gradients into whole steps of +-lr)."""
    net = solver.net
    twin = TorchTwin(net, device, blobs=_initial_blobs(net))
    inputs = twin.inputs_from(net)
    opt = make_optimizer(twin, solver.param)
    grads = {}

    def keep_gradients():
        for name, j, blob in _learnable(net):
            grads[(name, j)] = np.array(blob.cpu_diff(), copy=True)
    solver.add_callback(lambda: None, keep_gradients)
    for step in range(steps):
        solver.step(1)
        opt.zero_grad(set_to_none=True)
        loss = twin.loss(inputs)
        loss.backward()
        if step == 0:
            _close(float(loss.detach()), float(solver.smoothed_loss), 1e-5, "loss")
            for (name, j), g in grads.items():
                _close(twin.blob_params[(name, j)].grad.cpu().numpy(), g, rtol,
                       f"gradient of {name} #{j}")
        if same_gradients:
            for (name, j), g in grads.items():
                twin.blob_params[(name, j)].grad.copy_(torch.from_numpy(g).to(device))
        opt.step()
        for name, j, blob in _learnable(net):
            _close(twin.blob_params[(name, j)].detach().cpu().numpy(), blob.cpu_data(), rtol,
                   f"{name} #{j} after step {step + 1}")
    return twin


@pytest.mark.parametrize("model,batch", [("lenet", 8), ("cifar10_quick", 4)])
def test_models_train_the_same_in_the_twin(model, batch, tmp_path):
    solver = _solver(tmp_path, model=os.path.join(MODELS, model, "train_val.prototxt"),
                     batch=batch)
    compare_steps(solver, steps=3)


@pytest.mark.parametrize("name", sorted(SMALL_NETS))
def test_small_nets_train_the_same_in_the_twin(name, tmp_path):
    solver = _solver(tmp_path, SMALL_NETS[name])
    twin = compare_steps(solver)
    if name == "resnet_small":  # every BatchNorm with its Scale became one affine BN
        n_bn = sum(layer.type == "BatchNorm" for layer in solver.net.layers)
        assert n_bn == len(twin.notes) == 8
        assert all("one affine F.batch_norm" in n for n in twin.notes)
        assert not any(op.type == "Scale" for op in twin.ops)


@pytest.mark.parametrize("kind,fields", [
    ("Nesterov", dict(momentum=0.9)),
    ("AdaGrad", dict(momentum=0.0, delta=1e-8)),
    ("RMSProp", dict(momentum=0.0, rms_decay=0.9, delta=1e-8)),
    ("AdaDelta", dict(momentum=0.9, delta=1e-6, base_lr=1.0)),
    # Adam: Caffe adds delta to sqrt(v), PyTorch to sqrt(v / (1 - beta2^t)); a tiny delta
    # makes the two the same rule
    ("Adam", dict(momentum=0.9, momentum2=0.999, delta=1e-20, base_lr=0.001)),
])
def test_solver_types_map_onto_torch_optim(kind, fields, tmp_path):
    solver = _solver(tmp_path, model=os.path.join(MODELS, "lenet", "train_val.prototxt"),
                     batch=4, type=kind, **fields)
    compare_steps(solver, steps=3, same_gradients=True)


def test_iter_size_accumulates_like_caffe(tmp_path):
    solver = _solver(tmp_path, model=os.path.join(MODELS, "lenet", "train_val.prototxt"),
                     batch=4, iter_size=2)
    net = solver.net
    twin = TorchTwin(net, "cpu", blobs=_initial_blobs(net))
    opt = make_optimizer(twin, solver.param)
    inputs = twin.inputs_from(net)
    solver.step(2)
    for _ in range(2):
        twin.train_step(inputs, opt, iter_size=2)
    for name, j, blob in _learnable(net):
        _close(twin.blob_params[(name, j)].detach().numpy(), blob.cpu_data(), 2e-4, name)


def test_test_phase_uses_global_statistics(tmp_path):
    """After training steps, the TEST net (BatchNorm with the running statistics, Dropout
    off) gives the same outputs as the twin in eval mode."""
    solver = _solver(tmp_path, SMALL_NETS["resnet_small"])
    solver.step(3)
    param = caffe_pb2.NetParameter()
    param.CopyFrom(solver.net.net_param)
    param.state.phase = TEST
    for layer in param.layer:  # the layers take the net's phase
        layer.ClearField("phase")
    test_net = Net(param)
    test_net.share_trained_layers_with(solver.net)
    for name in test_net.inputs:
        source = solver.net.blob_by_name(name)
        test_net.blob_by_name(name).mutable_cpu_data()[...] = source.cpu_data()
    test_net.forward_prefilled()
    twin = TorchTwin(test_net, "cpu")
    with torch.no_grad():
        tops = twin(twin.inputs_from(test_net))
    for name in ("res2a", "pool5", "fc10"):
        _close(tops[name].numpy(), test_net.blob_by_name(name).cpu_data(), 1e-4, name)
    stats = solver.net.layer_dict["bn_conv1"].blobs
    assert float(stats[2].cpu_data()[0]) > 1  # the statistics are really used


def test_shared_parameters_are_one_torch_parameter(tmp_path):
    text = SMALL_NETS["alexnet_small"].replace(
        'top: "fc7"\n  param { lr_mult: 1 decay_mult: 1 }',
        'top: "fc7"\n  param { name: "shared_w" lr_mult: 1 decay_mult: 1 }').replace(
        'top: "fc6"\n  param { lr_mult: 1 decay_mult: 1 }',
        'top: "fc6"\n  param { name: "other" lr_mult: 1 decay_mult: 1 }')
    # fc7 and a new fc7b share one 32x32 weight
    text = text.replace('layer { name: "fc8"', '''layer { name: "fc7b" type: "InnerProduct"
  bottom: "fc7" top: "fc7b" param { name: "shared_w" } inner_product_param {
  num_output: 32 bias_term: false } }
layer { name: "fc8"''').replace('bottom: "fc7" top: "fc8"', 'bottom: "fc7b" top: "fc8"')
    solver = _solver(tmp_path, text)
    twin = compare_steps(solver)
    assert twin.blob_params[("fc7", 0)] is twin.blob_params[("fc7b", 0)]


def test_untranslatable_layer_is_named(tmp_path):
    text = SMALL_NETS["alexnet_small"].replace(
        'layer { name: "fc7"', 'layer { name: "odd" type: "AbsVal" bottom: "fc6" top: "abs" }\n'
        'layer { name: "fc7"')
    solver = _solver(tmp_path, text)
    with pytest.raises(UntranslatableError, match="layer 'odd' of type AbsVal"):
        TorchTwin(solver.net)


def test_labels_are_int64_and_data_is_float(tmp_path):
    solver = _solver(tmp_path, SMALL_NETS["misc"])
    twin = TorchTwin(solver.net)
    inputs = twin.inputs_from(solver.net)
    assert inputs["label"].dtype == torch.int64
    assert inputs["target"].dtype == torch.float32 and inputs["data"].dtype == torch.float32
