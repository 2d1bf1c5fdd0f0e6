"""The cuDNN convolution algorithm and workspace choice (gpu/cudnn.pick and
choose_workspace: pure functions of Find's results, so they run on the CPU), the data type
of a 2-byte storage type's descriptors (storage_dtype, also pure), and on the GPU the
workspace limit's effect."""
import os
import tempfile

import numpy as np
import pytest

from minicaffe.core import precision as P
from minicaffe.gpu import cudnn

GiB = 2 ** 30


def test_pick_takes_the_fastest_that_fits_else_the_smallest():
    found = [(7, 4 * GiB, 1.0), (5, GiB, 1.5), (1, 0, 3.0)]
    assert cudnn.pick(found, 8 * GiB) == (7, 4 * GiB, 1.0)
    assert cudnn.pick(found, 2 * GiB) == (5, GiB, 1.5)
    assert cudnn.pick(found, 0) == (1, 0, 3.0)
    assert cudnn.pick([(7, 4 * GiB, 1.0)], GiB) == (7, 4 * GiB, 1.0)


def test_a_two_byte_storage_type_names_its_cudnn_data_type():
    assert cudnn.storage_dtype(P.BFLOAT16) == "bfloat16"
    assert cudnn.storage_dtype(P.FLOAT16) == np.float16
    assert cudnn.data_type(cudnn.storage_dtype(P.BFLOAT16)) == cudnn.BFLOAT16
    assert cudnn.data_type(cudnn.storage_dtype(P.FLOAT16)) == cudnn.HALF
    for s in (P.FLOAT, None):
        with pytest.raises(ValueError, match="not a 2-byte storage type"):
            cudnn.storage_dtype(s)


def test_workspace_is_taken_only_where_each_gib_buys_its_price():
    # a call that is 40% faster with 2 GiB: worth it at 1% per GiB
    fast = [(5, 2 * GiB, 6.0), (1, 0, 10.0)]
    assert cudnn.choose_workspace([fast], 0.01) == 2 * GiB
    # 3% faster with 8 GiB: not worth 8%
    marginal = [(7, 8 * GiB, 9.7), (1, 0, 10.0)]
    assert cudnn.choose_workspace([marginal], 0.01) == 0
    assert cudnn.choose_workspace([marginal], 0.0) == 8 * GiB
    # the calls share one size: once one call needs 2 GiB, the others use it for free
    other = [(4, GiB, 2.0), (0, 0, 2.5)]
    assert cudnn.choose_workspace([fast, other], 0.01) == 2 * GiB
    assert cudnn.choose_workspace([], 0.01) == 0


