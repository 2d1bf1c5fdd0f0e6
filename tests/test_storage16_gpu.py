"""Real 16-bit storage on the GPU (issue 20, engine/precision.py): feature maps and their
diffs in 2-byte buffers, the layers with a reduced body on them (cuDNN convolution and
pooling, ReLU, InnerProduct through cublasGemmEx), cast ops around the others; against
the emulation (fp32 buffers rounded to the type) and fp32, within stated tolerances."""
import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core import precision as P
from minicaffe.core.config import RunConfig
from minicaffe.proto import caffe_pb2

pytestmark = pytest.mark.gpu

LENET = """
name: "LeNet"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 64 dim: 1 dim: 28 dim: 28 } shape { dim: 64 }
    data_filler { type: "uniform" min: 0 max: 1 } data_filler { type: "uniform" min: 0 max: 9.99 } } }
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
  inner_product_param { num_output: 500 weight_filler { type: "xavier" }
    bias_filler { type: "constant" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 10 weight_filler { type: "xavier" }
    bias_filler { type: "constant" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

# a small conv net: a fused Convolution+ReLU, a 1x1 convolution, AVE pooling, a
# Sigmoid (no reduced body: cast ops around it), a Split (ResNet's) and an Eltwise
CONVS = """
name: "convs"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 16 dim: 8 dim: 12 dim: 12 } shape { dim: 16 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 1 weight_filler { type: "msra" } } }
layer { name: "sig" type: "Sigmoid" bottom: "conv2" top: "sig" }
layer { name: "sum" type: "Eltwise" bottom: "sig" bottom: "conv1" top: "sum" }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
SOLVER = """
net_param { %s }
base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed"
max_iter: 100 display: 0 random_seed: 1701 %s
"""
KIND = {"bf16": "BFLOAT16", "fp16": "FLOAT16"}
# relative to the largest magnitude: bf16 keeps 8 bits of mantissa, fp16 11
TOL = {"bf16": 0.03, "fp16": 4e-3}


def _pair(prec, text=CONVS, fp32=False):
    """Two GPU nets with the same weights and inputs: the emulation (fp32 buffers) and
    one whose plan holds 16-bit storage (applied as the GPU step does); with ``fp32``, a
    third, the same net in fp32 (the reference both are measured against)."""
    from minicaffe import Net
    from minicaffe.engine.plan import MemoryPlan
    context.set_mode_gpu()
    context.set_random_seed(1701)
    emu = Net(text, phase=caffe_pb2.TRAIN, config=RunConfig(precision=prec))
    real = Net(text, phase=caffe_pb2.TRAIN, config=RunConfig(precision=prec))
    nets = [emu, real] + ([Net(text, phase=caffe_pb2.TRAIN, config=RunConfig())]
                          if fp32 else [])
    for other in nets[1:]:
        for name in emu.params:
            for a, b in zip(emu.params[name], other.params[name]):
                b.data[...] = a.data
    rs = np.random.RandomState(3)
    x = rs.standard_normal(emu.blobs["data"].shape).astype(np.float32)
    y = rs.randint(0, 4, emu.blobs["label"].shape).astype(np.float32)
    plan = MemoryPlan(real, reduced_storage=True)
    plan.apply()
    for n in nets:
        n.blobs["data"].data[...] = x
        n.blobs["label"].data[...] = y
    return tuple(nets) + (plan,)


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_real_storage_forward_backward_matches_the_emulation(prec):
    emu, real, plan = _pair(prec)
    assert real.blobs["conv1"].data_mem.storage == KIND[prec]
    # what the data layers write (the user, here) stays fp32: inputs and labels
    assert real.blobs["data"].data_mem.storage is None
    assert real.blobs["label"].data_mem.storage is None
    l1 = emu.forward()["loss"].copy()
    l2 = real.forward()["loss"].copy()
    emu.backward()
    real.backward()
    tol = TOL[prec]
    assert abs(float(l1) - float(l2)) <= tol * abs(float(l1))
    for name in ("conv1", "conv2", "sig", "sum", "pool", "ip"):
        a, b = emu.blobs[name].data, real.blobs[name].data
        assert b.dtype == np.float32 and b.shape == a.shape, name      # pycaffe: fp32 NCHW
        assert P.representable(np, b, KIND[prec]), name
        assert np.abs(a - b).max() <= tol * np.abs(a).max() + 1e-6, name
    # (the plan's diffs share memory once read: those written last are still there)
    for name in ("conv1", "conv2"):
        a, b = emu.blobs[name].diff, real.blobs[name].diff
        assert P.representable(np, b, KIND[prec]), name
        assert np.abs(a - b).max() <= 2 * tol * np.abs(a).max() + 1e-9, name
    for name in emu.params:
        for a, b in zip(emu.params[name], real.params[name]):
            assert np.abs(a.diff - b.diff).max() <= 2 * tol * np.abs(a.diff).max() + 1e-9, name
    # a user's write to an input on the host reaches the 2-byte plan (converted)
    real.blobs["data"].data[...] = 0
    real.forward()
    assert np.unique(real.blobs["conv1"].data).tolist() == \
        [float(P.round_to(np, np.float32([0.1]), KIND[prec])[0])]
    plan.release()


