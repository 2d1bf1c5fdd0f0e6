"""--share_data (RunConfig.share_data; minicaffe train's and bench's default): the GPU
step's memory plan lets blob data that no backward reads share memory.  That is safe only
if every layer declares what its backward reads (``retain_inputs``/``retain_outputs``):
here each buffer the shared plan lets go is filled with NaN right after its last reader
(as another buffer would overwrite it), on the CPU, and the gradients must come out bit
for bit as without.  The GPU step's own run of it: tests/test_share_data_gpu.py."""
import numpy as np
import pytest

from minicaffe import Net
from minicaffe.core import context
from minicaffe.core.config import ConfigError, RunConfig
from minicaffe.engine.plan import MemoryPlan
from minicaffe.proto import caffe_pb2

HEAD = """
name: "n"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 12 dim: 12 } shape { dim: 4 } } }
"""
LOSS = """
layer { name: "ip" type: "InnerProduct" bottom: "%s" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
# Caffe's ResNet pieces: BatchNorm + Scale in place, Split, Eltwise, ReLU in place
RESNET = HEAD + """
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "c1" }
layer { name: "sc1" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "bn2" type: "BatchNorm" bottom: "c2" top: "c2" }
layer { name: "sc2" type: "Scale" bottom: "c2" top: "c2" scale_param { bias_term: true } }
layer { name: "sum" type: "Eltwise" bottom: "c1" bottom: "c2" top: "sum" }
layer { name: "r2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
""" + LOSS % "pool"
# GoogLeNet/AlexNet pieces: LRN, Concat, Dropout, MAX pooling with overlap, Sigmoid, TanH
INCEPTION = HEAD + """
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
  convolution_param { num_output: 6 kernel_size: 3 stride: 2 weight_filler { type: "xavier" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "n1" type: "LRN" bottom: "c1" top: "n1" lrn_param { local_size: 3 } }
layer { name: "a" type: "Convolution" bottom: "n1" top: "a"
  convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "xavier" } } }
layer { name: "b" type: "Convolution" bottom: "n1" top: "b"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "sa" type: "Sigmoid" bottom: "a" top: "a" }
layer { name: "tb" type: "TanH" bottom: "b" top: "tb" }
layer { name: "p" type: "Pooling" bottom: "n1" top: "p"
  pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } }
