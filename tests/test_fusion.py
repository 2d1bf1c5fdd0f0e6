"""Fused layer types (layers/fused.py): the Net-building pass that finds the pairs of
adjacent layers the GPU engine computes as one, and where a user sees them (the log,
``Net.fusions``, the memory plan's rows, ``draw``).  The fused GPU bodies themselves are
tested against the CPU in tests/test_gpu_engine.py (marked gpu)."""
import logging

import numpy as np

from minicaffe import Net, draw
from minicaffe.layers import registry
from minicaffe.engine.plan import MemoryPlan
from minicaffe.layers.fused import find_fusions
from minicaffe.proto import caffe_pb2
from minicaffe.core.protoio import parse_text

RESIDUAL = """
name: "residual"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "a" type: "Convolution" bottom: "data" top: "a"
  convolution_param { num_output: 3 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu_a" type: "ReLU" bottom: "a" top: "a" }
layer { name: "bn" type: "BatchNorm" bottom: "a" top: "bn" }
layer { name: "scale" type: "Scale" bottom: "bn" top: "bn" scale_param { bias_term: true } }
layer { name: "sum" type: "Eltwise" bottom: "bn" bottom: "data" top: "sum" }
layer { name: "relu" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "ip" type: "InnerProduct" bottom: "sum" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _layers(text):
    return list(parse_text(text, caffe_pb2.NetParameter()).layer)


def test_the_pass_finds_each_fused_type_by_engine():
    layers = _layers(RESIDUAL)
    names = [l.name for l in layers]
    found = {(names[i], kind.type) for i, kind in find_fusions(layers, lambda i: "CUDNN")}
    assert found == {("a", "Convolution+ReLU"), ("bn", "BatchNorm+Scale"),
                     ("sum", "Eltwise+ReLU")}
    # Caffe's engine has no fused convolution or batch norm; the Eltwise pair is its own
    found = {(names[i], kind.type) for i, kind in find_fusions(layers, lambda i: "CAFFE")}
    assert found == {("sum", "Eltwise+ReLU")}
    # no pair where the second layer is not in place on the first's only top, or leaky,
    # or the sum has coefficients, or batch norm uses its global statistics
    text = (RESIDUAL.replace('bottom: "a" top: "a" }', 'bottom: "a" top: "a2" }')
            .replace('top: "sum" }\nlayer { name: "relu"', 'top: "sum" eltwise_param { '
                     'coeff: 1 coeff: 2 } }\nlayer { name: "relu"')
            .replace('top: "bn" }', 'top: "bn" batch_norm_param { use_global_stats: true } }'))
    assert find_fusions(_layers(text), lambda i: "CUDNN") == []
    leaky = RESIDUAL.replace('type: "ReLU" bottom: "sum" top: "sum" }',
                             'type: "ReLU" bottom: "sum" top: "sum" '
                             'relu_param { negative_slope: 0.1 } }')
    assert "sum" not in {_layers(leaky)[i].name
                         for i, _ in find_fusions(_layers(leaky), lambda i: "CUDNN")}


def test_a_net_logs_and_lists_its_fused_types_and_the_cpu_runs_them_apart(caplog):
    with caplog.at_level(logging.INFO):
        net = Net(RESIDUAL, phase=caffe_pb2.TRAIN)
    assert [(f.type, f.names) for f in net.fusions] == [("Eltwise+ReLU", ("sum", "relu"))]
    assert "Fused layer type Eltwise+ReLU: sum and relu" in caplog.text
    # both layers stay in the net, and the CPU computes relu(a + b)
    assert net.layer_names[-4:-2] == ["sum", "relu"]
    rng = np.random.RandomState(0)
    net.blobs["data"].data[...] = rng.randn(4, 3, 6, 6)
    net.blobs["label"].data[...] = [0, 1, 0, 1]
    net.forward()
    s = net.blobs["bn"].data + net.blobs["data"].data
    np.testing.assert_allclose(net.blobs["sum"].data, np.maximum(s, 0), rtol=1e-6, atol=1e-6)


def test_cudnn_pairs_are_listed_where_the_registry_chose_cudnn(monkeypatch):
    monkeypatch.setattr(registry, "cudnn_available", lambda: (True, ""))
    net = Net(RESIDUAL, phase=caffe_pb2.TRAIN)
    assert [(f.type, f.names) for f in net.fusions] == [
        ("Convolution+ReLU", ("a", "relu_a")), ("BatchNorm+Scale", ("bn", "scale")),
        ("Eltwise+ReLU", ("sum", "relu"))]
    # the memory plan's rows show the fused types; a Scale whose backward the batch norm
    # does keeps nothing of its own
    rows = {r["layer"]: r for r in MemoryPlan(net).rows}
    assert rows["a"]["type"] == "Convolution+ReLU" and rows["relu_a"]["type"] == "ReLU (fused)"
    assert rows["bn"]["type"] == "BatchNorm+Scale" and rows["scale"]["type"] == "Scale (fused)"
    assert rows["sum"]["type"] == "Eltwise+ReLU" and rows["relu"]["type"] == "ReLU (fused)"
    assert rows["scale"]["state"] == 0
    # the plan keeps the sum's output until the fused backward has read its mask
    plan = MemoryPlan(net)
    L = len(net.layers)
    ids = {n: i for i, n in enumerate(net.layer_names)}
    sum_data = next(b for b in plan.buffers if b.kind == "data" and "sum" in b.names)
    assert 2 * L - 1 - ids["sum"] in sum_data.bwd_reads


def test_draw_labels_both_layers_of_a_pair():
    dot = draw.get_dot(parse_text(RESIDUAL, caffe_pb2.NetParameter()), rankdir="TB")
    assert '"sum_Eltwise" [label="sum (Eltwise) fused on the GPU: Eltwise+ReLU"' in dot
    assert '"relu_ReLU" [label="relu (ReLU) fused on the GPU: Eltwise+ReLU"' in dot
    assert '"a_Convolution" [label="a (Convolution) kernel size: 1 stride: 1 pad: 0 ' \
           'fused on the GPU: Convolution+ReLU"' in dot
    assert '"scale_Scale" [label="scale (Scale) fused on the GPU: BatchNorm+Scale"' in dot
    # a layer that asks for Caffe's engine is not fused
    caffe = RESIDUAL.replace("kernel_size: 1 weight", "kernel_size: 1 engine: CAFFE weight")
    assert "Convolution+ReLU" not in draw.get_dot(parse_text(caffe, caffe_pb2.NetParameter()))


# ResNet's BatchNorm, Scale and ReLU, all in place on the convolution's top
BN_RELU = """
name: "bn_relu"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 5 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv"
  scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 }
                bias_filler { type: "uniform" min: -0.5 max: 0.5 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_the_pass_takes_the_relu_after_batchnorm_and_scale_as_a_third_layer(
        monkeypatch):
    layers = _layers(BN_RELU)
    found = [(layers[i].name, kind.type, kind.size)
             for i, kind in find_fusions(layers, lambda i: "CUDNN")]
    assert found == [("bn", "BatchNorm+Scale+ReLU", 3)]
    # the pair only: a leaky ReLU, one not in place, one whose top is a loss
    for text in (BN_RELU.replace('top: "conv" }\nlayer { name: "ip"',
                                 'top: "conv" relu_param { negative_slope: 0.1 } }\n'
                                 'layer { name: "ip"'),
                 BN_RELU.replace('"ReLU" bottom: "conv" top: "conv"',
                                 '"ReLU" bottom: "conv" top: "r"').replace(
                                     'InnerProduct" bottom: "conv"', 'InnerProduct" bottom: "r"'),
                 BN_RELU.replace('"ReLU" bottom: "conv" top: "conv" }',
                                 '"ReLU" bottom: "conv" top: "conv" loss_weight: 1 }')):
        assert [(layers[i].name, kind.type) for i, kind in
                find_fusions(_layers(text), lambda i: "CUDNN")] == [("bn", "BatchNorm+Scale")]
    # MINICAFFE_FUSE_BN_RELU=0: the pair, the ReLU apart
    monkeypatch.setenv("MINICAFFE_FUSE_BN_RELU", "0")
    assert [(layers[i].name, kind.type) for i, kind in
            find_fusions(layers, lambda i: "CUDNN")] == [("bn", "BatchNorm+Scale")]
    monkeypatch.delenv("MINICAFFE_FUSE_BN_RELU")
    # none with global statistics, nor on Caffe's engine
    stats = BN_RELU.replace('top: "conv" }\nlayer { name: "scale"',
                            'top: "conv" batch_norm_param { use_global_stats: true } }\n'
                            'layer { name: "scale"')
    assert find_fusions(_layers(stats), lambda i: "CUDNN") == []
    assert find_fusions(layers, lambda i: "CAFFE") == []
    # the ReLU after a BatchNorm+Scale that feeds a sum (ResNet's branch2c) is the sum's
    assert {(_layers(RESIDUAL)[i].name, k.type) for i, k in
            find_fusions(_layers(RESIDUAL), lambda i: "CUDNN")} >= {("bn", "BatchNorm+Scale")}


def test_batchnorm_scale_relu_is_shown_as_one_type_and_the_cpu_gives_the_same_bits(
        monkeypatch, caplog):
    from minicaffe.core import context
    from minicaffe.engine.schedule import compile_iteration, fusion_pass

    def run(net):
        rng = np.random.RandomState(0)
        net.blobs["data"].data[...] = rng.randn(4, 3, 6, 6)
        net.blobs["label"].data[...] = [0, 1, 0, 1]
        net.forward()
        net.backward()
        return [net.blobs["ip"].data.copy(), net.blobs["data"].diff.copy()] + \
            [b.diff.copy() for b in net.learnable_params]

    context.set_random_seed(5)
    apart = Net(BN_RELU, phase=caffe_pb2.TRAIN)
    assert apart.fusions == []
    monkeypatch.setattr(registry, "cudnn_available", lambda: (True, ""))
    with caplog.at_level(logging.INFO):
        context.set_random_seed(5)
        net = Net(BN_RELU, phase=caffe_pb2.TRAIN)
    assert [(f.type, f.names) for f in net.fusions] == [
        ("BatchNorm+Scale+ReLU", ("bn", "scale", "relu"))]
    assert "Fused layer type BatchNorm+Scale+ReLU: bn, scale and relu" in caplog.text
    # the CPU runs the three layers apart: the same bits as the net without the group
    for a, b in zip(run(apart), run(net)):
        assert np.array_equal(a, b)
    # memory's rows, the schedule's ops: one forward and one backward for the three
    rows = {r["layer"]: r for r in MemoryPlan(net).rows}
    assert rows["bn"]["type"] == "BatchNorm+Scale+ReLU"
    assert rows["scale"]["type"] == "Scale (fused)" and rows["relu"]["type"] == "ReLU (fused)"
    assert rows["scale"]["state"] == 0 and rows["relu"]["state"] == 0
    s = fusion_pass(compile_iteration(net), net)
    bn = net.layer_names.index("bn")
    assert [str(op) for op in s if op.detail == "BatchNorm+Scale+ReLU"] == [
        f"forward {bn}-{bn + 2} bn+scale+relu (BatchNorm+Scale+ReLU)",
        f"backward {bn}-{bn + 2} bn+scale+relu (BatchNorm+Scale+ReLU)"]
    assert sum(len(op.layers) for op in s if op.kind == "forward") == len(net.layers) - 1
    # the plan keeps the group's output (the ReLU's mask where it runs apart) until the
    # fused backward
    plan = MemoryPlan(net)
    L = len(net.layers)
    out = next(b for b in plan.buffers if b.kind == "data" and "conv" in b.names)
    assert 2 * L - 1 - bn in out.bwd_reads
    dot = draw.get_dot(parse_text(BN_RELU, caffe_pb2.NetParameter()), rankdir="TB")
    for name in ("bn_BatchNorm", "scale_Scale", "relu_ReLU"):
        assert f"fused on the GPU: BatchNorm+Scale+ReLU" in dot.split(f'"{name}" [label=')[1] \
            .split("\n")[0], name