def solver(precision, net=LENET, extra="", graphs=None):
    from minicaffe.core.protoio import parse_text
    from minicaffe.solvers import SGDSolver
    context.set_mode_gpu()
    sp = parse_text(SOLVER % (net, extra), caffe_pb2.SolverParameter())
    sp.solver_mode = caffe_pb2.SolverParameter.GPU
    return SGDSolver(sp, config=RunConfig(precision=precision, cuda_graphs=graphs))


def weights(s):
    return [b.data.copy() for b in s.net.learnable_params]


@pytest.mark.parametrize("graphs", [False, True])
def test_bf16_lenet_steps_track_fp32_and_the_emulation(graphs, tmp_path):
    ref = solver(None, graphs=graphs)
    ref.step(5)
    # the emulation: debug_info makes the eager executor (no memory plan, fp32 buffers)
    emu = solver("bf16", extra="debug_info: true", graphs=graphs)
    emu.step(5)
    low = solver("bf16", extra=f'snapshot_prefix: "{tmp_path}/s"', graphs=graphs)
    low.step(5)
    assert low.net.blobs["conv1"].data_mem.storage == "BFLOAT16"
    assert low.net.blobs["ip2"].diff_mem.storage is None            # the loss's: fp32
    # 2-byte storage is as close to fp32 as the emulation: within 5% of the largest value,
    # or (a bias summing many rounded terms that cancel) within three times the emulation's
    # own distance from fp32 (channels-last runs other cuDNN algorithms than the
    # emulation's NCHW ones: conv1's bias measured 2.03x the emulation's distance on the
    # H100, 0.000396 against 0.000195, largest 0.00654); and as close to the emulation
    # (3%, or three times that distance)
    for k, (a, b, c) in enumerate(zip(weights(ref), weights(emu), weights(low))):
        real, emulated = np.abs(a - c).max(), np.abs(a - b).max()
        print(f"param {k}: |bf16 - fp32| {real:.3g}, |emulation - fp32| {emulated:.3g}, "
              f"largest {np.abs(a).max():.3g}")
        assert real <= max(0.05 * np.abs(a).max(), 3 * emulated), k
        assert np.abs(b - c).max() <= max(0.03 * np.abs(b).max(), 3 * emulated), k
    # pycaffe after training: fp32 NCHW reads of bfloat16 values
    low.net.forward()
    d = low.net.blobs["pool2"].data
    assert d.dtype == np.float32 and d.shape == (64, 50, 4, 4)
    assert P.representable(np, d, "BFLOAT16") and np.abs(d).max() > 0
    # the snapshot is an fp32 caffemodel of the master weights
    low.snapshot()
    from minicaffe import Net
    context.set_mode_cpu()
    fp32 = Net(LENET, phase=caffe_pb2.TRAIN, weights=f"{tmp_path}/s_iter_5.caffemodel")
    for a, b in zip(weights(low), [b.data for b in fp32.learnable_params]):
        assert np.array_equal(a, b)