layer { name: "cat" type: "Concat" bottom: "a" bottom: "tb" bottom: "p" top: "cat" }
layer { name: "drop" type: "Dropout" bottom: "cat" top: "cat" dropout_param { dropout_ratio: 0.4 } }
layer { name: "gp" type: "Pooling" bottom: "cat" top: "gp"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
""" + LOSS % "gp"
# more element-wise and shape layers between two InnerProducts
MISC = HEAD + """
layer { name: "flat" type: "Flatten" bottom: "data" top: "flat" }
layer { name: "ip0" type: "InnerProduct" bottom: "flat" top: "ip0"
  inner_product_param { num_output: 12 weight_filler { type: "xavier" } } }
layer { name: "pr" type: "PReLU" bottom: "ip0" top: "pr" }
layer { name: "elu" type: "ELU" bottom: "pr" top: "elu" }
layer { name: "pow" type: "Power" bottom: "elu" top: "pow" power_param { power: 2 shift: 1 } }
layer { name: "abs" type: "AbsVal" bottom: "pow" top: "abs" }
layer { name: "prod" type: "Eltwise" bottom: "abs" bottom: "ip0" top: "prod"
  eltwise_param { operation: PROD } }
layer { name: "mx" type: "Eltwise" bottom: "prod" bottom: "elu" top: "mx"
  eltwise_param { operation: MAX } }
layer { name: "sm" type: "Softmax" bottom: "mx" top: "sm" }
layer { name: "ex" type: "Exp" bottom: "sm" top: "ex" }
layer { name: "lg" type: "Log" bottom: "ex" top: "lg" }
layer { name: "bnll" type: "BNLL" bottom: "lg" top: "bnll" }
""" + LOSS % "bnll"
NETS = {"resnet": RESNET, "inception": INCEPTION, "misc": MISC,
        "lenet": ("models/lenet/train_val.prototxt", 4),
        "cifar10_quick": ("models/cifar10_quick/train_val.prototxt", 4),
        "googlenet": ("models/bvlc_googlenet/train_val.prototxt", 1),
        "alexnet": ("models/bvlc_alexnet/train_val.prototxt", 1),
        "resnet50": ("models/resnet50/train_val.prototxt", 1)}


def _model(path, batch, precision=None):
    """The train net of ``path`` on synthetic inputs (as minicaffe bench builds it)."""
    from minicaffe.synthetic import synthetic_solver
    solver, _ = synthetic_solver(model=path, batch=batch,
                                 config=RunConfig(precision=precision))
    return solver.net


def _run(text, poison, precision=None):
    """Param diffs after one forward and backward run layer by layer; ``poison``: each
    data buffer the shared plan lets go is NaN from the step after its last reader.
    ``text``: a net's prototxt, or (model path, batch); ``precision``: the net's (bf16:
    the plan of 2-byte storage, its cast ops, the CPU rounding fp32 buffers)."""
    context.set_mode_cpu()
    context.set_random_seed(1701)
    if isinstance(text, tuple):
        net = _model(*text, precision=precision)
    else:
        net = Net(text, phase=caffe_pb2.TRAIN, config=RunConfig(precision=precision))
        rs = np.random.RandomState(5)
        net.blobs["data"].data[...] = rs.standard_normal(net.blobs["data"].shape)
        net.blobs["label"].data[...] = rs.randint(0, 5, net.blobs["label"].shape)
    dead = {}
    if poison:
        plan = MemoryPlan(net, share_data=True, reduced_storage=precision is not None)
        for b in plan.buffers:
            if b.kind == "data" and not b.pinned:
                assert b.end < plan.steps - 1 or b.bwd_reads, b.names
                dead.setdefault(b.end, []).append(b.mem)

    def kill(step):
        for m in dead.get(step, ()):
            m.mutable_cpu_data()[...] = np.nan

    L = len(net.layers)
    for i in range(L):
        net.forward_from_to(i, i)
        kill(i)
    for i in reversed(range(L)):
        net.backward_from_to(i, i)
        kill(L + (L - 1 - i))
    return {n: [b.diff.copy() for b in bs] for n, bs in net.params.items()}, len(
        [m for ms in dead.values() for m in ms])


@pytest.mark.parametrize("name,precision", [(n, None) for n in sorted(NETS)] + [
    (n, "bf16") for n in ("resnet", "inception", "misc", "lenet", "cifar10_quick",
                          "googlenet")])
def test_backward_reads_no_data_the_shared_plan_lets_go(name, precision):
    clean, _ = _run(NETS[name], poison=False, precision=precision)
    poisoned, n_dead = _run(NETS[name], poison=True, precision=precision)
    assert n_dead > 0          # the shared plan lets some data go in every net here
    for layer, diffs in clean.items():
        for k, (a, b) in enumerate(zip(diffs, poisoned[layer])):
            assert np.isfinite(a).all()
            np.testing.assert_array_equal(a, b, err_msg=f"{layer}[{k}]")


def test_a_layer_that_reads_undeclared_data_is_caught(monkeypatch):
    """The check can fail: a ReLU whose backward reads its bottom without saying so."""
    from minicaffe.layers.neuron import ReLULayer
    text = HEAD + """
layer { name: "c" type: "Convolution" bottom: "data" top: "c"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "r" type: "ReLU" bottom: "c" top: "r" }
""" + LOSS % "r"
    monkeypatch.setattr(ReLULayer, "retain_inputs", ())
    monkeypatch.setattr(ReLULayer, "retain_outputs", ())
    clean, _ = _run(text, poison=False)
    poisoned, _ = _run(text, poison=True)
    assert not all(np.array_equal(a, b) for layer in clean
                   for a, b in zip(clean[layer], poisoned[layer]))


def test_the_shared_plan_is_smaller():
    context.set_mode_cpu()
    net = Net(RESNET, phase=caffe_pb2.TRAIN)
    assert MemoryPlan(net, share_data=True).arena_bytes < MemoryPlan(net).arena_bytes


def test_run_config(monkeypatch):
    monkeypatch.delenv("MINICAFFE_SHARE_DATA", raising=False)
    assert not RunConfig().shares_data                  # pycaffe's default: Caffe's blobs
    assert RunConfig(share_data=True).shares_data
    monkeypatch.setenv("MINICAFFE_SHARE_DATA", "1")
    assert RunConfig().shares_data and not RunConfig(share_data=False).shares_data
    with pytest.raises(ConfigError, match="share_data"):
        RunConfig(share_data="yes")


@pytest.mark.parametrize("argv,env,want", [
    ((), None, "the latter (share_data on"),
    (("--noshare_data",), None, "the former (share_data off"),
    ((), "0", "the former (share_data off"),
    (("--share_data",), "0", "the latter (share_data on"),
])
def test_train_and_bench_share_by_default_and_a_flag_or_the_environment_says_otherwise(
        cli, monkeypatch, argv, env, want):
    """``minicaffe memory`` plans what ``train`` would (here without a GPU: --offload
    NONE asks for the GPU plan) and says which plan the training step takes."""
    import os
    monkeypatch.delenv("MINICAFFE_SHARE_DATA", raising=False)
    if env is not None:
        monkeypatch.setenv("MINICAFFE_SHARE_DATA", env)
    model = os.path.join(os.path.dirname(__file__), "..", "models", "cifar10_quick",
                         "train_val.prototxt")
    rc, out, err = cli("memory", "--model", model, "--batch", 10, "--offload", "NONE", *argv)
    assert rc == 0, err
    assert want in out
