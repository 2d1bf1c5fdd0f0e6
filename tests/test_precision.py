"""Reduced precision on the CPU (issue 20): the type rules (which blob is stored in which
type, NVIDIA Caffe 0.17's fields and minicaffe's --precision switch), the storage of
feature maps and diffs in float16 (numpy's) and bfloat16 (fp32 with the low 16 bits
rounded off), loss scaling, and fp32 snapshots."""
import numpy as np
import pytest
from google.protobuf import text_format

from minicaffe.core import precision as P
from minicaffe.core.config import RunConfig
from minicaffe.core.errors import ConfigError
from minicaffe.network.net import Net, insert_splits
from minicaffe.proto import caffe_pb2

NET = """
name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 8 dim: 2 dim: 6 dim: 6 } shape { dim: 8 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }
"""


def net_param(text=NET, **fields):
    p = text_format.Parse(text, caffe_pb2.NetParameter())
    for k, v in fields.items():
        setattr(p, k, v)
    p.state.phase = caffe_pb2.TRAIN
    return p


def types_of(text=NET, precision=None, **fields):
    return P.resolve(insert_splits(net_param(text, **fields)), precision)


# -- the rules ------------------------------------------------------------------------------
def test_fp32_default_stores_everything_in_float():
    t = types_of()
    assert not t.reduced and t.loss_scale is None
    assert set(t.data.values()) == {"FLOAT"} and set(t.diff.values()) == {"FLOAT"}


@pytest.mark.parametrize("prec,kind", [("bf16", "BFLOAT16"), ("fp16", "FLOAT16")])
def test_switch_stores_feature_maps_reduced_and_keeps_losses_labels_fp32(prec, kind):
    t = types_of(precision=prec)
    assert t.reduced
    for blob in ("data", "conv", "pool", "ip"):
        assert t.data[blob] == kind, blob
    for blob in ("conv", "pool"):
        assert t.diff[blob] == kind, blob
    # the label (through its split), the loss and the accuracy stay fp32
    assert t.data["label"] == "FLOAT"
    assert all(t.data[b] == "FLOAT" for b in t.data if b.startswith("label_"))
    assert t.data["loss"] == "FLOAT" and t.data["acc"] == "FLOAT"
    # the logits' diff is written by the loss layer's backward: FLOAT
    assert all(t.diff[b] == "FLOAT" for b in t.diff if b.startswith("ip_"))
    lt = t.layer("conv")
    assert (lt.forward_type, lt.backward_type, lt.forward_math, lt.backward_math) == \
        (kind, kind, "FLOAT", "FLOAT")
    assert t.layer("loss").forward_type == "FLOAT"
    assert t.layer("data").backward_type == "FLOAT"
    assert t.loss_scale == (P.DYNAMIC if prec == "fp16" else None)


def test_nvidia_net_fields_and_layer_fields_win_in_their_order():
    text = NET.replace('name: "ip" type: "InnerProduct"',
                       'name: "ip" type: "InnerProduct" forward_type: FLOAT '
                       'backward_type: FLOAT')
    t = types_of(text, default_forward_type=caffe_pb2.FLOAT16,
                 default_backward_type=caffe_pb2.FLOAT16)
    # NVIDIA Caffe: an unset default math takes the default type
    assert t.layer("conv").forward_math == "FLOAT16"
    assert t.data["conv"] == "FLOAT16" and t.data["ip"] == "FLOAT"
    assert t.diff["pool"] == "FLOAT"          # ip's backward type
    t2 = types_of(text, default_forward_type=caffe_pb2.FLOAT16,
                  default_forward_math=caffe_pb2.FLOAT)
    assert t2.layer("conv").forward_math == "FLOAT"
    assert t2.layer("conv").backward_type == "FLOAT"
    # the switch replaces the net's defaults, not a layer's own fields
    t3 = types_of(text, precision="fp32", default_forward_type=caffe_pb2.FLOAT16)
    assert t3.data["conv"] == "FLOAT"
    t4 = types_of(text, precision="bf16")
    assert t4.data["conv"] == "BFLOAT16" and t4.data["ip"] == "FLOAT"


