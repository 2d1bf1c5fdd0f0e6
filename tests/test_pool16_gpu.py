"""MAX pooling of channels-last 2-byte maps over disjoint windows by our own kernels
(kernels/pool16.py, issue 20), where cuDNN's channels-last backward was slow: the CUDA
kernels against their numpy body (the CPU tests hold that against Caffe's kernels) and
against cuDNN's channels-last pooling, bit for bit, ties, NaN and -inf included; the
layers in a net's channels-last plan against the NCHW plan (cuDNN) of the same net.  And
a first convolution's 3 input channels padded to 8 (kernels/pad16.py)."""
import numpy as np
import pytest

from minicaffe.core import backend
from minicaffe.core import precision as P
from minicaffe.kernels import pool16
from kernels.test_pool16 import GEOMETRIES, KINDS, nhwc, tied_maps, values, words
from test_channels_last_gpu import _close, _nets
from test_storage16_gpu import TOL

pytestmark = pytest.mark.gpu

# beside the CPU tests' small ones: C a multiple of 8 (16-byte vectors), of 4, of 2
GPU_GEOMETRIES = GEOMETRIES + [
    ((4, 64, 28, 28), 2, 2, 0),
    ((3, 24, 15, 14), 2, 2, 0),
    ((2, 20, 9, 9), 3, 3, 1),
    ((2, 18, 10, 13), (2, 3), (2, 4), 0),
]


def _special(x, seed):
    """``x`` with NaNs and -infs sprinkled in, and one window of all -inf."""
    rs = np.random.RandomState(seed)
    x = x.copy()
    x[rs.random_sample(x.shape) < 0.03] = np.nan
    x[rs.random_sample(x.shape) < 0.03] = -np.inf
    x[0, 0, :2, :2] = -np.inf
    return x


