"""A plain in-place ReLU after a Convolution or a MAX Pooling runs inside that layer's
numpy kernels on the CPU (network/net.py ``_cpu_relus``; layers/layer.py ``relu_after``):
the same values and gradients as the two layers apart, at every thread count, and Caffe's
semantics for partial passes (a forward that ends at the convolution leaves its output
unrectified).  CIFAR-10 quick's training steps, whose three ReLUs fold (after pool1,
conv2 and conv3), are compared across thread counts in tests/layers/test_conv_threads.py."""
import numpy as np
import pytest

import minicaffe
from minicaffe import Net
from minicaffe.kernels import pooling
from minicaffe.layers import neuron
from minicaffe.proto import caffe_pb2

NET = """
name: "fold"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 6 dim: 3 dim: 12 dim: 12 } shape { dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 5 pad: 2
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
# the same net with each ReLU writing a blob of its own (nothing to fold)
APART = (NET.replace('top: "pool1" }', 'top: "relu1" }')
         .replace('bottom: "pool1" top: "conv2"', 'bottom: "relu1" top: "conv2"')
         .replace('bottom: "conv2" top: "conv2" }', 'bottom: "conv2" top: "relu2" }')
         .replace('bottom: "conv2" top: "ip"', 'bottom: "relu2" top: "ip"'))


@pytest.fixture
def relu_bodies(monkeypatch):
    """How often the ReLU layers' own forward and backward bodies ran."""
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = neuron.ReLULayer.forward_xp, neuron.ReLULayer.backward_xp

    def forward_xp(self, *a):
        calls["forward"] += 1
        return fwd(self, *a)

    def backward_xp(self, *a):
        calls["backward"] += 1
        return bwd(self, *a)
    monkeypatch.setattr(neuron.ReLULayer, "forward_xp", forward_xp)
    monkeypatch.setattr(neuron.ReLULayer, "backward_xp", backward_xp)
    return calls


def _net(text, seed=3):
    minicaffe.set_random_seed(seed)
    net = Net(text, phase=caffe_pb2.TRAIN)
    rs = np.random.RandomState(0)
    net.blobs["data"].data[...] = rs.randn(*net.blobs["data"].shape)
    net.blobs["label"].data[...] = rs.randint(0, 4, 6)
    return net


def _state(net, outputs=("conv1", "pool1", "conv2", "ip")):
    """Parameter gradients, each layer's output (the ReLUs' where they have a blob of
    their own) and the gradients of the ReLUs' inputs (their bottoms' diffs)."""
    return ([b.diff.copy() for l in net.layers for b in l.blobs]
            + [net.blobs[n].data.copy() for n in outputs]
            + [net.blobs[n].diff.copy() for n in ("data", "conv1", "pool1", "conv2")])


@pytest.mark.parametrize("threads", [1, 2])
def test_folded_relus_give_the_bits_of_the_layers_apart(threads, relu_bodies, monkeypatch):
    monkeypatch.setattr(pooling, "PARALLEL_MIN_WORK", 0)   # pool1 in parts too
    try:
        minicaffe.set_num_threads(threads)
        apart = _net(APART)
        apart.forward_backward()
        assert relu_bodies == {"forward": 2, "backward": 2}
        fold = _net(NET)
        fold.forward_backward()
        assert relu_bodies == {"forward": 2, "backward": 2}   # none ran on their own
    finally:
        minicaffe.set_num_threads(1)
    a, f = _state(apart, ("conv1", "relu1", "relu2", "ip")), _state(fold)
    assert len(a) == len(f) == 14
    assert (a[6] < 0).any()             # conv1's output: some negatives (nothing to rectify)
    assert (apart.blobs["pool1"].data < 0).any() and (apart.blobs["conv2"].data < 0).any()
    assert (a[12] == 0).any() and (a[12] != 0).any()    # pool1's gradient, rectified
    for x, y in zip(a, f):
        assert np.array_equal(x, y)


def test_a_pass_that_ends_between_the_layers_runs_them_apart(relu_bodies):
    fold = _net(NET)
    fold.forward(end="conv2")
    assert (fold.blobs["conv2"].data < 0).any()         # the forward stopped at conv2
    assert relu_bodies["forward"] == 0                   # relu1 ran in pool1's kernels
    fold.forward(start="relu2")
    assert relu_bodies["forward"] == 1
    assert not (fold.blobs["conv2"].data < 0).any()
    fold.forward()                                       # both folded
    assert relu_bodies["forward"] == 1
    apart = _net(APART)
    apart.forward()
    # a backward that ends at a folded ReLU: its gradient is the ReLU's own
    diffs = fold.backward(end="relu2")
    assert relu_bodies["backward"] == 1
    ref = apart.backward(end="relu2")
    assert np.array_equal(diffs["conv2"], ref["conv2"])
    assert (diffs["conv2"] == 0).any() and (diffs["conv2"] != 0).any()