def test_global_grad_scale_is_a_fixed_scale_and_bad_types_are_one_line():
    assert types_of(precision="fp16", global_grad_scale=128.0).loss_scale == 128.0
    with pytest.raises(ConfigError, match="global_grad_scale"):
        types_of(global_grad_scale=-1.0)
    text = NET.replace('name: "relu" type: "ReLU"', 'name: "relu" type: "ReLU" '
                       'forward_type: DOUBLE')
    with pytest.raises(ConfigError, match="layer 'relu': forward_type DOUBLE"):
        types_of(text)
    with pytest.raises(ConfigError, match="--precision 'fp8'"):
        RunConfig(precision="fp8")
    assert RunConfig(precision="TF32").tf32 and not RunConfig(tf32=True, precision="fp32").tf32


def test_nvidia_prototxt_fields_parse_by_name():
    p = text_format.Parse("""default_forward_type: FLOAT16 default_backward_type: FLOAT16
        default_forward_math: FLOAT global_grad_scale: 8
        layer { name: "r" type: "ReLU" forward_type: FLOAT16 backward_math: FLOAT }""",
                          caffe_pb2.NetParameter())
    assert p.default_forward_math == caffe_pb2.FLOAT and p.global_grad_scale == 8
    # NVIDIA Caffe's numbers where BVLC leaves them free
    d = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name
    assert [d[n].number for n in ("default_forward_type", "default_backward_type",
                                  "default_forward_math", "default_backward_math",
                                  "global_grad_scale")] == [11, 12, 13, 14, 15]
    assert caffe_pb2.SolverParameter.DESCRIPTOR.fields_by_name["solver_data_type"].number == 44
    assert caffe_pb2.FLOAT16 == 2 and caffe_pb2.FLOAT == 1


# -- the storage -----------------------------------------------------------------------------
def bf16_of(a):
    """A reference bfloat16 rounding (ties to even) written with integers."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def test_round_to_matches_float16_and_a_bfloat16_reference():
    rng = np.random.RandomState(1701)
    x = (rng.randn(5000) * 10.0 ** rng.randint(-8, 8, 5000)).astype(np.float32)
    a = x.copy()
    P.round_to(np, a, "FLOAT16")
    with np.errstate(over="ignore"):
        assert np.array_equal(a, x.astype(np.float16).astype(np.float32))
    b = x.copy()
    P.round_to(np, b, "BFLOAT16")
    assert np.array_equal(b, bf16_of(x))
    assert P.representable(np, b, "BFLOAT16") and not P.representable(np, x, "BFLOAT16")
    big = np.array([7e4, -7e4, np.nan], np.float32)
    P.round_to(np, big, "FLOAT16")
    assert np.isinf(big[:2]).all() and np.isnan(big[2])


@pytest.mark.parametrize("prec,kind", [("bf16", "BFLOAT16"), ("fp16", "FLOAT16")])
def test_net_stores_feature_maps_and_diffs_in_the_reduced_type(prec, kind):
    net = Net(net_param(), config=RunConfig(precision=prec))
    assert net.types.reduced
    net.forward()
    net.backward()
    for name in ("data", "conv", "pool", "ip"):
        assert P.representable(np, net.blobs[name].data, kind), name
    for name in ("conv", "pool"):
        assert P.representable(np, net.blobs[name].diff, kind), name
    # master weights and their diffs stay fp32 (not all representable in the reduced type)
    w = net.params["conv"][0]
    assert w.data.dtype == np.float32 and not P.representable(np, w.data, kind)
    assert not P.representable(np, w.diff, kind)


@pytest.mark.parametrize("prec,tol", [("bf16", 3e-2), ("fp16", 4e-3)])
def test_reduced_forward_backward_tracks_fp32(prec, tol):
    from minicaffe.core import context
    context.set_random_seed(1701)
    ref = Net(net_param(), config=RunConfig())
    context.set_random_seed(1701)
    low = Net(net_param(), config=RunConfig(precision=prec))
    for name in ref.params:
        for a, b in zip(ref.params[name], low.params[name]):
            b.data[...] = a.data
    ref.forward()
    low.blobs["data"].data[...] = ref.blobs["data"].data
    low.forward(start="conv")
    ref.backward()
    low.backward()
    assert abs(float(low.blobs["loss"].data) - float(ref.blobs["loss"].data)) < \
        tol * abs(float(ref.blobs["loss"].data)) + 1e-6
    g, g0 = low.params["conv"][0].diff, ref.params["conv"][0].diff
    assert np.abs(g - g0).max() <= 2 * tol * np.abs(g0).max()
    assert not np.array_equal(low.blobs["conv"].data, ref.blobs["conv"].data)