# ResNet's pieces: Convolution, BatchNorm+Scale (fused: cuDNN's batch norm on 2-byte
# buffers), ReLU, Eltwise SUM+ReLU (fused), MAX pooling, a native InnerProduct
BLOCK = """
name: "block"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 16 dim: 8 dim: 8 dim: 8 } shape { dim: 16 } } }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "msra" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "c1" }
layer { name: "s1" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "msra" } } }
layer { name: "bn2" type: "BatchNorm" bottom: "c2" top: "c2" }
layer { name: "s2" type: "Scale" bottom: "c2" top: "c2" scale_param { bias_term: true } }
layer { name: "sum" type: "Eltwise" bottom: "c2" bottom: "data" top: "sum" }
layer { name: "r2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
  inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "fc" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


# MAX pooling for the storage listing and the forward; AVE pooling for the gradients.
# Measured on the H100 (BLOCK as above, MAX): the real 2-byte path and the emulation round
# at other points (cuDNN's float16 batch norm rounds its fp32 result once, the emulation
# rounds the fp32 layer's), so a value may land one ulp apart; 1 of 2048 pooling windows
# then took another argmax, which moves one whole gradient element: s1's Scale gradient
# 4.2% of its largest from the emulation in fp16 (bf16: 0.8%, inside its wider bound).
# With AVE pooling every fp16 gradient is within 0.08% of the emulation's (s1: 0.056%).
# cuDNN's float16 batch norm itself, on the same rounded inputs as its float32 one, gave
# the same Scale gradient to 1e-7 (what the xfail this replaces suspected).
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_resnet_pieces_on_16_bit_storage_match_the_emulation(prec):
    from minicaffe.engine.precision import storage_lines
    emu, real, f32, plan = _pair(prec, BLOCK, fp32=True)
    lines = storage_lines(real)
    for name in ("c1 (Convolution)", "bn1 (BatchNorm)", "s1 (Scale)", "sum (Eltwise)",
                 "pool (Pooling)", "fc (InnerProduct)"):
        assert any(l.startswith(f"  {name}: native {KIND[prec]}") for l in lines), name
    l1, l2 = float(emu.forward()["loss"]), float(real.forward()["loss"])
    assert abs(l1 - l2) <= TOL[prec] * abs(l1)
    plan.release()
    emu, real, f32, plan = _pair(prec, BLOCK.replace("pool: MAX", "pool: AVE"), fp32=True)
    assert any(l.startswith(f"  pool (Pooling): native {KIND[prec]}")
               for l in storage_lines(real))
    l1 = float(emu.forward()["loss"])
    l2 = float(real.forward()["loss"])
    f32.forward()
    for n in (emu, real, f32):
        n.backward()
    tol = TOL[prec]
    assert abs(l1 - l2) <= tol * abs(l1)
    for name in ("c1", "c2", "sum", "pool", "fc", "ip"):
        a, b = emu.blobs[name].data, real.blobs[name].data
        assert P.representable(np, b, KIND[prec]), name
        assert np.abs(a - b).max() <= 2 * tol * np.abs(a).max() + 1e-6, name
    # batch norm's statistics and every gradient: within the tolerance of the emulation,
    # or (a gradient summing many rounded terms that cancel: Scale's) no farther from
    # the emulation than twice the emulation's own distance from fp32
    for name in emu.params:
        for k, (a, b, f) in enumerate(zip(emu.params[name], real.params[name],
                                          f32.params[name])):
            assert np.abs(a.data - b.data).max() <= 2 * tol * np.abs(a.data).max() + 1e-6, \
                (name, k)
            gap, emulated = np.abs(a.diff - b.diff).max(), np.abs(a.diff - f.diff).max()
            print(f"{prec} {name}[{k}] diff: |real - emulation| {gap:.3g}, |real - fp32| "
                  f"{np.abs(b.diff - f.diff).max():.3g}, |emulation - fp32| {emulated:.3g}, "
                  f"largest {np.abs(f.diff).max():.3g}")
            assert gap <= max(4 * tol * np.abs(a.diff).max(), 2 * emulated) + 1e-9, (name, k)
    plan.release()
