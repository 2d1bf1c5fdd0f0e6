"""Channels-last (NHWC) inside the GPU engine (issue 20, engine/precision.py): the memory
plan holds bf16/fp16 4-D feature maps N, H, W, C; cuDNN's convolution, pooling and batch
norm run on them through channels-last descriptors, 1x1 convolutions as cuBLAS GEMMs;
pycaffe still reads and writes Caffe's NCHW.  Each against the NCHW plan of the same net
(same weights, same inputs) and, for the GEMM, a numpy reference."""
import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core import precision as P
from minicaffe.core.config import RunConfig
from minicaffe.proto import caffe_pb2
from test_storage16_gpu import BLOCK, CONVS, KIND, TOL

pytestmark = pytest.mark.gpu


def _nets(text, prec, monkeypatch, gemm=None, direct=None):
    """(NCHW net, NHWC net, plans): 16-bit storage applied as the GPU step does, the same
    weights and inputs; ``gemm``, ``direct``: MINICAFFE_CONV_GEMM, MINICAFFE_CONV_DIRECT
    for the channels-last one."""
    from minicaffe import Net
    from minicaffe.engine.plan import MemoryPlan
    context.set_mode_gpu()
    context.set_random_seed(1701)
    a = Net(text, phase=caffe_pb2.TRAIN, config=RunConfig(precision=prec, channels_last=False))
    for var, v in (("MINICAFFE_CONV_GEMM", gemm), ("MINICAFFE_CONV_DIRECT", direct)):
        if v is not None:
            monkeypatch.setenv(var, v)
    b = Net(text, phase=caffe_pb2.TRAIN, config=RunConfig(precision=prec, channels_last=True))
    monkeypatch.delenv("MINICAFFE_CONV_GEMM", raising=False)
    monkeypatch.delenv("MINICAFFE_CONV_DIRECT", raising=False)
    for name in a.params:
        for x, y in zip(a.params[name], b.params[name]):
            y.data[...] = x.data
    rs = np.random.RandomState(3)
    x = rs.standard_normal(a.blobs["data"].shape).astype(np.float32)
    lab = rs.randint(0, 4, a.blobs["label"].shape).astype(np.float32)
    # the per-layer copies (kept from forward to backward) checked below: not the small
    # net's one launch of the training step (tests/test_wcast_gpu.py)
    monkeypatch.setenv("MINICAFFE_ONE_WEIGHT_CAST", "0")
    plans = [MemoryPlan(n, reduced_storage=True) for n in (a, b)]
    monkeypatch.delenv("MINICAFFE_ONE_WEIGHT_CAST")
    for p in plans:
        p.apply()
    for n in (a, b):
        n.blobs["data"].data[...] = x
        n.blobs["label"].data[...] = lab
    return a, b, plans


def _close(a, b, tol, what):
    err = np.abs(a - b).max()
    print(f"{what}: |NHWC - NCHW| {err:.3g}, largest {np.abs(a).max():.3g}")
    assert err <= tol * np.abs(a).max() + 1e-6, what


@pytest.mark.parametrize("gemm", ["1", "0"])
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_channels_last_step_matches_the_nchw_plan(prec, gemm, monkeypatch):
    nchw, nhwc, plans = _nets(CONVS, prec, monkeypatch, gemm)
    # the maps are held channels-last (4-D, more than one pixel), the input fp32 NCHW
    assert nhwc.blobs["conv1"].data_mem.layout == tuple(nhwc.blobs["conv1"].shape)
    assert nhwc.blobs["conv2"].diff_mem.layout == tuple(nhwc.blobs["conv2"].shape)
    assert nchw.blobs["conv1"].data_mem.layout is None
    assert nhwc.blobs["data"].data_mem.layout is None
    l1, l2 = float(nchw.forward()["loss"]), float(nhwc.forward()["loss"])
    nchw.backward()
    nhwc.backward()
    tol = TOL[prec]
    assert abs(l1 - l2) <= tol * abs(l1)
    for name in ("conv1", "conv2", "sig", "sum", "pool", "ip"):
        a, b = nchw.blobs[name].data, nhwc.blobs[name].data
        assert b.dtype == np.float32 and b.shape == a.shape, name    # pycaffe: fp32 NCHW
        assert P.representable(np, b, KIND[prec]), name
        _close(a, b, tol, name)
    for name in ("conv1", "conv2"):
        _close(nchw.blobs[name].diff, nhwc.blobs[name].diff, 2 * tol, name + " diff")
    for name in nchw.params:
        for k, (a, b) in enumerate(zip(nchw.params[name], nhwc.params[name])):
            _close(a.diff, b.diff, 2 * tol, f"{name}[{k}] diff")
    # the channels-last convolutions' 2-byte weight copies (cast at the forward, read by
    # the backward) are buffers of the plan, in its arena, live from forward to backward
    copies = {b.names[0]: b for b in plans[1].buffers if b.kind == "weights"}
    L = len(nhwc.layers)
    for name in ("conv1", "conv2"):
        b, i = copies[f"{name} (weights)"], nhwc.layer_names.index(name)
        assert b.start <= i and b.end >= 2 * L - 1 - i, name
        view = nhwc.layers[i].planned_workspace["weights"]
        assert view.data.ptr == plans[1].arena.data.ptr + b.offset, name
    assert not any(n.endswith("(weights)") for n in (b.names[0] for b in plans[0].buffers))
    for p in plans:
        p.release()


