"""Small training nets and helpers shared by the solver, snapshot, CLI and log tests
(no LMDB: Input, DummyData and MemoryData feed them)."""
import contextlib
import io
import logging

import numpy as np

from minicaffe.core import log
from minicaffe.proto import caffe_pb2
from minicaffe.core.protoio import parse_text

# A linear softmax classifier on fixed inputs: the gradients can be written by hand.
LINEAR_NET = """
name: "linear"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: %(batch)d dim: %(dim)d } shape { dim: %(batch)d } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  inner_product_param { num_output: %(classes)d
    weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

# Random data every forward (DummyData refills), a hidden layer, accuracy in TEST.
DUMMY_NET = """
name: "dummy"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 8 dim: 4 } shape { dim: 8 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: 0 max: 2.99 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

# The same data every forward (constant fillers): a run's result depends on the
# weights alone, so a resumed run continues exactly.
CONST_NET = """
name: "const"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 6 dim: 5 } shape { dim: 6 }
    data_filler { type: "constant" value: 0.3 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 }
    bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""

MEMORY_NET = """
name: "memory"
layer { name: "data" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: %(batch)d channels: 4 height: 1 width: 1 } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 5 weight_filler { type: "xavier" }
    bias_filler { type: "constant" value: 0.05 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

# Caffe's examples/mnist/lenet_train_test.prototxt with MemoryData in place of LMDB.
LENET_MEMORY = """
name: "LeNet"
layer { name: "mnist" type: "MemoryData" top: "data" top: "label"
  include { phase: TRAIN }
  memory_data_param { batch_size: %(train_batch)d channels: 1 height: 28 width: 28 } }
layer { name: "mnist" type: "MemoryData" top: "data" top: "label"
  include { phase: TEST }
  memory_data_param { batch_size: %(test_batch)d channels: 1 height: 28 width: 28 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  convolution_param { num_output: 20 kernel_size: 5 stride: 1
    weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  param { lr_mult: 1 } param { lr_mult: 2 }
  convolution_param { num_output: 50 kernel_size: 5 stride: 1
    weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 500
    weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 10
    weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

# examples/mnist/lenet_solver.prototxt's values
LENET_SOLVER = """
test_iter: 100
test_interval: 500
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 100
max_iter: 10000
snapshot: 5000
snapshot_prefix: "examples/mnist/lenet"
solver_mode: CPU
"""


def linear_net(batch=4, dim=3, classes=3):
    return LINEAR_NET % dict(batch=batch, dim=dim, classes=classes)


def memory_net(batch=4):
    return MEMORY_NET % dict(batch=batch)


def lenet_memory(train_batch=64, test_batch=100):
    return LENET_MEMORY % dict(train_batch=train_batch, test_batch=test_batch)


def solver_param(net_text=None, text="", **fields):
    """A SolverParameter with ``net_param`` inline, extra prototxt ``text`` and fields."""
    p = caffe_pb2.SolverParameter()
    if net_text is not None:
        parse_text(net_text, p.net_param)
    parse_text(text, p)
    for k, v in fields.items():
        f = getattr(p, k)
        if hasattr(f, "extend"):
            del f[:]
            f.extend(v if isinstance(v, (list, tuple)) else [v])
        else:
            setattr(p, k, v)
    if not p.HasField("solver_mode"):
        p.solver_mode = caffe_pb2.SolverParameter.CPU
    return p


def feed_memory(net, data, labels):
    for layer in net.layers:
        if layer.type == "MemoryData":
            layer.set_input_arrays(data, labels)


def param_arrays(net):
    return [b.data.copy() for b in net.learnable_params]


@contextlib.contextmanager
def captured_log():
    """Collect minicaffe's glog-formatted lines at INFO (a list of strings)."""
    lines = []
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(log.GlogFormatter())
    logger = log.logger
    log.is_enabled()  # installs the default handler first, so ours is not replaced
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        lines.extend(stream.getvalue().splitlines())


def messages(lines):
    """The message part of glog lines (after '] ')."""
    return [l.split("] ", 1)[1] if "] " in l else l for l in lines]


def test_linear_net_builds():
    from minicaffe.solvers import get_solver
    s = get_solver(solver_param(linear_net(), base_lr=0.1, lr_policy="fixed"))
    assert [b.shape for b in s.net.learnable_params] == [(3, 3), (3,)]
    assert s.net.params_lr == [1.0, 2.0] and s.net.params_weight_decay == [1.0, 0.0]


def test_captured_log_collects_glog_lines():
    with captured_log() as lines:
        log.info("hello %d", 3)
    assert len(lines) == 1 and lines[0].startswith("I") and lines[0].endswith("] hello 3")
    assert "test_solver_nets.py:" in lines[0]


def test_yaml_repeated_fields_may_be_scalars(tmp_path):
    from minicaffe.core import protoio
    f = tmp_path / "s.yaml"
    f.write_text("test_iter: 5\nbase_lr: 0.01\ndelta: 1e-8\nstepvalue: [1, 2]\n"
                 "net_param:\n  layer:\n    - name: a\n      type: Input\n      top: x\n"
                 "      include: {phase: TRAIN}\n")
    p = protoio.read_text(str(f), caffe_pb2.SolverParameter())
    assert list(p.test_iter) == [5] and list(p.stepvalue) == [1, 2]
    assert abs(p.delta - 1e-8) < 1e-15
    assert p.net_param.layer[0].include[0].phase == caffe_pb2.TRAIN
    assert list(p.net_param.layer[0].top) == ["x"]
