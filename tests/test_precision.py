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
    # each layer carries its resolved types in its own LayerParameter (NVIDIA Caffe's way)
    assert net.layer_dict["conv"].types.forward_type == kind
    assert net.layer_dict["loss"].types.forward_type == "FLOAT"
    assert Net(net_param(), config=RunConfig()).layer_dict["conv"].types is None
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


# -- the solver: loss scaling, skipped steps, fp32 snapshots, exact resume ----------------------
SOLVER = """
net_param { %s }
base_lr: 0.1 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed" max_iter: 100
display: 0 snapshot_after_train: false random_seed: 1701 solver_mode: CPU
"""


def solver_of(net_text=NET, precision=None, extra=""):
    from minicaffe.solvers import SGDSolver
    from minicaffe.core.protoio import parse_text
    sp = parse_text(SOLVER % net_text + extra, caffe_pb2.SolverParameter())
    return SGDSolver(sp, config=RunConfig(precision=precision))


def test_bf16_needs_no_scaling_and_fp16_scales_dynamically():
    assert solver_of(precision="bf16").loss_scaler is None
    s = solver_of(precision="fp16")
    assert s.loss_scaler.dynamic and s.loss_scaler.scale == 2.0 ** 16
    s.step(3)
    assert s.loss_scaler.skipped == 0 and np.isfinite(s.net.params["ip"][0].data).all()
    s2 = solver_of(NET + "global_grad_scale: 4", precision="bf16")
    assert not s2.loss_scaler.dynamic and s2.loss_scaler.scale == 4.0


def test_loss_scale_multiplies_the_gradient_and_the_update_divides_it_back():
    """Through FLOAT16 diffs, a loss weighted 1e-6: with a scale of 1 the gradients fall
    into fp16's subnormals and lose their digits; with 2^16 they keep them; after the
    unscale both are in fp32 units, the loss weight is put back."""
    grads = {}
    for prec, scale in ((None, 1.0), ("fp16", 1.0), ("fp16", 65536.0)):
        s = solver_of(NET + "global_grad_scale: %g" % scale, precision=prec)
        s.net.blob_by_name("loss").diff[...] = 1e-6
        s.net.clear_param_diffs()
        s.net.forward()
        s.net.backward()
        assert float(s.net.blob_by_name("loss").diff) == pytest.approx(1e-6)
        assert s.loss_scaler is None or s.loss_scaler.unscale()
        grads[prec, scale] = s.net.params["conv"][0].diff.copy()
    ref = grads[None, 1.0]

    def err(g):
        return np.abs(g - ref).max() / np.abs(ref).max()
    assert err(grads["fp16", 65536.0]) < 1e-2
    assert err(grads["fp16", 1.0]) > 5e-2


def test_overflowing_step_is_skipped_counted_and_the_scale_backs_off():
    s = solver_of(precision="fp16")
    w0 = [b.data.copy() for b in s.net.learnable_params]
    s.loss_scaler.scale = 2.0 ** 40          # the diffs overflow fp16
    s.step(1)
    assert s.loss_scaler.skipped == 1 and s.loss_scaler.scale == 2.0 ** 39
    assert all(np.array_equal(a, b.data) for a, b in zip(w0, s.net.learnable_params))
    assert s.iter == 1
    s.loss_scaler.scale = 2.0 ** 10
    s.step(1)
    assert s.loss_scaler.skipped == 1
    assert not all(np.array_equal(a, b.data) for a, b in zip(w0, s.net.learnable_params))


