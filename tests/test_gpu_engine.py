"""The GPU engine: cuBLAS and cuDNN bindings, cuDNN layers against Caffe's engine, the
fused update, the GPU step eager and replayed as CUDA graphs, the allocators.

All marked gpu: they skip without CuPy and a device (the CPU suite never imports CuPy).
"""
import numpy as np
import pytest

from minicaffe.core import backend, context
from minicaffe.core.blob import Blob
from minicaffe.core.errors import LayerError
from minicaffe.proto import caffe_pb2
from minicaffe.compat.testing import make_blob, make_layer

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu():
    context.set_mode_gpu()
    yield backend.cp
    context.set_mode_cpu()


@pytest.fixture
def deterministic():
    from minicaffe.gpu import options
    old = options.deterministic
    options.set_deterministic(True)
    yield
    options.set_deterministic(old)


# -- cuBLAS ------------------------------------------------------------------------------
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_cublas_matmul_matches_numpy(gpu, ta, tb):
    from minicaffe.gpu import cublas
    cp = gpu
    rs = np.random.RandomState(0)
    M, N, K = 37, 29, 53
    a = rs.randn(*((K, M) if ta else (M, K))).astype(np.float32)
    b = rs.randn(*((N, K) if tb else (K, N))).astype(np.float32)
    c0 = rs.randn(M, N).astype(np.float32)
    out = cp.asarray(c0)
    cublas.matmul(cp.asarray(a), cp.asarray(b), out, trans_a=ta, trans_b=tb, alpha=0.5, beta=2.0)
    ref = 0.5 * (a.T if ta else a) @ (b.T if tb else b) + 2.0 * c0
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-5, atol=1e-4)


def test_cublas_batched_and_shared_operand(gpu):
    from minicaffe.gpu import cublas
    cp = gpu
    rs = np.random.RandomState(1)
    w = rs.randn(3, 4, 6).astype(np.float32)
    x = rs.randn(3, 6, 5).astype(np.float32)
    out = cp.empty((3, 4, 5), np.float32)
    cublas.matmul_batched(cp.asarray(w), cp.asarray(x), out)
    np.testing.assert_allclose(cp.asnumpy(out), w @ x, rtol=1e-5, atol=1e-5)
    shared = rs.randn(4, 6).astype(np.float32)
    cublas.matmul_batched(cp.asarray(shared), cp.asarray(x), out)
    np.testing.assert_allclose(cp.asnumpy(out), shared @ x, rtol=1e-5, atol=1e-5)


def test_cublas_gemm_captures_in_a_cuda_graph(gpu):
    from minicaffe.gpu import cublas
    cp = gpu
    rs = np.random.RandomState(2)
    # a stream kept for the process: the arrays allocated on it may be freed after this test
    # (blobs in reference cycles wait for the garbage collector), on the stream they came from
    s = context.kept_stream("test_capture")
    with s:
        a = cp.asarray(rs.randn(64, 32).astype(np.float32))
        b = cp.asarray(rs.randn(32, 16).astype(np.float32))
        out = cp.zeros((64, 16), np.float32)
        cublas.matmul(a, b, out)          # warm-up: the handle and its workspace
        s.begin_capture()
        cublas.matmul(a, b, out)
        g = s.end_capture()
        a2 = rs.randn(64, 32).astype(np.float32)
        a[...] = cp.asarray(a2)
        out.fill(0)
        g.launch(s)
    s.synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), a2 @ cp.asnumpy(b), rtol=1e-5, atol=1e-5)


# -- cuDNN against Caffe's engine ------------------------------------------------------------
def test_cudnn_loads(gpu):
    from minicaffe.gpu import cudnn
    ok, why = cudnn.available()
    assert ok, why
    assert cudnn.version() >= 8000
    print(cudnn.describe())


def _engine(text, engine):
    field = {"Convolution": "convolution_param", "Pooling": "pooling_param",
             "LRN": "lrn_param", "ReLU": "relu_param", "Sigmoid": "sigmoid_param",
             "TanH": "tanh_param", "Softmax": "softmax_param"}
    for t, f in field.items():
        if f'type: "{t}"' in text:
            if f in text:
                return text.replace(f + " {", f + " { engine: " + engine, 1)
            return text + f" {f} {{ engine: {engine} }}"
    return text  # BatchNorm: DEFAULT


