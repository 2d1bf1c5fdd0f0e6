"""The model zoo definitions (models/*) and the example prototxts (examples/*) build into
Nets with the published parameter counts (sources in docs/data.md)."""
import os

import numpy as np
import pytest

from minicaffe.network.net import Net, TEST, TRAIN, read_net_param
from minicaffe.proto import caffe_pb2
from minicaffe.layers.registry import layer_type_list

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")

# Learnable parameters of the deploy net (BatchNorm's running statistics excluded:
# they are not learned by gradient; ResNet-50 has 53,173 such values).
PUBLISHED = {
    "lenet": 431080,
    "cifar10_quick": 145578,
    "cifar10_full": 89578,
    "bvlc_alexnet": 60965224,
    "bvlc_reference_caffenet": 60965224,
    "vgg16": 138357544,
    "bvlc_googlenet": 6998552,
    "resnet50": 25557032,
}
# train_val adds GoogLeNet's two auxiliary classifiers (3,188,840 + 3,190,888).
TRAIN_VAL_EXTRA = {"bvlc_googlenet": 6379728}
SMALL = ["lenet", "cifar10_quick", "cifar10_full", "bvlc_googlenet", "resnet50"]


def learnable_count(net):
    return sum(b.count() for layer in net.layers if layer.type != "BatchNorm"
               for b in layer.blobs)


def needs_types(param):
    missing = sorted({l.type for l in param.layer} - set(layer_type_list()))
    if missing:
        pytest.skip(f"layer types not registered yet: {missing}")


def batch_one(param):
    for l in param.layer:
        if l.type == "Input":
            for s in l.input_param.shape:
                s.dim[0] = 1
    return param


def strip_fillers(param):
    """Constant fillers: the count does not depend on them, and big nets build faster."""
    for l in param.layer:
        for p in (l.convolution_param, l.inner_product_param):
            p.ClearField("weight_filler")
            p.ClearField("bias_filler")
    return param


def data_to_input(param):
    """Replace Data layers by an Input of (1, C, crop, crop) data and (1,) labels."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    done = False
    for l in param.layer:
        if l.type == "Data":
            if not done:
                crop = l.transform_param.crop_size
                channels = 1 if "mnist" in l.data_param.source else 3
                size = crop or (28 if channels == 1 else 32)
                inp = out.layer.add(name=l.name, type="Input")
                inp.top.extend(l.top)
                inp.input_param.shape.add(dim=[1, channels, size, size])
                inp.input_param.shape.add(dim=[1])
                done = True
            continue
        out.layer.add().CopyFrom(l)
    return out


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_deploy_builds_with_the_published_parameter_count(model):
    param = read_net_param(os.path.join(MODELS, model, "deploy.prototxt"))
    needs_types(param)
    net = Net(strip_fillers(batch_one(param)), TEST)
    assert learnable_count(net) == PUBLISHED[model]
    out = net.blobs[net.outputs[0]]
    assert out.shape == (1, 10 if model.startswith(("lenet", "cifar")) else 1000)


@pytest.mark.parametrize("model", SMALL)
@pytest.mark.parametrize("phase", [TRAIN, TEST])
def test_train_val_builds_and_matches_deploy(model, phase):
    param = read_net_param(os.path.join(MODELS, model, "train_val.prototxt"))
    needs_types(param)
    net = Net(strip_fillers(data_to_input(param)), phase)
    extra = TRAIN_VAL_EXTRA.get(model, 0)
    assert learnable_count(net) == PUBLISHED[model] + extra
    assert any(l.type == "SoftmaxWithLoss" for l in net.layers)
    assert any(l.type == "Accuracy" for l in net.layers) == (phase == TEST)


@pytest.mark.parametrize("model", ["bvlc_alexnet", "bvlc_reference_caffenet", "vgg16"])
def test_big_train_val_has_the_deploy_layers(model):
    """The big nets' train_val: same learnable layers and settings as deploy (not built,
    to keep the suite fast), ImageNet data layers for both phases."""
    tv = read_net_param(os.path.join(MODELS, model, "train_val.prototxt"))
    dp = read_net_param(os.path.join(MODELS, model, "deploy.prototxt"))

    def learnable(p):
        out = []
        for l in p.layer:
            if l.type == "Convolution":
                c = l.convolution_param
                out.append((l.name, l.type, c.num_output, tuple(c.kernel_size), tuple(c.pad),
                            tuple(c.stride), c.group, tuple(l.bottom)))
            elif l.type == "InnerProduct":
                out.append((l.name, l.type, l.inner_product_param.num_output, tuple(l.bottom)))
        return out

    assert learnable(tv) == learnable(dp)
    data = [l for l in tv.layer if l.type == "Data"]
    assert [l.include[0].phase for l in data] == [TRAIN, TEST]
    assert data[0].transform_param.mirror and not data[1].transform_param.mirror


def test_models_match_bvlc_weights(fixtures_dir):
    """BVLC's trained LeNet and CIFAR-10 quick weights load into the model definitions."""
    for model, weights in (("lenet", "lenet_v2_iter_10000.caffemodel"),
                           ("cifar10_quick", "cifar10_quick_v1_iter_5000.caffemodel")):
        net = Net(os.path.join(MODELS, model, "deploy.prototxt"), TEST,
                  weights=str(fixtures_dir / weights))
        assert np.abs(net.params["conv1"][0].data).sum() > 0


