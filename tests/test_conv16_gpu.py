"""kernels/conv16.py on the GPU: the filter-gradient kernels against the numpy body bit
for bit, and a convolution over few input channels in a channels-last bf16/fp16 net whose
filter gradient they run (MINICAFFE_CONV_DIRECT=1) against the NCHW plan of the same net
and the numpy body."""
import numpy as np
import pytest

from minicaffe.core import backend
from minicaffe.core import precision as P
from minicaffe.kernels import conv16
from minicaffe.kernels.pool16 import _np_store
from test_channels_last_gpu import _close, _nets
from test_conv16 import GEOMS, STORAGES, _inputs
from test_storage16_gpu import TOL

pytestmark = pytest.mark.gpu

BIG = [(64, 1, 28, 28, 20, 5, 5, (1, 1), (0, 0), (1, 1)),     # LeNet b64's conv1
       (5, 3, 17, 13, 48, 3, 3, (2, 2), (1, 1), (1, 1))]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("g", GEOMS + BIG)
def test_kernels_match_the_numpy_body_bit_for_bit(storage, g):
    cp = backend.gpu_module()
    x, _, d, _ = _inputs(g, storage, seed=5)
    K, C, R, S = g[4], g[1], g[5], g[6]
    dw = np.linspace(-1, 1, K * C * R * S).astype(np.float32).reshape(K, C, R, S)
    db = np.linspace(0, 1, K).astype(np.float32)
    dwg, dbg = cp.asarray(dw), cp.asarray(db)
    conv16.backward_filter(x, d, dw, db, storage, g)
    part = cp.full(conv16.partial_size(g), np.nan, dtype=np.float32)
    conv16.backward_filter(cp.asarray(x), cp.asarray(d), dwg, dbg, storage, g, part)
    np.testing.assert_array_equal(cp.asnumpy(dwg), dw)
    np.testing.assert_array_equal(cp.asnumpy(dbg), db)
    dw2 = cp.asarray(dw)        # the weights' gradient alone: the same bits again added
    conv16.backward_filter(cp.asarray(x), cp.asarray(d), dw2, None, storage, g, part)
    want = dw.copy()
    conv16.backward_filter(x, d, want, None, storage, g)
    np.testing.assert_array_equal(cp.asnumpy(dw2), want)


FEW = """
name: "few"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 16 dim: 1 dim: 14 dim: 14 } shape { dim: 16 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 20 kernel_size: 5 weight_filler { type: "xavier" }
    bias_filler { type: "uniform" min: -0.5 max: 0.5 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
# three input channels, stride and padding, a ReLU the convolution takes (Convolution+ReLU)
RGB = FEW.replace("dim: 16 dim: 1 dim: 14 dim: 14", "dim: 8 dim: 3 dim: 15 dim: 15") \
    .replace("shape { dim: 16 } }", "shape { dim: 8 } }") \
    .replace("num_output: 20 kernel_size: 5", "num_output: 20 kernel_size: 3 stride: 2 pad: 1") \
    .replace('layer { name: "pool1"', 'layer { name: "relu1" type: "ReLU" bottom: "conv1" '
             'top: "conv1" }\nlayer { name: "pool1"')


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("text", [FEW, RGB], ids=["C1", "C3_relu"])
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_few_channels_step_matches_the_nchw_plan(prec, text, direct, monkeypatch):
    nchw, nhwc, plans = _nets(text, prec, monkeypatch, direct=direct)
    assert nhwc.blobs["conv1"].data_mem.layout == tuple(nhwc.blobs["conv1"].shape)
    l1, l2 = float(nchw.forward()["loss"]), float(nhwc.forward()["loss"])
    nchw.backward()
    nhwc.backward()
    tol = TOL[prec]
    assert abs(l1 - l2) <= tol * abs(l1)
    for name in ("conv1", "pool1", "conv2", "ip"):
        _close(nchw.blobs[name].data, nhwc.blobs[name].data, tol, name)
    for name in nchw.params:
        for k, (a, b) in enumerate(zip(nchw.params[name], nhwc.params[name])):
            _close(a.diff, b.diff, 2 * tol, f"{name}[{k}] diff")
    for p in plans:
        p.release()


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_the_direct_kernels_run_the_layer(prec, monkeypatch):
    """With MINICAFFE_CONV_DIRECT=1 conv1's weight and bias gradients are the numpy
    body's sums of the dy and x it read, bit for bit."""
    storage = P.BFLOAT16 if prec == "bf16" else P.FLOAT16
    _, net, plans = _nets(FEW, prec, monkeypatch, direct="1")
    net.forward()
    x = net.blobs["data"].data.transpose(0, 2, 3, 1)          # C = 1: NCHW is NHWC
    xw = _np_store(x, storage)
    xb = xw if storage == P.BFLOAT16 else xw.view(np.float16)
    w, b = net.params["conv1"][0].data, net.params["conv1"][1].data
    g = (16, 1, 14, 14, 20, 5, 5, (1, 1), (0, 0), (1, 1))
    for blob in net.params["conv1"]:
        blob.diff[...] = 0
    net.backward()
    dy = _np_store(net.blobs["conv1"].diff.transpose(0, 2, 3, 1), storage)
    dyb = dy if storage == P.BFLOAT16 else dy.view(np.float16)
    dw, db = np.zeros_like(w), np.zeros_like(b)
    conv16.backward_filter(xb, dyb, dw, db, storage, g)
    np.testing.assert_array_equal(net.params["conv1"][0].diff, dw)
    np.testing.assert_array_equal(net.params["conv1"][1].diff, db)
    for p in plans:
        p.release()