def _run(layer, x, dy_seed, in_place=False):
    xb = make_blob(x.shape, dtype=np.float32, values=x)
    top = xb if in_place else Blob(dtype=np.float32)
    layer.setup([xb], [top])
    layer.forward([xb], [top])
    y = top.data.copy()
    top.diff[...] = np.random.RandomState(dy_seed).randn(*top.shape)
    layer.backward([top], [True], [xb])
    return [y, xb.diff.copy()] + [b.diff.copy() for b in layer.blobs] + \
        [b.data.copy() for b in layer.blobs]


CUDNN_CASES = [
    ('type: "Convolution" convolution_param { num_output: 16 kernel_size: 3 pad: 1 '
     'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } }',
     (8, 12, 17, 15)),
    ('type: "Convolution" convolution_param { num_output: 16 kernel_size: 5 stride: 2 group: 4 '
     'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } }',
     (4, 12, 21, 19)),
    ('type: "Convolution" convolution_param { num_output: 8 kernel_size: 3 dilation: 2 pad: 2 '
     'bias_term: false weight_filler { type: "gaussian" std: 0.1 } }', (2, 6, 13, 13)),
    ('type: "Convolution" convolution_param { num_output: 32 kernel_size: 1 '
     'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } }',
     (4, 16, 9, 9)),
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 '
     'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } }',
     (2, 3, 6, 7, 5)),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }', (4, 6, 16, 12)),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', (4, 6, 15, 13)),
    ('type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 1 pad: 1 }', (4, 6, 9, 9)),
    ('type: "Pooling" pooling_param { pool: AVE global_pooling: true }', (4, 6, 7, 7)),
    ('type: "LRN" lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }', (4, 16, 9, 9)),
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 }', (2, 7, 5, 5)),
    ('type: "ReLU"', (4, 8, 5, 5)),
    ('type: "Sigmoid"', (4, 8, 5, 5)),
    ('type: "TanH"', (4, 8, 5, 5)),
    ('type: "Softmax"', (6, 10, 3, 2)),
    ('type: "BatchNorm"', (8, 6, 5, 5)),
    ('type: "BatchNorm" batch_norm_param { use_global_stats: true }', (8, 6, 5, 5)),
]


@pytest.mark.parametrize("text,shape", CUDNN_CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_cudnn_layer_matches_caffe_engine(gpu, text, shape, in_place):
    if in_place and not any(t in text for t in ("ReLU", "Sigmoid", "TanH", "BatchNorm")):
        pytest.skip("not an in-place layer")
    from minicaffe.gpu import options
    from minicaffe.layers import registry
    x = np.random.RandomState(0).uniform(-1, 1, shape).astype(np.float32)
    outs = {}
    for engine in ("CUDNN", "CAFFE"):
        context.set_random_seed(1701)
        if "BatchNorm" in text:
            old = options.cudnn
            options.set_cudnn(engine == "CUDNN")
            try:
                layer = make_layer(text)
            finally:
                options.set_cudnn(old)
            if "global" in text:  # statistics to normalise with
                layer_stats = [np.random.RandomState(5).uniform(0, 1, shape[1]),
                               np.random.RandomState(6).uniform(1, 2, shape[1]), [2.0]]
        else:
            layer = make_layer(_engine(text, engine))
        want = "CuDNN" if engine == "CUDNN" else ""
        assert type(layer).__name__.startswith(want), type(layer).__name__
        if "BatchNorm" in text and "global" in text:
            xb = make_blob(x.shape, dtype=np.float32, values=x)
            top = xb if in_place else Blob(dtype=np.float32)
            layer.setup([xb], [top])
            for b, v in zip(layer.blobs, layer_stats):
                b.data[...] = v
            layer.forward([xb], [top])
            y = top.data.copy()
            top.diff[...] = np.random.RandomState(3).randn(*top.shape)
            layer.backward([top], [True], [xb])
            outs[engine] = [y, xb.diff.copy()]
        else:
            outs[engine] = _run(layer, x, 3, in_place)
        if engine == "CUDNN" and registry.engine_name(layer.layer_param) != "CAFFE":
            assert layer.uses_cudnn, "the cuDNN path was not taken"
    for a, b in zip(outs["CUDNN"], outs["CAFFE"]):
        scale = max(np.abs(b).max(), 1e-6)
        assert np.abs(a - b).max() <= 2e-4 * scale + 1e-6, (np.abs(a - b).max(), scale)


def test_cudnn_pooling_falls_back_where_caffe_ceil_shape_differs(gpu):
    layer = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 '
                       'engine: CUDNN }')
    x = make_blob((2, 3, 32, 32), dtype=np.float32)
    top = Blob(dtype=np.float32)
    layer.setup([x], [top])
    assert top.shape == (2, 3, 16, 16)       # Caffe's ceil: cuDNN would give 15
    assert not layer.uses_cudnn
    layer.forward([x], [top])


