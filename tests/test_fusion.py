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