@pytest.mark.gpu
def test_workspace_limit_caps_every_convolution(monkeypatch):
    from minicaffe import Net
    from minicaffe.core import context
    spec = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 32 dim: 64 dim: 56 dim: 56 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param { num_output: 64 kernel_size: 3 pad: 1
                                weight_filler { type: "gaussian" std: 0.01 } } }
    """
    with tempfile.NamedTemporaryFile("w", suffix=".prototxt", delete=False) as f:
        f.write(spec)
    context.set_mode_gpu()
    try:
        cudnn.clear_algorithm_cache()
        free = Net(f.name, phase=0)
        conv = free.layers[1]
        assert conv.uses_cudnn
        for k in ("fwd", "bwd_data", "bwd_filter"):
            assert getattr(conv, k) in conv.candidates[k]
        monkeypatch.setenv("MINICAFFE_CUDNN_WORKSPACE_LIMIT", "0")
        cudnn.clear_algorithm_cache()
        capped_net = Net(f.name, phase=0)
        capped = capped_net.layers[1]
        assert capped.workspace_bytes == 0
        assert all(a[1] == 0 for k in capped.candidates for a in capped.candidates[k])
        # and the capped net computes the same convolution
        x = np.random.RandomState(0).standard_normal((32, 64, 56, 56)).astype(np.float32)
        capped.blobs[0].data[...] = conv.blobs[0].data
        capped.blobs[1].data[...] = conv.blobs[1].data
        for n in (free, capped_net):
            n.blobs["data"].data[...] = x
            n.forward()
        np.testing.assert_allclose(capped_net.blobs["conv"].data, free.blobs["conv"].data,
                                   rtol=1e-4, atol=1e-4)
        monkeypatch.setenv("MINICAFFE_CUDNN_WORKSPACE_LIMIT", "nonsense")
        cudnn.clear_algorithm_cache()
        with pytest.raises(Exception, match="MINICAFFE_CUDNN_WORKSPACE_LIMIT"):
            Net(f.name, phase=0)
    finally:
        context.set_mode_cpu()
        os.unlink(f.name)


def test_find_limit_half_the_free_memory_less_for_offloading_nets(monkeypatch):
    from types import SimpleNamespace as NS
    from minicaffe.layers import cudnn_layers
    fake = NS(device_memory=lambda: (64 * GiB, 80 * GiB))   # backend's (free, total)
    monkeypatch.setattr(cudnn_layers, "backend", fake)
    monkeypatch.delenv("MINICAFFE_CUDNN_WORKSPACE_LIMIT", raising=False)
    assert cudnn_layers.find_limit() == 32 * GiB
    assert cudnn_layers.find_limit(offloading=True) == cudnn_layers.OFFLOAD_FIND_LIMIT < 32 * GiB
    monkeypatch.setenv("MINICAFFE_CUDNN_WORKSPACE_LIMIT", "1e9")
    assert cudnn_layers.find_limit(offloading=True) == 10 ** 9


@pytest.mark.parametrize("policy,expected", [("NONE", False), ("ALL", True)])
def test_nets_that_offload_set_up_their_layers_under_the_offload_find_limit(
        policy, expected):
    from minicaffe import Net
    with tempfile.NamedTemporaryFile("w", suffix=".prototxt", delete=False) as f:
        f.write('offload_param { policy: %s }\n'
                'layer { name: "d" type: "Input" top: "d" '
                'input_param { shape { dim: 1 dim: 2 } } }\n' % policy)
    try:
        net = Net(f.name, phase=0)
    finally:
        os.unlink(f.name)
    assert [layer.config.offloads for layer in net.layers] == [expected]


def test_the_registry_chooses_the_engine_once_with_one_line_when_cudnn_cannot(
        monkeypatch, caplog):
    """With cuDNN available (stood in for on the CPU), a layer whose parameters cuDNN
    cannot compute as Caffe does is built with Caffe's class at creation, saying why in
    one line; the others get the cuDNN class."""
    import logging
    from minicaffe.layers import registry
    from minicaffe.compat.testing import make_layer
    monkeypatch.setattr(registry, "cudnn_available", lambda: (True, ""))
    cases = [('name: "r0" type: "ReLU"', "CUDNN", None),
             ('name: "r1" type: "ReLU" relu_param { negative_slope: 0.1 }', "CAFFE",
              "negative_slope 0.1"),
             ('name: "p0" type: "Pooling" pooling_param { pool: MAX kernel_size: 2 }', "CUDNN",
              None),
             ('name: "p1" type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 2 }',
              "CAFFE", "STOCHASTIC pooling"),
             ('name: "n0" type: "LRN" lrn_param { local_size: 5 }', "CUDNN", None),
             ('name: "n1" type: "LRN" lrn_param { local_size: 17 }', "CAFFE",
              "local_size 17 outside 1-16"),
             ('name: "n2" type: "LRN" lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL }',
              "CAFFE", "WITHIN_CHANNEL"),
             ('name: "b0" type: "BatchNorm"', "CUDNN", None),
             ('name: "b1" type: "BatchNorm" batch_norm_param { eps: 0 }', "CAFFE", "eps 0 <= 0"),
             ('name: "s0" type: "Sigmoid"', "CUDNN", None)]
    for text, engine, why in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            layer = make_layer(text)
            make_layer(text)     # a second build of the same layer says nothing more
        assert layer.engine_name == engine, text
        lines = [r.getMessage() for r in caplog.records if "cuDNN cannot" in r.getMessage()]
        if why is None:
            assert lines == [], text
        else:
            name = text.split('"')[1]
            assert lines == [f"layer '{name}' ({layer.type}): cuDNN cannot compute it as Caffe "
                             f"does ({why}): using Caffe's engine"], (text, lines)
    # engine: CAFFE is Caffe's class without a word; without cuDNN, Caffe's too
    assert make_layer('type: "ReLU" relu_param { engine: CAFFE }').engine_name == "CAFFE"
    monkeypatch.setattr(registry, "cudnn_available", lambda: (False, "no GPU"))
    assert make_layer('name: "r9" type: "ReLU"').engine_name == "CAFFE"


def test_a_layer_whose_top_a_later_layer_rewrites_in_place_is_chosen_at_creation(
        monkeypatch, caplog):
    """The Net's wiring (``Net.top_rewritten``) goes to the registry: a cuDNN class whose
    backward reads its top (MAX pooling, LRN, the activations) is not built for a layer
    whose top a later layer rewrites in place; one line names the layer and the reason.
    An AVE pooling (cuDNN's backward does not read its top) keeps cuDNN, and an LRN in
    place takes Caffe's class by its names alone."""
    import logging
    from minicaffe import Net
    from minicaffe.layers import registry
    monkeypatch.setattr(registry, "cudnn_available", lambda: (True, ""))
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
    layer { name: "tmax" type: "Pooling" bottom: "data" top: "pmax" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
    layer { name: "dmax" type: "Dropout" bottom: "pmax" top: "pmax" }
    layer { name: "tave" type: "Pooling" bottom: "data" top: "pave" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
    layer { name: "dave" type: "Dropout" bottom: "pave" top: "pave" }
    layer { name: "sig" type: "Sigmoid" bottom: "pave" top: "sig" }
    layer { name: "dsig" type: "Dropout" bottom: "sig" top: "sig" }
    layer { name: "lrn" type: "LRN" bottom: "pmax" top: "pmax" lrn_param { local_size: 3 } }
    layer { name: "tanh" type: "TanH" bottom: "pmax" top: "tanh" }
    """
    with caplog.at_level(logging.INFO):
        net = Net(text, phase=1)
    engines = {n: net.layer_by_name(n).engine_name for n in ("tmax", "tave", "sig", "lrn",
                                                              "tanh")}
    assert engines == {"tmax": "CAFFE", "tave": "CUDNN", "sig": "CAFFE", "lrn": "CAFFE",
                       "tanh": "CUDNN"}
    lines = sorted(r.getMessage() for r in caplog.records if "cuDNN cannot" in r.getMessage())
    rewritten = "a later layer rewrites its top in place, and cuDNN's backward reads it"
    assert lines == [
        "layer 'lrn' (LRN): cuDNN cannot compute it as Caffe does (in place): using "
        "Caffe's engine",
        f"layer 'sig' (Sigmoid): cuDNN cannot compute it as Caffe does ({rewritten}): "
        "using Caffe's engine",
        f"layer 'tmax' (Pooling): cuDNN cannot compute it as Caffe does ({rewritten}): "
        "using Caffe's engine"]
    # the same numbers either way: the net runs (here on the CPU, Caffe's bodies)
    net.blobs["data"].data[...] = np.random.RandomState(0).randn(2, 3, 8, 8)
    net.forward()
    assert np.isfinite(net.blobs["tanh"].data).all()


@pytest.mark.parametrize("precision", ["bf16", "fp16", None])
def test_a_two_byte_max_pooling_whose_top_is_rewritten_keeps_the_cudnn_class(
        precision, monkeypatch, caplog):
    """In bf16 or fp16 a MAX pooling whose top a later layer rewrites in place (CIFAR-10
    quick's pool1 and its ReLU) is built with the cuDNN class, told so
    (``top_rewritten``): its own 2-byte kernels read no top (kernels/pool16.py), and it
    refuses cuDNN itself where those do not run.  In fp32 the registry builds Caffe's
    class, as before, with its line.  On the CPU both run Caffe's body: the same
    numbers."""
    import logging
    from minicaffe import Net
    from minicaffe.core.config import RunConfig
    from minicaffe.layers import registry
    monkeypatch.setattr(registry, "cudnn_available", lambda: (True, ""))
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } } }
    layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
    layer { name: "relu" type: "ReLU" bottom: "pool" top: "pool" }
    layer { name: "keep" type: "Pooling" bottom: "data" top: "keep" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
    """
    with caplog.at_level(logging.INFO):
        net = Net(text, phase=1, config=RunConfig(precision=precision))
    pool, keep = net.layer_by_name("pool"), net.layer_by_name("keep")
    assert (pool.top_rewritten, keep.top_rewritten) == (True, False)
    assert pool.engine_name == ("CAFFE" if precision is None else "CUDNN")
    assert keep.engine_name == "CUDNN"
    lines = [r.getMessage() for r in caplog.records if "cuDNN cannot" in r.getMessage()]
    assert len(lines) == (precision is None), lines
    x = np.random.RandomState(0).randn(2, 3, 9, 9).astype(np.float32)
    net.blobs["data"].data[...] = x
    net.forward()
    assert np.array_equal(net.blobs["pool"].data, np.maximum(net.blobs["keep"].data, 0))


@pytest.mark.gpu
def test_an_engine_a_shape_decides_is_chosen_once_with_one_line(caplog):
    """Pooling whose Caffe ceil-mode shape cuDNN cannot give takes Caffe's engine at its
    first reshape on the GPU, with one line naming the layer and the shape; a later shape
    cuDNN could take does not choose again.  A pooling that took cuDNN and is reshaped
    to such a shape takes Caffe's engine from then on, with one line; its numbers are
    Caffe's throughout."""
    import logging
    from minicaffe.core import context
    from minicaffe.core.blob import Blob
    from minicaffe.compat.testing import make_blob, make_layer
    context.set_mode_gpu()
    try:
        def pool(name, shape):
            layer = make_layer(f'name: "{name}" type: "Pooling" pooling_param {{ pool: MAX '
                               f'kernel_size: 3 stride: 2 engine: CUDNN }}')
            x, top = make_blob(shape, dtype=np.float32), Blob(dtype=np.float32)
            layer.setup([x], [top])
            return layer, x, top

        with caplog.at_level(logging.INFO):
            a, x, top = pool("clipped", (2, 3, 32, 32))    # Caffe 16x16, cuDNN 15x15
            assert not a.uses_cudnn
            x.reshape((2, 3, 31, 31))                       # 15x15 for both
            a.forward([x], [top])
            assert not a.uses_cudnn and top.shape == (2, 3, 15, 15)
            b, y, ytop = pool("later", (2, 3, 31, 31))
            assert b.uses_cudnn
            y.reshape((2, 3, 32, 32))
            b.forward([y], [ytop])
            assert not b.uses_cudnn and ytop.shape == (2, 3, 16, 16)
            y.reshape((2, 3, 31, 31))
            b.forward([y], [ytop])
            assert not b.uses_cudnn
        lines = [r.getMessage() for r in caplog.records if "cuDNN cannot" in r.getMessage()]
        assert len(lines) == 2, lines
        assert lines[0].startswith("layer 'clipped' (Pooling): cuDNN cannot compute it as "
                                   "Caffe does (input (2, 3, 32, 32): Caffe's output "
                                   "(2, 3, 16, 16), cuDNN's ")
        assert lines[0].endswith("): using Caffe's engine")
        assert lines[1].startswith("layer 'later' (Pooling): ")
        assert lines[1].endswith("): using Caffe's engine from now on")
    finally:
        context.set_mode_cpu()