def test_a_thread_workspace_outlives_the_stream_it_grew_on(gpu):
    """cuDNN's workspace and scratch and cuBLAS's workspace are cached for the thread; one
    grown while a user's stream was current is freed, when it grows again after that stream
    is gone, without a stream-ordered free on the dead stream (which pytest would report as
    an unraisable ``freeAsync: cudaErrorInvalidValue``)."""
    import gc
    from minicaffe.gpu import cublas
    from minicaffe.layers import cudnn_layers
    cp = gpu
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        small = cudnn_layers.workspace(1 << 10)
        cudnn_layers.scratch("test", 1 << 10)
        cublas.handle()
        small.fill(1)
    s.synchronize()
    del s, small
    gc.collect()
    big = cudnn_layers.workspace(1 << 22)          # the small one is freed here
    cudnn_layers.scratch("test", 1 << 22)
    big.fill(2)
    cp.cuda.Device().synchronize()
    gc.collect()
    assert int(big[-1]) == 2


def test_cudnn_convolution_captures(gpu):
    cp = gpu
    layer = make_layer(_engine(CUDNN_CASES[0][0], "CUDNN"))
    x = make_blob((8, 12, 17, 15), dtype=np.float32)
    top = Blob(dtype=np.float32)
    layer.setup([x], [top])
    s = context.kept_stream("test_capture")   # (see test_cublas_gemm_captures_in_a_cuda_graph)
    with s:
        layer.forward_gpu([x], [top])
        ref = cp.asnumpy(top.gpu_data())
        top.mutable_gpu_data().fill(0)
        s.begin_capture()
        layer.forward_gpu([x], [top])
        g = s.end_capture()
        g.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(top.gpu_data()), ref)