def test_resnet_pieces_channels_last_match_the_nchw_plan(monkeypatch):
    nchw, nhwc, plans = _nets(BLOCK, "bf16", monkeypatch)
    assert nhwc.blobs["c1"].data_mem.layout is not None
    l1, l2 = float(nchw.forward()["loss"]), float(nhwc.forward()["loss"])
    nchw.backward()
    nhwc.backward()
    tol = TOL["bf16"]
    assert abs(l1 - l2) <= tol * abs(l1)
    for name in ("c1", "c2", "sum", "pool", "fc", "ip"):
        _close(nchw.blobs[name].data, nhwc.blobs[name].data, 2 * tol, name)
    for name in nchw.params:
        for k, (a, b) in enumerate(zip(nchw.params[name], nhwc.params[name])):
            _close(a.data, b.data, 2 * tol, f"{name}[{k}]")      # BN's statistics too
            _close(a.diff, b.diff, 4 * tol, f"{name}[{k}] diff")
    for p in plans:
        p.release()


ONE = """
name: "one"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 16 dim: 6 dim: 5 } shape { dim: 8 } } }
layer { name: "c0" type: "Convolution" bottom: "data" top: "c0"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "c1" type: "Convolution" bottom: "c0" top: "c1"
  convolution_param { num_output: 24 kernel_size: 1 weight_filler { type: "msra" }
    bias_filler { type: "uniform" min: -1 max: 1 } } }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "pool" type: "Pooling" bottom: "c2" top: "pool"
  pooling_param { pool: AVE global_pooling: true } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "pool" bottom: "label" top: "loss" }
"""


def _bf16(a):
    return P.round_to(np, np.array(a, dtype=np.float32), "BFLOAT16")


def test_a_1x1_convolution_as_a_gemm_matches_a_numpy_reference(monkeypatch):
    _, net, plans = _nets(ONE, "bf16", monkeypatch, gemm="1")
    net.forward()
    # read before the backward: the plan lets a diff reuse a map's memory after its last
    # reader
    x = net.blobs["c0"].data.astype(np.float64)           # bf16 values, read NCHW
    y = net.blobs["c1"].data.copy()
    w = _bf16(net.params["c1"][0].data)[:, :, 0, 0].astype(np.float64)
    b = net.params["c1"][1].data.astype(np.float64)
    ref = np.einsum("nchw,kc->nkhw", x, w) + b[None, :, None, None]
    _close(ref, y, 2 ** -7, "c1 = W x + b")
    # down to c1 only: c0's backward would put its input's cast scratch where c1's
    # gradient was (dead by then, so the plan may)
    net.backward(end="c1")
    dy = net.blobs["c1"].diff.astype(np.float64)
    dw = np.einsum("nkhw,nchw->kc", dy, x)
    _close(dw, net.params["c1"][0].diff[:, :, 0, 0], 2 ** -6, "dW = dY^T X")
    _close(dy.sum(axis=(0, 2, 3)), net.params["c1"][1].diff, 2 ** -6, "db")
    dx = np.einsum("nkhw,kc->nchw", dy, w)
    _close(dx, net.blobs["c0"].diff, 2 ** -6, "dX = dY W")
    for p in plans:
        p.release()


def test_pycaffe_writes_reach_a_channels_last_map(monkeypatch):
    nchw, nhwc, plans = _nets(CONVS, "bf16", monkeypatch)
    for n in (nchw, nhwc):
        n.forward()
    rs = np.random.RandomState(11)
    v = rs.standard_normal(nchw.blobs["conv1"].shape).astype(np.float32)
    for n in (nchw, nhwc):
        n.blobs["conv1"].data[...] = v          # a host write, NCHW, into 2-byte words
        n.forward(start="conv2")
    _close(nchw.blobs["conv2"].data, nhwc.blobs["conv2"].data, 2 * TOL["bf16"], "conv2")
    for p in plans:
        p.release()
