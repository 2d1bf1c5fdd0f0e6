"""A small net's 2-byte weight copies cast in one launch (kernels/wcast.py, the plan's
``one_cast``), on the CPU: the kernel's index math (emulated here block by block) against
the numpy body, the numpy body against each layer's own cast (the transposed K, R*S, C
copy of a channels-last convolution, the plain copy of an InnerProduct), and the plan's
choice.  The kernel itself and the training step with it: tests/test_wcast_gpu.py."""
import numpy as np
import pytest

from minicaffe import Net
from minicaffe.core import precision as P
from minicaffe.core.config import RunConfig
from minicaffe.core.errors import MinicaffeError
from minicaffe.engine.plan import MemoryPlan
from minicaffe.kernels import wcast
from minicaffe.proto import caffe_pb2

STORAGES = [P.BFLOAT16, P.FLOAT16]
# (k, c, rs): a 5 x 5 convolution, a 1 x 1 one, an InnerProduct, one over a block's size
DIMS = [(50, 20, 25), (16, 8, 1), (1, 3000, 1), (7, 3, 9), (1, 1, 1)]


def _entries(storage):
    rs = np.random.RandomState(0)
    out = []
    for k, c, r in DIMS:
        src = (rs.randn(k * c * r) * 3).astype(np.float32)
        src[::17] = rs.choice([0.0, -0.0, 1e-41, 70000.0, np.inf, np.nan], src[::17].size)
        out.append((src, np.zeros(k * c * r, P.buffer_dtype(storage)), (k, c, r)))
    return out


def _kernel_emulated(entries, storage):
    """mc_wcast's arithmetic, one block row of the table at a time."""
    for e, o0 in wcast.block_table([d.size for _, d, _ in entries]):
        src, dst, (k, c, rs) = entries[e]
        n, crs = k * c * rs, c * rs
        o = o0 + np.arange(wcast.PER_BLOCK)
        o = o[o < n]
        kk, r = o // crs, o % crs
        j, cc = r // c, r % c
        dst[o] = P.narrow(np, src[kk * crs + cc * rs + j], np.empty(o.size, dst.dtype),
                          storage)


def _same_bits(a, b):
    return np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("storage", STORAGES)
def test_the_kernels_index_math_is_the_numpy_cast(storage):
    a, b = _entries(storage), _entries(storage)
    wcast.cast_numpy(a, storage)
    _kernel_emulated(b, storage)
    for (_, x, dims), (_, y, _) in zip(a, b):
        assert _same_bits(x, y), dims


@pytest.mark.parametrize("storage", STORAGES)
def test_each_copy_is_the_layers_own_cast(storage):
    """A convolution's copy is K, R, S, C (a 1 x 1 one K, C), an InnerProduct's its own
    shape, each value rounded to nearest even (precision.narrow, what the per-layer casts
    are tested against)."""
    entries = _entries(storage)
    wcast.cast_numpy(entries, storage)
    for src, dst, (k, c, rs) in entries:
        want = P.narrow(np, np.ascontiguousarray(src.reshape(k, c, rs).transpose(0, 2, 1)),
                        np.empty((k, rs, c), dst.dtype), storage)
        assert _same_bits(dst.reshape(k, rs, c), want)


def test_the_block_table_covers_each_element_once():
    sizes = [1, 1024, 1025, 3000, 50 * 20 * 25]
    seen = [np.zeros(n, int) for n in sizes]
    for e, o0 in wcast.block_table(sizes):
        seen[e][o0:o0 + wcast.PER_BLOCK] += 1
    assert all((s == 1).all() for s in seen)


def test_an_entry_that_does_not_fit_is_refused():
    src = np.zeros(12, np.float32)
    with pytest.raises(ValueError, match="does not fit"):
        wcast.cast_numpy([(src, np.zeros(12, np.uint16), (2, 2, 2))], P.BFLOAT16)
    with pytest.raises(ValueError, match="does not fit"):
        wcast.cast_numpy([(src, np.zeros(12, np.float16), (2, 3, 2))], P.BFLOAT16)


NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 1 dim: 12 dim: 12 } shape { dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "ip1" type: "InnerProduct" bottom: "conv" top: "ip1"
  inner_product_param { num_output: 20 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ipm" type: "InnerProduct" bottom: "ip1" top: "ipm"
  inner_product_param { num_output: 16 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "ipm" top: "ipm" }
layer { name: "ip2" type: "InnerProduct" bottom: "ipm" top: "ip2"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def _plan(train=True):
    net = Net(NET, phase=caffe_pb2.TRAIN, config=RunConfig(precision="bf16"))
    return net, MemoryPlan(net, train=train, reduced_storage=True)


def test_a_small_nets_copies_are_cast_once_and_live_from_the_first_step(monkeypatch):
    """The InnerProducts' copies (the layers with a 2-byte body on the CPU; ip2 feeds
    the fp32 loss, so it runs in fp32) each one buffer from the first body step to the layer's backward, instead of one at each of
    its two calls; ``MINICAFFE_ONE_WEIGHT_CAST=0`` keeps the per-call copies."""
    monkeypatch.delenv("MINICAFFE_ONE_WEIGHT_CAST", raising=False)
    net, plan = _plan()
    names = [net.layer_names[net.layers.index(layer)] for layer, _, _ in plan.one_cast]
    assert names == ["ip1", "ipm"]
    assert all(s == P.BFLOAT16 for _, s, _ in plan.one_cast)
    first = min(b.start for b in plan.weight_copies)
    assert len(plan.weight_copies) == 2 and all(b.start == first for b in plan.weight_copies)
    assert any("cast in one launch" in line for line in plan.report())
    monkeypatch.setenv("MINICAFFE_ONE_WEIGHT_CAST", "0")
    net, plan = _plan()
    assert plan.one_cast == [] and len(plan.weight_copies) == 4     # forward, backward each
    assert not any("cast in one launch" in line for line in plan.report())


def test_the_limit_and_the_variable(monkeypatch):
    from minicaffe.engine import plan as plan_mod
    monkeypatch.delenv("MINICAFFE_ONE_WEIGHT_CAST", raising=False)
    monkeypatch.setattr(plan_mod, "ONE_CAST_LIMIT", 100)   # below ip1's copy: per call
    assert _plan()[1].one_cast == []
    monkeypatch.setenv("MINICAFFE_ONE_WEIGHT_CAST", "1")   # whatever the size
    assert len(_plan()[1].one_cast) == 2
    assert _plan(train=False)[1].one_cast == []           # a forward plan: no step to cast
    monkeypatch.setenv("MINICAFFE_ONE_WEIGHT_CAST", "once")
    with pytest.raises(MinicaffeError, match="MINICAFFE_ONE_WEIGHT_CAST='once'"):
        _plan()


def test_a_net_mixing_bf16_and_fp16_layers_casts_per_layer(monkeypatch):
    """One launch casts to one type: where NVIDIA Caffe's per-layer types give 2-byte
    bodies of both types, each layer keeps its copies at its own calls."""
    monkeypatch.delenv("MINICAFFE_ONE_WEIGHT_CAST", raising=False)
    f16 = ' forward_type: FLOAT16 backward_type: FLOAT16'
    extra = f'''layer {{ name: "ipx" type: "InnerProduct" bottom: "ipm" top: "ipx"{f16}
  inner_product_param {{ num_output: 12 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu3" type: "ReLU" bottom: "ipx" top: "ipx"{f16} }}
layer {{ name: "ipy" type: "InnerProduct" bottom: "ipx" top: "ipy"{f16}
  inner_product_param {{ num_output: 12 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu4" type: "ReLU" bottom: "ipy" top: "ipy"{f16} }}
'''
    text = NET.replace('layer { name: "ip2" type: "InnerProduct" bottom: "ipm"',
                       extra + 'layer { name: "ip2" type: "InnerProduct" bottom: "ipy"')
    net = Net(text, phase=caffe_pb2.TRAIN, config=RunConfig(precision="bf16"))
    plan = MemoryPlan(net, reduced_storage=True)
    assert plan.one_cast == []
    names = sorted(b.names[0] for b in plan.weight_copies)
    assert names == sorted(f"{n} ({d} weights)" for n in ("ip1", "ipm", "ipy")
                           for d in ("forward", "backward"))
