"""Real 16-bit storage in the GPU engine's plan (issue 20, engine/precision.py): which
buffers are 2-byte words, which layers run on them and which between cast ops, and the
conversions (numpy's float16 and the uint16 words of bfloat16 stand in for the GPU's)."""
import numpy as np
import pytest

from minicaffe import Net
from minicaffe.core import precision as P
from minicaffe.core.config import RunConfig
from minicaffe.engine.plan import ALIGN, MemoryPlan
from minicaffe.engine.precision import precision_pass, storage_lines
from minicaffe.engine.schedule import schedule_for
from minicaffe.proto import caffe_pb2
from test_memory_plan import CHAIN


def _net(prec, text=CHAIN, nhwc=False):
    """The net in ``prec``; NCHW buffers unless ``nhwc`` (channels-last: the tests of the
    layout plan at the end)."""
    return Net(text, phase=caffe_pb2.TRAIN,
               config=RunConfig(precision=prec, channels_last=nhwc))


def _bytes(plan):
    """{(first blob name, kind): bytes} of the plan's data and diff buffers."""
    return {(b.names[0], b.kind): b.nbytes for b in plan.buffers if b.kind in ("data", "diff")}


def _aligned(n):
    return -(-n // ALIGN) * ALIGN


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_plan_holds_reduced_blobs_in_two_bytes_and_the_rest_in_four(prec):
    net = _net(prec)
    count = {n: b.count for n, b in net.blobs.items()}
    got = _bytes(MemoryPlan(net, reduced_storage=True))
    for name in ("conv1", "pool1", "conv2", "pool2"):     # feature maps and their diffs
        assert got[(name, "data")] == _aligned(2 * count[name]), name
        assert got[(name, "diff")] == _aligned(2 * count[name]), name
    # the data layer's tops (inputs, labels), the loss, and the loss's input gradient
    # (SoftmaxWithLoss's backward type is FLOAT) stay fp32
    for key in (("data", "data"), ("label", "data"), ("loss", "data"), ("ip", "diff")):
        assert got[key] == _aligned(4 * count[key[0]]), key
    # without 16-bit storage (an offloading plan, the CPU's emulation): fp32 buffers
    emulated = _bytes(MemoryPlan(net))
    assert emulated[("conv1", "data")] == _aligned(4 * count["conv1"])
    # an fp32 net: four bytes everywhere
    fp32 = _bytes(MemoryPlan(_net(None), reduced_storage=True))
    assert fp32 == emulated


def test_plan_arena_shrinks_and_cast_scratch_is_planned():
    full = MemoryPlan(_net("bf16"))
    half = MemoryPlan(_net("bf16"), reduced_storage=True)
    assert half.unshared_bytes < 0.75 * full.unshared_bytes
    scratch = [b for b in half.buffers if b.kind == "cast"]
    assert scratch and all(b.start == b.end or b.end - b.start <= 1 for b in scratch)
    assert any("16-bit storage: " in line for line in half.report())


FC = CHAIN.replace('layer { name: "ip"', '''layer { name: "fc" type: "InnerProduct" bottom: "pool2" top: "fc"
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "ip"''').replace('bottom: "pool2" top: "ip"', 'bottom: "fc" top: "ip"')


def test_inner_product_weight_copies_are_arena_buffers_at_their_calls(monkeypatch):
    # the 2-byte copy of an InnerProduct's weights that its native body casts at each call
    # is a buffer of the plan, live at that layer's op only (VGG-16's fc6: 196 MiB that
    # a scratch held for the whole run); a small net's copies are cast in one launch
    # instead unless MINICAFFE_ONE_WEIGHT_CAST=0 (tests/test_wcast.py)
    monkeypatch.setenv("MINICAFFE_ONE_WEIGHT_CAST", "0")
    net = _net("bf16", FC)
    plan = MemoryPlan(net, reduced_storage=True)
    copies = {b.names[0]: b for b in plan.buffers if b.kind == "weights"}
    i, L = net.layer_names.index("fc"), len(net.layers)
    nbytes = _aligned(2 * net.params["fc"][0].count)
    fwd, bwd = copies["fc (forward weights)"], copies["fc (backward weights)"]
    assert fwd.nbytes == bwd.nbytes == nbytes
    assert (fwd.start, fwd.end) == (i, i) and (bwd.start, bwd.end) == (2 * L - 1 - i,) * 2
    # the last one reads the loss's fp32 gradient: fp32 body, no copy
    assert not any(n.startswith("ip ") for n in copies)
    assert any("weight copies in the reduced type" in line for line in plan.report())
    # without 16-bit storage (fp32 buffers: the fp32 bodies run) there are none
    assert not any(b.kind == "weights" for b in MemoryPlan(net).buffers)
    # they share the arena: no two live buffers overlap
    for a in plan.buffers:
        for b in plan.buffers:
            if a is not b and a.overlaps(b):
                assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset


@pytest.mark.parametrize("prec,kind", [("bf16", "BFLOAT16"), ("fp16", "FLOAT16")])
def test_listing_says_which_layers_run_native_and_which_in_fp32(prec, kind):
    lines = storage_lines(_net(prec, FC))
    assert f"  conv1 (Convolution): native {kind}" in lines
    assert f"  relu1 (ReLU): native {kind}" in lines
    assert f"  pool1 (Pooling): native {kind}" in lines
    assert f"  fc (InnerProduct): native {kind}" in lines
    # the last InnerProduct reads the loss's gradient, FLOAT by the type rules: fp32 body
    assert "  ip (InnerProduct): fp32" in lines
    assert "  loss (SoftmaxWithLoss): fp32" in lines
    assert storage_lines(_net(None)) == []


def test_schedule_casts_only_at_the_fp32_boundaries():
    net = _net("bf16")
    text = [str(op) for op in precision_pass(schedule_for(net), net).ops]
    casts = [t for t in text if t.startswith("cast")]
    # the input (stored fp32) goes to conv1 as bfloat16, in forward and in backward
    assert casts.count("cast data (data FLOAT -> BFLOAT16 scratch)") == 2
    # ip (fp32: it reads the loss's fp32 gradient) and the loss read bfloat16 maps
    # through fp32 scratch; ip's output is rounded into its bfloat16 buffer
    k = text.index("forward 7 ip")
    assert text[k - 1] == "cast pool2 (data BFLOAT16 -> FLOAT scratch)"
    assert text[k + 1] == "cast ip (data FLOAT scratch -> BFLOAT16)"
    k = text.index("forward 8 loss")
    assert text[k - 1] == "cast ip (data BFLOAT16 -> FLOAT scratch)"
    k = text.index("backward 7 ip")
    assert text[k - 1] == "cast pool2 (data BFLOAT16 -> FLOAT scratch)"
    assert text[k + 1] == "cast pool2 (diff FLOAT scratch -> BFLOAT16)"
    # nothing between the native layers; no rounding of 2-byte blobs
    assert not any("conv1" in t or "pool1" in t or "conv2" in t for t in casts)
    # the one rounding left: the input, an fp32 buffer holding bfloat16 values
    assert [t for t in casts if " to BFLOAT16)" in t] == ["cast 0 data (data to BFLOAT16)"]
    # the CPU's emulation (no 16-bit storage): rounding casts after the layers
    emu = [str(op) for op in precision_pass(schedule_for(net), net, {}).ops]
    assert "cast 1 conv1 (data to BFLOAT16)" in emu


def test_a_layer_without_a_reduced_body_runs_between_casts():
    text = CHAIN.replace('''layer { name: "ip"''', '''layer { name: "sig" type: "Sigmoid" bottom: "pool2" top: "sig" }
layer { name: "ip"''').replace('bottom: "pool2" top: "ip"', 'bottom: "sig" top: "ip"')
    net = _net("bf16", text)
    assert "  sig (Sigmoid): fp32" in storage_lines(net)
    ops = [str(op) for op in precision_pass(schedule_for(net), net).ops]
    k = ops.index("forward 7 sig")
    assert ops[k - 1] == "cast pool2 (data BFLOAT16 -> FLOAT scratch)"
    assert ops[k + 1] == "cast sig (data FLOAT scratch -> BFLOAT16)"
    k = ops.index("backward 7 sig")
    assert "cast sig (diff BFLOAT16 -> FLOAT scratch)" in ops[k - 3:k]
    assert ops[k + 1] == "cast pool2 (diff FLOAT scratch -> BFLOAT16)"


def test_narrow_and_widen_are_the_rounding_of_the_emulation():
    rs = np.random.RandomState(5)
    a = (rs.standard_normal(1000) * 10.0 ** rs.uniform(-8, 8, 1000)).astype(np.float32)
    a[:4] = [np.inf, -np.inf, np.nan, 3.4e38]
    for s in (P.BFLOAT16, P.FLOAT16):
        h = P.narrow(np, a, np.empty(a.size, P.buffer_dtype(s)), s)
        assert h.dtype.itemsize == 2 and P.storage_of(h) == s
        back = P.widen(np, h, np.empty(a.size, np.float32), s)
        ref = P.round_to(np, a.copy(), s)
        same = (back == ref) | (np.isnan(back) & np.isnan(ref))
        assert same.all(), s
    assert P.storage_of(np.zeros(1, np.float32)) == P.FLOAT


def test_memory_cli_lists_native_layers(cli, tmp_path, monkeypatch):
    (tmp_path / "net.prototxt").write_text(FC)
    monkeypatch.setenv("MINICAFFE_CHANNELS_LAST", "0")      # (on by default: below)
    rc, out, err = cli("memory", "--model", tmp_path / "net.prototxt", "--precision", "fp16")
    assert rc == 0, err
    assert "16-bit storage on a GPU" in out
    assert "  conv2 (Convolution): native FLOAT16" in out.splitlines()
    assert "  ip (InnerProduct): fp32" in out
    assert "  ip (InnerProduct): fp32" in out
    rc, out, err = cli("memory", "--model", tmp_path / "net.prototxt")
    assert rc == 0 and "16-bit storage" not in out


# -- channels-last (NHWC) inside the engine ------------------------------------------------
def test_layout_plan_holds_4d_two_byte_maps_channels_last():
    from minicaffe.engine.precision import layout_plan, storage_plan
    net = _net("bf16", FC, nhwc=True)
    storage = storage_plan(net)
    lay = layout_plan(net, storage)
    for name in ("conv1", "pool1", "conv2", "pool2"):
        for kind in ("data", "diff"):
            m = id(getattr(net.blobs[name], kind + "_mem"))
            assert lay[m] == tuple(net.blobs[name].shape), (name, kind)
    # fp32 buffers (the input) and 2-D maps are not in it
    assert id(net.blobs["data"].data_mem) not in lay
    assert id(net.blobs["fc"].data_mem) in storage and id(net.blobs["fc"].data_mem) not in lay
    # off: no channels-last buffer; the switch is the run's (RunConfig.channels_last)
    off = _net("bf16", FC)
    assert layout_plan(off, storage_plan(off)) == {}


FLAT = FC.replace('layer { name: "fc"', '''layer { name: "flat" type: "Flatten" bottom: "pool2" top: "flat" }
layer { name: "gp" type: "Pooling" bottom: "conv2" top: "gp"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "gpfc" type: "InnerProduct" bottom: "gp" top: "gpfc"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "fc"''').replace('bottom: "pool2" top: "fc"', 'bottom: "flat" top: "fc"')


def test_a_map_of_one_pixel_or_shared_with_a_flatten_stays_nchw():
    from minicaffe.engine.precision import layout_plan, storage_plan
    net = _net("bf16", FLAT, nhwc=True)
    lay = layout_plan(net, storage_plan(net))
    assert id(net.blobs["pool2"].data_mem) not in lay     # shared with flat (2-D)
    assert id(net.blobs["gp"].data_mem) not in lay        # 1 x 1: the same bytes either way
    assert id(net.blobs["conv2"].data_mem) in lay
    # pool2's pooling writes a map that cannot be channels-last: that op runs NCHW and
    # reads conv2 through a transposing cast
    text = [str(op) for op in precision_pass(schedule_for(net), net).ops]
    k = text.index("forward 7 pool2")
    assert text[k - 1] == "cast conv2_relu2_0_split_0 (data BFLOAT16 NHWC -> BFLOAT16 scratch)"
    # the global pooling beside it (a 1 x 1 output) reads the channels-last map as it is
    k = text.index("forward 9 gp")
    assert not text[k - 1].startswith("cast")


def test_casts_transpose_at_the_layout_boundaries():
    net = _net("bf16", FC, nhwc=True)
    text = [str(op) for op in precision_pass(schedule_for(net), net).ops]
    casts = [t for t in text if t.startswith("cast")]
    # the fp32 NCHW input goes to conv1 as channels-last bfloat16 (forward and backward)
    assert casts.count("cast data (data FLOAT -> BFLOAT16 NHWC scratch)") == 2
    # fc (InnerProduct, native bf16 but NCHW) reads pool2 through a transposing cast of
    # the same type, and writes pool2's gradient back through one
    k = text.index("forward 7 fc")
    assert text[k - 1] == "cast pool2 (data BFLOAT16 NHWC -> BFLOAT16 scratch)"
    k = text.index("backward 7 fc")
    assert "cast pool2 (data BFLOAT16 NHWC -> BFLOAT16 scratch)" in text[k - 2:k]
    assert text[k + 1] == "cast pool2 (diff BFLOAT16 scratch -> BFLOAT16 NHWC)"
    # nothing between the channels-last layers
    assert not any(n in t for t in casts for n in ("conv1 ", "pool1 ", "conv2 "))
    lines = storage_lines(net)
    assert "  conv1 (Convolution): native BFLOAT16 channels-last" in lines
    assert "  fc (InnerProduct): native BFLOAT16" in lines


def test_an_fp32_layer_reads_a_channels_last_map_through_an_nchw_scratch():
    text = CHAIN.replace('layer { name: "ip"', '''layer { name: "sig" type: "Sigmoid" bottom: "pool2" top: "sig" }
layer { name: "ip"''').replace('bottom: "pool2" top: "ip"', 'bottom: "sig" top: "ip"')
    net = _net("bf16", text, nhwc=True)
    ops = [str(op) for op in precision_pass(schedule_for(net), net).ops]
    k = ops.index("forward 7 sig")
    assert ops[k - 1] == "cast pool2 (data BFLOAT16 NHWC -> FLOAT scratch)"
    assert ops[k + 1] == "cast sig (data FLOAT scratch -> BFLOAT16 NHWC)"


@pytest.mark.parametrize("src_type,dst_type", [(P.FLOAT, P.BFLOAT16), (P.BFLOAT16, P.FLOAT),
                                               (P.FLOAT16, P.FLOAT16), (P.FLOAT, P.FLOAT16)])
def test_cast_conversion_transposes_as_numpy_does(src_type, dst_type):
    from minicaffe.engine.precision import _convert
    shape = (2, 3, 4, 5)
    rs = np.random.RandomState(7)
    a = rs.standard_normal(shape).astype(np.float32)
    src = a if src_type == P.FLOAT else \
        P.narrow(np, a, np.empty(shape, P.buffer_dtype(src_type)), src_type)
    vals = a if src_type == P.FLOAT else \
        P.widen(np, src, np.empty(shape, np.float32), src_type)
    ref = np.ascontiguousarray(vals.transpose(0, 2, 3, 1)).reshape(-1)
    if dst_type != P.FLOAT:
        ref = P.round_to(np, ref.copy(), dst_type)
    # NCHW -> NHWC: numpy's transpose of the values, converted
    dst = np.empty(a.size, P.buffer_dtype(dst_type))
    _convert(src.reshape(-1), dst, src_type, dst_type, None, shape)
    got = dst if dst_type == P.FLOAT else \
        P.widen(np, dst, np.empty(dst.size, np.float32), dst_type)
    assert np.array_equal(got, ref)
    # and back: exact where the way there rounded nothing
    back = np.empty(a.size, P.buffer_dtype(src_type))
    _convert(dst, back, dst_type, src_type, shape, None)
    if src_type != P.FLOAT or dst_type == P.FLOAT:
        assert np.array_equal(back, src.reshape(-1))


def test_host_side_transposes_of_a_channels_last_buffer():
    from minicaffe.core.synced_memory import from_nhwc, to_nhwc
    shape = (2, 3, 4, 5)
    a = np.arange(np.prod(shape), dtype=np.float32)
    t = to_nhwc(a, shape)
    assert np.array_equal(t, a.reshape(shape).transpose(0, 2, 3, 1).reshape(-1))
    assert np.array_equal(from_nhwc(t, shape), a)


def test_channels_last_switch_from_the_environment(monkeypatch):
    monkeypatch.delenv("MINICAFFE_CHANNELS_LAST", raising=False)
    assert RunConfig(precision="bf16").nhwc is True             # on by default
    assert RunConfig(precision="bf16", channels_last=False).nhwc is False
    monkeypatch.setenv("MINICAFFE_CHANNELS_LAST", "0")
    assert RunConfig(precision="bf16").nhwc is False
    assert RunConfig(precision="bf16", channels_last=True).nhwc is True
    monkeypatch.setenv("MINICAFFE_CHANNELS_LAST", "1")
    assert RunConfig(precision="bf16").nhwc is True
    assert RunConfig(precision="bf16", channels_last=False).nhwc is False


@pytest.mark.parametrize("env", [None, "1"])
def test_memory_cli_lists_channels_last_layers_when_switched_on(cli, tmp_path, monkeypatch,
                                                                env):
    (tmp_path / "net.prototxt").write_text(FC)
    if env is None:                              # on by default
        monkeypatch.delenv("MINICAFFE_CHANNELS_LAST", raising=False)
    else:
        monkeypatch.setenv("MINICAFFE_CHANNELS_LAST", env)
    rc, out, err = cli("memory", "--model", tmp_path / "net.prototxt", "--precision", "bf16")
    assert rc == 0, err
    assert "  conv2 (Convolution): native BFLOAT16 channels-last" in out
    assert "  fc (InnerProduct): native BFLOAT16" in out.splitlines()


CIFAR_POOLS = """
name: "pools"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 20 dim: 12 dim: 12 } shape { dim: 8 } } }
layer { name: "relu" type: "ReLU" bottom: "data" top: "r" }
layer { name: "pool1" type: "Pooling" bottom: "r" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }
layer { name: "pool2" type: "Pooling" bottom: "pool1" top: "pool2"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"
  inner_product_param { num_output: 4 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("nhwc", [True, False])
def test_two_byte_channels_last_pools_plan_no_casts_and_keep_argmax_bytes(nhwc, monkeypatch):
    """The GPU engine's plan, its decisions stood in for on the CPU (cuDNN 'available',
    GPU mode answered at the pools' reshape and in the plan): CIFAR-10 quick's MAX 3x3/2
    whose top a ReLU rewrites and AVE 3x3/2, both in Caffe's CEIL shape, in bf16 held
    channels-last run our kernels (kernels/pool16.py): no cast op around them, pool1's
    state its argmax bytes (one per output element and channel), neither pool retaining
    a map.  Held NCHW, pool1 takes Caffe's body between casts (cuDNN refused: its top is
    rewritten), with its int32 mask."""
    from minicaffe.core import context
    from minicaffe.layers import registry
    monkeypatch.setattr(registry, "cudnn_available", lambda: (True, ""))
    net = _net("bf16", CIFAR_POOLS, nhwc=nhwc)
    monkeypatch.setattr(context, "is_gpu", lambda: True)
    names = net.layer_names
    pools = ["pool1", "pool2"] if nhwc else ["pool1"]     # (pool2 NCHW asks cuDNN itself)
    for n in pools:
        i = names.index(n)
        net.layers[i].reshape(net.bottom_vecs[i], net.top_vecs[i])
    pool1 = net.layers[names.index("pool1")]
    assert pool1.engine_name == "CUDNN" and pool1.top_rewritten
    assert not pool1.uses_cudnn
    plan = MemoryPlan(net, reduced_storage=True)
    state = {r["layer"]: r["state"] for r in plan.rows}
    cast_at = {names[g.first] for g in plan.cast_groups if g.casts}
    if nhwc:
        layers = [net.layers[names.index(n)] for n in pools]
        assert [(l.reduced_body, l.retain_inputs, l.retain_outputs) for l in layers] == \
            [(True, (), ())] * 2
        assert state["pool1"] == 8 * 20 * 6 * 6 and state["pool2"] == 0
        assert not cast_at & {"pool1", "pool2"} and "ip" in cast_at
        assert plan.buffers and all(b.layout is not None for b in plan.buffers
                                    if b.names[0] in ("r", "pool1") and b.kind == "data")
    else:
        assert not pool1.reduced_body
        assert state["pool1"] == 8 * 20 * 6 * 6 * 4
        assert "pool1" in cast_at