def test_convolution_applies_the_following_relu_itself(gpu):
    from minicaffe import Net
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 9 dim: 9 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
      convolution_param { num_output: 6 kernel_size: 3 engine: ENGINE
        weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } } }
    layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
    layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
      inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
    """
    x = np.random.RandomState(0).randn(4, 3, 9, 9).astype(np.float32)
    outs = {}
    for engine in ("CUDNN", "CAFFE"):
        context.set_random_seed(3)
        net = Net(text.replace("ENGINE", engine), phase=caffe_pb2.TRAIN)
        net.blobs["data"].data[...] = x
        if engine == "CUDNN":
            assert [(f.type, f.names) for f in net.fusions] == \
                [("Convolution+ReLU", ("conv", "relu"))]
        ip = net.forward()["ip"].copy()
        conv = net.blobs["conv"].data.copy()
        net.forward(end="conv")            # a pass that stops before the ReLU: no fusion
        outs[engine] = [ip, conv, net.blobs["conv"].data.copy()]
    for a, b in zip(outs["CUDNN"], outs["CAFFE"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert (outs["CUDNN"][2] < 0).any() and not (outs["CUDNN"][1] < 0).any()


def test_batchnorm_applies_the_following_scale_itself(gpu):
    from minicaffe import Net
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 4 dim: 5 dim: 5 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
      convolution_param { num_output: 6 kernel_size: 3 bias_term: false
        weight_filler { type: "gaussian" std: 0.5 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
    layer { name: "scale" type: "Scale" bottom: "conv" top: "conv"
      scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 }
                    bias_filler { type: "uniform" min: -0.5 max: 0.5 } } }
    layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
    layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
      inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
    """
    from minicaffe.gpu import options
    x = np.random.RandomState(0).randn(8, 4, 5, 5).astype(np.float32)
    outs = {}
    for use in (True, False):
        old = options.cudnn
        options.set_cudnn(use)
        try:
            context.set_random_seed(3)
            net = Net(text, phase=caffe_pb2.TRAIN)
        finally:
            options.set_cudnn(old)
        assert [(f.type, f.names) for f in net.fusions] == \
            ([("BatchNorm+Scale+ReLU", ("bn", "scale", "relu"))] if use else [])
        assert net.layers[-4].type == "BatchNorm"
        # the BatchNorm reads the convolution's output from a blob of its own, whatever
        # the engine (the blob names are the same on every device)
        assert "bn_input" in net.blobs
        net.blobs["data"].data[...] = x
        net.forward()
        net.blobs["ip"].diff[...] = np.random.RandomState(1).randn(8, 3)
        net.backward()
        outs[use] = [net.blobs["ip"].data.copy(), net.blobs["data"].diff.copy()] + \
            [b.diff.copy() for b in net.learnable_params] + \
            [b.data.copy() for b in net.layers[2].blobs]
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_eltwise_sum_applies_the_following_relu_itself(gpu):
    """y = relu(a + b) in one pass and the masked gradient copied to both bottoms,
    against the CPU (which never fuses)."""
    from minicaffe import Net
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } } }
    layer { name: "a" type: "Convolution" bottom: "data" top: "a"
      convolution_param { num_output: 5 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
    layer { name: "b" type: "Convolution" bottom: "data" top: "b"
      convolution_param { num_output: 5 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
    layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "sum" }
    layer { name: "relu" type: "ReLU" bottom: "sum" top: "sum" }
    layer { name: "ip" type: "InnerProduct" bottom: "sum" top: "ip"
      inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
    """
    x = np.random.RandomState(0).randn(4, 3, 6, 6).astype(np.float32)
    dy = np.random.RandomState(1).randn(4, 3).astype(np.float32)
    outs = {}
    for mode in ("gpu", "cpu"):
        (context.set_mode_gpu if mode == "gpu" else context.set_mode_cpu)()
        context.set_random_seed(3)
        net = Net(text, phase=caffe_pb2.TRAIN)
        if mode == "gpu":
            assert [(f.type, f.names) for f in net.fusions] == [("Eltwise+ReLU", ("sum", "relu"))]
        net.blobs["data"].data[...] = x
        net.forward()
        net.blobs["ip"].diff[...] = dy
        net.backward()
        outs[mode] = [net.blobs["ip"].data.copy(), net.blobs["sum"].data.copy(),
                      net.blobs["a"].diff.copy(), net.blobs["b"].diff.copy()] + \
            [b.diff.copy() for b in net.learnable_params]
    context.set_mode_gpu()
    for a, b in zip(outs["gpu"], outs["cpu"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# -- dropout's counter-based generator ------------------------------------------------------
def test_philox_dropout_masks(gpu):
    cp = gpu
    layer = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.3 }',
                       phase=caffe_pb2.TRAIN)
    x = make_blob((64, 1000), dtype=np.float32, values=np.ones((64, 1000)))
    top = Blob(dtype=np.float32)
    layer.setup([x], [top])
    layer.forward([x], [top])
    y1 = top.data.copy()
    kept = (y1 != 0).mean()
    assert abs(kept - 0.7) < 0.01
    np.testing.assert_allclose(y1[y1 != 0], 1 / 0.7, rtol=1e-6)
    top.diff[...] = 1
    layer.backward([top], [True], [x])
    np.testing.assert_array_equal(x.diff, y1)       # backward redraws forward's mask
    layer.forward([x], [top])
    assert (top.data != y1).any()                   # a new mask each pass
    from minicaffe.kernels.dropout import philox_bits
    bits = cp.asnumpy(philox_bits(cp, 1 << 20, 12345, 7)).astype(np.float64) / 2 ** 32
    assert abs(bits.mean() - 0.5) < 2e-3 and abs(bits.var() - 1 / 12) < 2e-3


# -- solvers: fused update, GPU step, graphs ---------------------------------------------------
NET = """
name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 16 dim: 3 dim: 12 dim: 12 } shape { dim: 16 }
                     data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 3 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  convolution_param { num_output: 8 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 3 } }
layer { name: "ip1" type: "InnerProduct" bottom: "norm1" top: "ip1"
  inner_product_param { num_output: 20 weight_filler { type: "xavier" } } }
layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.4 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def _solver(typ="SGD", graphs=True, **fields):
    from minicaffe.solvers import get_solver
    p = caffe_pb2.SolverParameter()
    from google.protobuf import text_format
    text_format.Merge(NET, p.net_param)
    p.type = typ
    p.base_lr = 0.01
    p.lr_policy = "inv"
    p.gamma = 0.0001
    p.power = 0.75
    p.momentum = 0.9 if typ not in ("AdaGrad", "RMSProp") else 0.0
    if typ == "Adam":
        p.momentum2 = 0.999
    p.weight_decay = 0.0005
    p.display = 0
    p.random_seed = 1701
    p.solver_mode = caffe_pb2.SolverParameter.GPU
    p.cuda_graph = graphs
    for k, v in fields.items():
        setattr(p, k, v)
    context.set_random_seed(1701)
    return get_solver(p)


def _weights(s):
    return [b.data.copy() for b in s.net.learnable_params]


SOLVERS = ["SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam"]


@pytest.mark.parametrize("typ", SOLVERS)
def test_fused_update_matches_the_per_parameter_update(gpu, deterministic, typ, monkeypatch):
    from minicaffe.solvers.solver import Solver
    s = _solver(typ, graphs=False)
    assert s.uses_gpu_step
    s.step(6)
    fused = _weights(s)
    monkeypatch.setattr(Solver, "uses_gpu_step", property(lambda self: False))
    r = _solver(typ, graphs=False)
    r.step(6)
    for a, b in zip(fused, _weights(r)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("typ,fields", [
    ("SGD", {}),
    ("SGD", {"clip_gradients": 0.05}),
    ("SGD", {"iter_size": 2}),
    ("Adam", {}),
    ("Nesterov", {"regularization_type": "L1"}),
])
def test_graph_replay_gives_the_same_weights_as_eager(gpu, deterministic, typ, fields):
    eager = _solver(typ, graphs=False, **fields)
    eager.step(12)
    graph = _solver(typ, graphs=True, **fields)
    graph.step(12)
    st = graph.gpu_step
    assert st.graphs_on and st.graphs, "nothing was captured"
    for a, b in zip(_weights(eager), _weights(graph)):
        np.testing.assert_array_equal(a, b)
    assert eager.smoothed_loss == graph.smoothed_loss


def test_host_reads_after_replays_see_the_newest_values(gpu):
    cp = gpu
    s = _solver(graphs=True)
    s.step(3)
    blob = s.net.blobs["ip2"]
    first = blob.data.copy()            # host copy made: the memory is SYNCED
    s.step(3)
    now = blob.data
    np.testing.assert_array_equal(now, cp.asnumpy(blob.gpu_data()))
    assert (now != first).any()


def test_host_writes_between_steps_reach_the_replay(gpu):
    s = _solver(graphs=True, momentum=0.0)
    s.step(3)
    s.param.base_lr = 0.0
    w = s.net.params["ip2"][0]
    w.data[...] = 0.25
    s.step(2)
    np.testing.assert_array_equal(w.data, np.full(w.shape, 0.25, np.float32) *
                                  (1 - 0.0))  # lr 0, no momentum: unchanged


def test_bad_label_is_reported_after_the_step(gpu):
    s = _solver(graphs=True)
    s.net.layer_by_name("data").fillers[1].value = 9   # 5 classes
    s.net.layer_by_name("data").refill[1] = True
    with pytest.raises(LayerError, match="label 9 is out of range"):
        s.step(4)


def test_the_run_config_overrides_the_solvers_cuda_graph(gpu):
    """RunConfig.cuda_graphs (None: the solver's cuda_graph field) decides the capture."""
    from minicaffe.core.config import RunConfig
    from minicaffe.solvers import get_solver
    keep = _solver(graphs=True)
    off = get_solver(keep.param, config=RunConfig.from_environment(cuda_graphs=False))
    on = get_solver(_solver(graphs=False).param, config=RunConfig.from_environment(
        cuda_graphs=True))
    for s in (keep, off, on):
        s.step(3)
    assert keep.gpu_step.graphs_on and keep.gpu_step.graphs
    assert not off.gpu_step.graphs_on and not off.gpu_step.graphs
    assert on.gpu_step.graphs_on and on.gpu_step.graphs


def test_a_layer_that_cannot_be_captured_turns_graphs_off(gpu, deterministic):
    """Accuracy reads its count back to the host: the iteration runs eagerly, with the
    same results as an eager run."""
    global NET
    saved = NET
    NET = NET + ('layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" '
                 'top: "acc" }\n')
    try:
        eager = _solver(graphs=False)
        eager.step(4)
        g = _solver(graphs=True)
        g.step(4)
    finally:
        NET = saved
    st = g.gpu_step
    assert not st.graphs_on and not st.graphs
    for a, b in zip(_weights(eager), _weights(g)):
        np.testing.assert_array_equal(a, b)


def test_allocators_report_peaks(gpu):
    from minicaffe.gpu import pool
    cp = gpu
    was = pool.name()
    try:
        for kind in ("async", "default"):
            pool.use(kind)
            pool.reset_peak()
            a = cp.ones(1 << 24, np.float32)
            cp.cuda.Device().synchronize()
            assert pool.peak_bytes() >= a.nbytes
            del a
    finally:
        # the allocator it found: the tests after it (offload's measured peaks) read
        # the stream-ordered pool's high-water mark, not the caching pool's total
        pool.use(was)