def test_fp16_snapshot_is_fp32_caffemodel_and_resume_is_exact(tmp_path):
    prefix = str(tmp_path / "p")
    s = solver_of(precision="fp16", extra=f'snapshot_prefix: "{prefix}"')
    s.step(2)
    s.loss_scaler.scale = 2.0 ** 40          # one overflow: the scale's state must travel
    s.step(1)
    s.snapshot()
    s.step(3)
    want = [b.data.copy() for b in s.net.learnable_params]
    with open(prefix + "_iter_3.caffemodel", "rb") as f:
        weights = caffe_pb2.NetParameter.FromString(f.read())
    conv = [l for l in weights.layer if l.name == "conv"][0]
    assert len(conv.blobs[0].data) == 3 * 2 * 3 * 3 and not len(conv.blobs[0].double_data)
    r = solver_of(precision="fp16", extra=f'snapshot_prefix: "{prefix}"')
    r.restore(prefix + "_iter_3.solverstate")
    assert r.loss_scaler.state() == (2.0 ** 39, 0, 1)
    r.step(3)
    for a, b in zip(want, r.net.learnable_params):
        assert np.array_equal(a, b.data)


def test_solver_field_and_cli_flag(cli, tmp_path):
    s = solver_of(precision=None, extra='minicaffe_precision: "BF16"')
    assert s.config.precision == "bf16" and s.net.types.reduced
    assert s.test_nets == [] or s.test_nets[0].types.reduced
    with pytest.raises(ConfigError, match="minicaffe_precision"):
        solver_of(extra='minicaffe_precision: "FP8"')
    with pytest.raises(ConfigError, match="solver_data_type DOUBLE"):
        solver_of(extra="solver_data_type: DOUBLE")
    (tmp_path / "solver.prototxt").write_text(SOLVER % NET.replace("\n", " ") +
                                              "max_iter: 2 display: 1")
    rc, out, err = cli("train", "--solver", tmp_path / "solver.prototxt", "--precision", "fp16")
    assert rc == 0, err
    assert "Precision: storage types" in err and "loss scale 65536 (dynamic)" in err
    rc, out, err = cli("train", "--solver", tmp_path / "solver.prototxt", "--precision", "bf16",
                       "--tf32")
    assert rc == 0, err
    assert "GPU math: fp32 with TF32" in err and "precision bf16" in err
    rc, out, err = cli("train", "--solver", tmp_path / "solver.prototxt", "--precision", "fp8")
    assert rc == 1 and err.strip().splitlines()[-1].endswith(
        "--precision 'fp8': expected fp32, tf32, bf16 or fp16")
    assert "Traceback" not in err


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_bvlc_lenet_scores_within_a_tenth_of_a_percent_of_fp32(prec, fixtures_dir, mnist_dir):
    """BVLC's trained LeNet on the first 2,000 MNIST test images: the reduced storage
    loses at most 0.1% of the fp32 accuracy (2 images)."""
    import os
    from minicaffe.data.datasets import load_mnist
    from minicaffe.network.net import TEST
    data = load_mnist(mnist_dir)
    images, labels = data["test_images"], data["test_labels"]
    x = np.asarray(images[:2000], np.float32).reshape(-1, 1, 28, 28) * np.float32(0.00390625)
    y = np.asarray(labels[:2000])
    deploy = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "models", "lenet", "deploy.prototxt")
    acc = {}
    for p in (None, prec):
        net = Net(deploy, TEST, weights=str(fixtures_dir / "lenet_v2_iter_10000.caffemodel"),
                  config=RunConfig(precision=p))
        net.blobs["data"].reshape(*x.shape)
        net.reshape()
        net.blobs["data"].data[...] = x
        out = net.forward()["prob"]
        acc[p] = float((out.argmax(1) == y).mean())
    assert acc[None] > 0.98
    assert abs(acc[prec] - acc[None]) <= 0.001