# -- examples -----------------------------------------------------------------------------------
EXAMPLE_SOLVERS = [
    "mnist/lenet_solver.prototxt", "mnist/lenet_solver_adam.prototxt",
    "mnist/lenet_solver_rmsprop.prototxt", "mnist/lenet_adadelta_solver.prototxt",
    "mnist/lenet_multistep_solver.prototxt", "mnist/mnist_autoencoder_solver.prototxt",
    "mnist/mnist_autoencoder_solver_adagrad.prototxt",
    "mnist/mnist_autoencoder_solver_adadelta.prototxt",
    "mnist/mnist_autoencoder_solver_nesterov.prototxt",
    "cifar10/cifar10_quick_solver.prototxt", "cifar10/cifar10_quick_solver_lr1.prototxt",
    "cifar10/cifar10_full_solver.prototxt", "cifar10/cifar10_full_solver_lr1.prototxt",
    "cifar10/cifar10_full_solver_lr2.prototxt",
]


@pytest.mark.parametrize("solver", EXAMPLE_SOLVERS)
def test_example_solvers_parse_and_name_their_nets(solver):
    from minicaffe.core import protoio
    p = protoio.read_text(os.path.join(ROOT, "examples", solver), caffe_pb2.SolverParameter())
    assert p.net.startswith("examples/") and os.path.isfile(os.path.join(ROOT, p.net))
    assert p.snapshot_prefix.startswith("examples/")


def test_lenet_solver_has_caffes_hyperparameters():
    from minicaffe.core import protoio
    p = protoio.read_text(os.path.join(ROOT, "examples/mnist/lenet_solver.prototxt"),
                          caffe_pb2.SolverParameter())
    assert (p.base_lr, p.momentum, p.weight_decay, p.lr_policy, p.gamma, p.power) == \
        (pytest.approx(0.01), pytest.approx(0.9), pytest.approx(0.0005), "inv",
         pytest.approx(0.0001), pytest.approx(0.75))
    assert (p.test_iter[0], p.test_interval, p.max_iter, p.display) == (100, 500, 10000, 100)


def test_autoencoder_builds_with_its_stages():
    param = read_net_param(os.path.join(ROOT, "examples/mnist/mnist_autoencoder.prototxt"))
    needs_types(param)
    for l in param.layer:  # no MNIST LMDB here: an Input of the same shape
        if l.type == "Data":
            l.type = "Input"
            l.input_param.shape.add(dim=[2, 1, 28, 28])
            l.ClearField("data_param")
            l.ClearField("transform_param")
    net = Net(strip_fillers(param), TEST, stages=["test-on-test"])
    assert net.blobs["decode1"].shape == (2, 784)
    assert set(net.outputs) == {"cross_entropy_loss", "l2_error"}


def test_train_lenet_helpers(tmp_path, monkeypatch, mnist_dir):
    """The example script's data step (fetch -> convert, skipped when done) and its
    --max_iter solver copy, run in a scratch directory."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "train_lenet", os.path.join(ROOT, "examples/mnist/train_lenet.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples" / "mnist").mkdir(parents=True)
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    for f in os.listdir(mnist_dir):  # "already in DIR": no download
        os.symlink(mnist_dir / f, tmp_path / "data" / "mnist" / f)
    mod.prepare_data("data/mnist")
    from minicaffe.data.db import open_db
    with open_db("examples/mnist/mnist_test_lmdb") as db:
        assert db.count() == 10000
    mtime = os.path.getmtime("examples/mnist/mnist_test_lmdb/data.mdb")
    mod.prepare_data("data/mnist")  # present: skipped
    assert os.path.getmtime("examples/mnist/mnist_test_lmdb/data.mdb") == mtime
    from minicaffe.core import protoio
    path = mod.solver_with_max_iter(os.path.join(ROOT, mod.SOLVER), 300)
    try:
        p = protoio.read_text(path, caffe_pb2.SolverParameter())
        assert (p.max_iter, p.test_interval, p.snapshot, p.base_lr) == (300, 300, 300, pytest.approx(0.01))
    finally:
        os.remove(path)


def test_train_cifar10_without_data_says_what_to_get(tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "train_cifar10", os.path.join(ROOT, "examples/cifar10/train_cifar10.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cwd = os.getcwd()
    try:
        rc = mod.main(["quick", "--no_download", "--cifar_dir", str(tmp_path / "nocifar")])
    finally:
        os.chdir(cwd)
    assert rc == 1
    err = capsys.readouterr().err
    assert "data_batch_1.bin" in err and "cifar-10-binary.tar.gz" in err