def _both(x, geo, kind, dy=None):
    """(the kernels' words, the numpy body's words) of the forward (or backward)."""
    cp = backend.gpu_module()
    shape, k, s, p = geo
    PH, PW = pool16.output_shape(shape[2], shape[3], k, s, p)
    xw = words(nhwc(x), kind)
    out = []
    for xx in (cp.asarray(xw), xw):
        xp = cp if xx is not xw else np
        if dy is None:
            y = xp.full((shape[0], PH, PW, shape[1]), 7, xw.dtype)
            out.append(pool16.max_pool_forward(xx, y, shape, k, s, p, kind))
        else:
            dx = xp.full(xw.shape, 7, xw.dtype)      # every value written
            d = xp.asarray(words(nhwc(dy), kind))
            out.append(pool16.max_pool_backward(xx, d, dx, shape, k, s, p, kind))
    return cp.asnumpy(out[0]).view(np.uint16), out[1].view(np.uint16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("geo", GPU_GEOMETRIES)
def test_the_kernels_are_their_numpy_body(geo, kind):
    x = _special(tied_maps(geo[0], 3, kind), 4)
    got, ref = _both(x, geo, kind)
    assert np.array_equal(got, ref)
    rs = np.random.RandomState(5)
    dy = values(words(rs.standard_normal((geo[0][0], geo[0][1]) + tuple(
        pool16.output_shape(geo[0][2], geo[0][3], *geo[1:]))), kind), kind)
    got, ref = _both(x, geo, kind, dy)
    assert np.array_equal(got, ref)


def _cudnn(xw, shape, PH, PW, k, s, p, kind, dyw=None):
    """cuDNN's channels-last MAX pooling (the layer's descriptors) of the words ``xw``:
    y, or with ``dyw`` dx."""
    from minicaffe.gpu import cudnn
    cp = backend.gpu_module()
    dt = "bfloat16" if kind == P.BFLOAT16 else np.dtype(np.float16)
    pd = cudnn.PoolDesc(cudnn.POOL_MAX, pool16_pair(k), pool16_pair(p), pool16_pair(s))
    xd = cudnn.TensorDesc(shape, dt, nhwc=True)
    yd = cudnn.TensorDesc((shape[0], shape[1], PH, PW), dt, nhwc=True)
    assert pd.output_dims(xd) == (shape[0], shape[1], PH, PW)
    x = cp.asarray(xw)
    y = cp.empty((shape[0], PH, PW, shape[1]), xw.dtype)
    h = cudnn.handle()
    cudnn.call("cudnnPoolingForward", h, pd.ptr, cudnn.one(np.float32), xd.ptr,
               x.data.ptr, cudnn.zero(np.float32), yd.ptr, y.data.ptr)
    if dyw is None:
        return cp.asnumpy(y).view(np.uint16)
    dy = cp.asarray(dyw)
    dx = cp.full(x.shape, 7, x.dtype)
    cudnn.call("cudnnPoolingBackward", h, pd.ptr, cudnn.one(np.float32), yd.ptr,
               y.data.ptr, yd.ptr, dy.data.ptr, xd.ptr, x.data.ptr,
               cudnn.zero(np.float32), xd.ptr, dx.data.ptr)
    return cp.asnumpy(dx).view(np.uint16)


def pool16_pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


# the shapes cuDNN computes as Caffe does (its floor output is Caffe's ceil one)
CUDNN_GEOMETRIES = [((2, 16, 8, 6), 2, 2, 0), ((4, 64, 28, 28), 2, 2, 0),
                    ((2, 20, 9, 9), 3, 3, 0), ((3, 12, 14, 10), 2, 2, 0),
                    ((2, 3, 8, 8), 2, 2, 0)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("geo", CUDNN_GEOMETRIES)
def test_the_kernels_are_cudnns_ties_included(geo, kind):
    """Finite maps with many ties (a few levels, -0.0 beside +0.0): cuDNN's forward bit
    for bit, and its backward -- the tied gradient goes where cuDNN sends it."""
    shape, k, s, p = geo
    PH, PW = pool16.output_shape(shape[2], shape[3], k, s, p)
    x = tied_maps(shape, 8, kind)
    got, _ = _both(x, geo, kind)
    xw = words(nhwc(x), kind)
    assert np.array_equal(got, _cudnn(xw, shape, PH, PW, k, s, p, kind))
    rs = np.random.RandomState(9)
    dy = values(words(rs.standard_normal((shape[0], shape[1], PH, PW)), kind), kind)
    got, _ = _both(x, geo, kind, dy)
    assert np.array_equal(got, _cudnn(xw, shape, PH, PW, k, s, p, kind,
                                      words(nhwc(dy), kind)))


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_propagates_as_through_cudnn(kind):
    geo = ((2, 16, 8, 6), 2, 2, 0)
    x = _special(tied_maps(geo[0], 10, kind), 11)
    x[0, 0, :2, :2] = 1.0          # no all -inf window: there cuDNN gives its own floor
    got, _ = _both(x, geo, kind)
    ref = _cudnn(words(nhwc(x), kind), geo[0], 4, 3, 2, 2, 0, kind)
    bt = P.buffer_dtype(kind)
    g, r = values(got.view(bt), kind), values(ref.view(bt), kind)
    assert np.isnan(g).any()
    assert np.array_equal(np.isnan(g), np.isnan(r))
    assert np.array_equal(g[~np.isnan(g)], r[~np.isnan(r)])


# -- the layer in a net: channels-last plan (our kernels) against NCHW (cuDNN) -------------
EXACT = """
name: "exact"
force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 20 dim: 10 dim: 12 } shape { dim: 8 } } }
layer { name: "relu" type: "ReLU" bottom: "data" top: "r" }
layer { name: "pool" type: "Pooling" bottom: "r" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_the_layer_pools_as_cudnn_and_caffe_do(prec, monkeypatch):
    """The same rounded input in both plans (a ReLU of the fp32 data: many tied zeros),
    and, behind the pooling, an InnerProduct computed alike: the pooled map and the
    gradient routed back are the NCHW plan's (cuDNN) bit for bit, and Caffe's."""
    from minicaffe.kernels import pooling as K
    nchw, nhwc_net, plans = _nets(EXACT, prec, monkeypatch)
    rs = np.random.RandomState(12)
    x = rs.randint(-4, 5, size=nchw.blobs["data"].shape).astype(np.float32) * 0.25
    for n in (nchw, nhwc_net):
        n.blobs["data"].data[...] = x
        n.forward()
    assert nhwc_net.blobs["r"].data_mem.layout is not None
    r = nchw.blobs["r"].data.copy()
    assert np.array_equal(nhwc_net.blobs["r"].data, r)
    y = nchw.blobs["pool"].data.copy()
    assert np.array_equal(nhwc_net.blobs["pool"].data, y)
    ref, mask = K.max_pool_forward(r, 2, 2, 0)
    assert np.array_equal(y, ref)
    for n in (nchw, nhwc_net):      # down to the pooling: the plan may reuse a dead
        n.backward(end="pool")       # gradient's memory in the layers below
    dy = nchw.blobs["pool"].diff.copy()
    assert np.array_equal(nhwc_net.blobs["pool"].diff, dy)
    dx = nchw.blobs["r"].diff.copy()
    assert np.array_equal(nhwc_net.blobs["r"].diff, dx)
    assert np.array_equal(dx, K.max_pool_backward(dy, mask, r.shape, 2, 2, 0))
    assert (dx != 0).sum() > 0
    assert nhwc_net.layer_dict["pool"].last_body == "mc_nhwc16"
    assert nchw.layer_dict["pool"].last_body == "cudnn"
    for p in plans:
        p.release()


VGGISH = """
name: "vggish"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 3 dim: 32 dim: 32 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 12 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "pool2" top: "conv3"
  convolution_param { num_output: 24 kernel_size: 2 weight_filler { type: "msra" } } }
layer { name: "relu3" type: "ReLU" bottom: "conv3" top: "conv3" }
layer { name: "pool3" type: "Pooling" bottom: "conv3" top: "pool3"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool3" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_a_vgg_like_chain_matches_the_nchw_plan(prec, monkeypatch):
    """conv-ReLU-pool three times (16, 12 channels: 16-byte and 8-byte vectors; conv3's
    7x7 map: Caffe's ceil output 4x4, which cuDNN's floor does not give -- Caffe's engine
    pools it in both plans) against the NCHW plan, within the channels-last tests'
    tolerances."""
    nchw, nhwc_net, plans = _nets(VGGISH, prec, monkeypatch)
    _step_against_nchw(nchw, nhwc_net, TOL[prec],
                       ("conv1", "pool1", "conv2", "pool2", "conv3", "pool3"))
    assert nhwc_net.blobs["pool3"].shape == (8, 24, 4, 4)
    for name in ("pool1", "pool2"):
        assert nhwc_net.layer_dict[name].last_body == "mc_nhwc16", name
        assert nchw.layer_dict[name].last_body == "cudnn", name
    for n in (nchw, nhwc_net):
        assert n.layer_dict["pool3"].last_body == "caffe"
    for p in plans:
        p.release()


def _step_against_nchw(nchw, nhwc_net, tol, maps):
    """A forward and a backward of both nets: the loss, ``maps``' data, conv1's gradient
    (read by the last op: no later op may have reused its memory) and every parameter's
    gradient of the channels-last plan against the NCHW plan's, within the channels-last
    tests' tolerances (``tol``, twice it for maps, four times for gradients)."""
    l1, l2 = float(nchw.forward()["loss"]), float(nhwc_net.forward()["loss"])
    nchw.backward()
    nhwc_net.backward()
    assert abs(l1 - l2) <= tol * abs(l1)
    for name in maps:
        _close(nchw.blobs[name].data, nhwc_net.blobs[name].data, 2 * tol, name)
    _close(nchw.blobs["conv1"].diff, nhwc_net.blobs["conv1"].diff, 4 * tol, "conv1 diff")
    for name in nchw.params:
        for k, (a, b) in enumerate(zip(nchw.params[name], nhwc_net.params[name])):
            _close(a.diff, b.diff, 4 * tol, f"{name}[{k}] diff")


def test_pad_channels_kernel_is_its_numpy_body():
    from minicaffe.kernels import pad16
    cp = backend.gpu_module()
    x = np.random.RandomState(1).randint(0, 1 << 16, size=5 * 7 * 3).astype(np.uint16)
    ref = pad16.pad_channels(x, np.empty(5 * 7 * 8, np.uint16), 3, 8)
    got = pad16.pad_channels(cp.asarray(x), cp.full(5 * 7 * 8, 9, cp.uint16), 3, 8)
    assert np.array_equal(cp.asnumpy(got), ref)


@pytest.mark.parametrize("pad", ["1", "0"])
def test_a_first_convolution_on_padded_channels_matches_the_nchw_plan(pad, monkeypatch):
    """VGG-like conv1 (3 input channels) with MINICAFFE_CONV_PAD8=1 (its forward and filter
    gradient on the input and filter padded to 8 zero channels) and 0 (never): the maps
    and every parameter gradient against the NCHW plan's."""
    monkeypatch.setenv("MINICAFFE_CONV_PAD8", pad)
    nchw, nhwc_net, plans = _nets(VGGISH, "bf16", monkeypatch)
    assert nhwc_net.layer_dict["conv1"].pads_channels == (pad == "1")
    assert not nhwc_net.layer_dict["conv2"].pads_channels        # 16 channels
    assert not nchw.layer_dict["conv1"].pads_channels
    _step_against_nchw(nchw, nhwc_net, TOL["bf16"], ("conv1", "pool1", "conv2"))
    for p in plans:
        p.release()