def test_memory_prints_the_types_and_the_casts(cli, tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    rc, out, err = cli("memory", "--model", tmp_path / "net.prototxt", "--precision", "bf16",
                       "--schedule")
    assert rc == 0, err
    assert "precision bf16: storage types BFLOAT16, FLOAT" in out
    assert "conv (Convolution): forward BFLOAT16 (math FLOAT)" in out
    lines = out.splitlines()
    casts = [l.split(None, 3)[3] for l in lines if " cast " in l]   # "NAME (what)"
    # rounded: what conv and ip compute, the gradients pool's and ip's backward write;
    # not: ReLU's and MAX pooling's outputs, ReLU's gradient (values they read)
    assert "conv (data to BFLOAT16)" in casts and "ip (data to BFLOAT16)" in casts
    assert "pool (data to BFLOAT16)" not in casts
    assert "pool (diff to BFLOAT16)" in casts and "conv (diff to BFLOAT16)" in casts
    assert casts.count("conv (diff to BFLOAT16)") == 1        # pool's backward, not ReLU's


def test_an_nvidia_caffe_fp16_net_trains_unchanged():
    """NVIDIA Caffe's mixed-precision fields, no switch: FLOAT16 storage with FLOAT16
    math, dynamic loss scaling, fp32 master weights that learn."""
    text = ("default_forward_type: FLOAT16 default_backward_type: FLOAT16 "
            "default_forward_math: FLOAT default_backward_math: FLOAT " + NET)
    s = solver_of(text, extra="solver_data_type: FLOAT16")
    assert s.config.precision is None and s.net.types.data["conv"] == "FLOAT16"
    assert s.loss_scaler is not None and s.loss_scaler.dynamic
    w0 = s.net.params["ip"][0].data.copy()
    s.step(3)
    assert not np.array_equal(w0, s.net.params["ip"][0].data)
    assert s.net.params["ip"][0].data.dtype == np.float32


# -- loss scaling on the device (the GPU step's code, numpy standing in for cupy) ----------------
def _device_style_step(s, dev):
    """One iteration as engine/step.GpuStep runs it with loss scaling: forward, backward
    (the loss gradient times the device's scale), the flat diffs unscaled and checked into
    the device flag, the update where the flag is clear (the fused kernel's test), the
    scale's rule -- no host read of the scale on the way."""
    s.net.clear_param_diffs()
    with np.errstate(over="ignore", invalid="ignore"):   # as Solver.step, for the overflow
        s.net.forward()
        s.net.backward()
        dev.unscale(s.net.flat_params().diff.mutable_cpu_data())
    if not dev.found[0]:                   # what the update kernel reads on the GPU
        s.apply_update()
    dev.update_state()
    s.iter += 1


@pytest.mark.parametrize("extra", ["", "global_grad_scale: 1000"])
def test_device_loss_scale_follows_the_eager_scaler_step_for_step(extra):
    """The GPU step's loss scaling (engine/precision.DeviceLossScale, run here on numpy
    arrays) against the eager path's LossScaler: the same weights bit for bit, the same
    skipped steps, the same scale -- through an injected overflow and a growth.  (Each
    solver seeds the generators when built: one is built and run, then the other.)"""
    fixed = bool(extra)

    def scenario(device):
        s = solver_of(NET + extra, precision="fp16")
        dev = s.loss_scaler.to_device(np) if device else None
        seen = []

        def run(n):
            if device:
                for _ in range(n):
                    _device_style_step(s, dev)
            else:
                s.step(n)
            seen.append(([b.data.copy() for b in s.net.learnable_params],
                         s.loss_scaler.state()))

        run(2)
        if device:
            assert dev.read() == s.loss_scaler.state()    # the state lives in the arrays
        s.loss_scaler.scale = 2.0 ** 40                   # the fp16 diffs overflow
        run(1)
        if not fixed:
            s.loss_scaler.scale = 2.0 ** 10
            s.loss_scaler.good = 1999                     # one clean step short of growing
            run(2)
        return seen, s.loss_scaler.describe()

    eager, eager_line = scenario(False)
    device, device_line = scenario(True)
    for (we, se), (wd, sd) in zip(eager, device):
        assert se == sd
        assert all(np.array_equal(a, b) for a, b in zip(we, wd))
    assert device_line == eager_line
    assert all(np.array_equal(a, b) for a, b in zip(device[0][0], device[1][0]))  # skipped
    if fixed:
        assert device[1][1] == (2.0 ** 40, 0, 0)  # fixed: the scale never moves, no count
        # (a step with non-finite gradients is still not applied)
    else:
        assert device[1][1] == (2.0 ** 39, 0, 1)
        assert device[2][1] == (2.0 ** 11, 1, 1)
        assert "loss scale 2048 (dynamic), 1 steps skipped" in device_line
