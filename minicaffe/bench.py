"""``minicaffe bench``: the speed of minicaffe's training step on synthetic inputs, and of
the same step in PyTorch (``--compare torch``), in one process.

What is timed: the solver's iteration (``solver.step(k)``: clear the diffs, forward,
backward, update) of the TRAIN net, whose data layers are replaced by Input layers of
the same top shapes, filled once with random data (labels: integers in the range the
loss accepts), so no host work runs in the timed loop.  ``--phase TEST`` times the TEST
net's forward instead.  Timing: ``warmup`` iterations, then ``repeats`` repeats of
``iterations`` iterations, synchronised around each repeat; the figure is the median
repeat in ms per iteration.  Peak memory: on the GPU the high-water mark of minicaffe's
GPU allocator (``backend.peak_gpu_bytes``) or PyTorch's ``max_memory_allocated``, on
the CPU the growth of the process's peak RSS, each from just before that engine builds
its model to the end of its timing.

The pieces, for other code (benchmarks, the memory plan's checks):

- :func:`synthetic_net_param` -- a NetParameter whose data layers are Input layers;
- :func:`fill_synthetic_inputs` -- random data and labels into a Net's inputs, once;
- :func:`synthetic_solver` -- a Solver on such a net (``--model`` or ``--solver``);
- :func:`time_iterations` -- warm-up, repeats, synchronisation, ms per iteration;
- :func:`bench_minicaffe`, :func:`bench_torch` -- one engine's :class:`Result`;
- :func:`run` -- the whole command: header, table, JSON.
"""
import contextlib
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from . import backend, context, log
from .errors import MinicaffeError
from .net import Net, TEST, TRAIN, filter_net, read_net_param
from .proto import caffe_pb2

DATA_LAYER_TYPES = ("Data", "ImageData", "HDF5Data", "MemoryData", "DummyData", "Input",
                    "WindowData")
# layers whose shapes the layer parameters give (no file to read)
_DECLARED_SHAPES = ("Input", "DummyData", "MemoryData")
# loss/metric layers reading bottom 1 as class indices, and the axis of the classes
_CLASS_CONSUMERS = {"SoftmaxWithLoss": lambda lp: lp.softmax_param.axis,
                    "Accuracy": lambda lp: lp.accuracy_param.axis,
                    "MultinomialLogisticLoss": lambda lp: 1,
                    "InfogainLoss": lambda lp: lp.infogain_loss_param.axis,
                    "HingeLoss": lambda lp: 1}
# losses that read their second bottom as values (targets), not as class indices
_VALUE_CONSUMERS = ("EuclideanLoss", "SigmoidCrossEntropyLoss", "ContrastiveLoss")
DEFAULT_SOLVER = dict(type="SGD", base_lr=0.001, lr_policy="fixed", momentum=0.9,
                      weight_decay=0.0005)
SEED = 1701


# -- synthetic inputs ------------------------------------------------------------------------
@contextlib.contextmanager
def _cpu_mode():
    gpu = context.is_gpu()
    context.set_mode_cpu()
    try:
        yield
    finally:
        if gpu:
            context.set_mode_gpu()


def _batch_size(lp):
    for field in ("data_param", "image_data_param", "hdf5_data_param", "window_data_param"):
        if lp.HasField(field):
            return int(getattr(lp, field).batch_size)
    return 0


def _source(lp):
    for field in ("data_param", "image_data_param", "hdf5_data_param", "window_data_param"):
        if lp.HasField(field):
            return getattr(lp, field).source
    return ""


def _set_up_shapes(lp, phase):
    """Top shapes of data layer ``lp``, set up on its own in CPU mode (reads its first
    record when it has a source), then closed."""
    from .blob import Blob
    from .registry import create_layer
    q = caffe_pb2.LayerParameter()
    q.CopyFrom(lp)
    q.phase = phase
    tops = [Blob() for _ in q.top]
    with _cpu_mode():
        layer = create_layer(q)
        try:
            layer.setup([], tops)
        finally:
            close = getattr(layer, "close", None)
            if callable(close):
                close()
    return [tuple(t.shape) for t in tops]


def _deploy_shapes(lp, model_path):
    """(C, H, W...) of ``lp``'s first top from the Input of the same name in the
    deploy.prototxt beside ``model_path``, or None."""
    if not model_path:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(model_path)), "deploy.prototxt")
    if not os.path.isfile(path):
        return None
    deploy = read_net_param(path)
    for layer in deploy.layer:
        if layer.type != "Input" or lp.top[0] not in layer.top:
            continue
        shapes = layer.input_param.shape
        k = list(layer.top).index(lp.top[0])
        if len(shapes) == 0:
            return None
        return tuple(shapes[0 if len(shapes) == 1 else k].dim)[1:]
    return None


def data_top_shapes(lp, phase=TRAIN, model_path=None, input_shape=None):
    """The shapes of data layer ``lp``'s tops, without reading its data in the loop.
    Input, DummyData and MemoryData declare theirs.  A file-backed layer: (batch_size,)
    + ``input_shape`` (C, H, W) when given, else what its source's first record gives
    (crop applied), else the Input of the same name in the deploy.prototxt beside the
    model; its later tops (labels) get (batch_size,)."""
    if lp.type in _DECLARED_SHAPES:
        return _set_up_shapes(lp, phase)
    where = f"layer '{lp.name}' ({lp.type})"
    batch = _batch_size(lp)
    if batch <= 0:
        raise MinicaffeError(f"{where}: batch_size is not set")
    if input_shape is None:
        source = _source(lp)
        if source and os.path.exists(source):
            try:
                return _set_up_shapes(lp, phase)
            except MinicaffeError as e:
                log.warning("%s: %s; looking for a deploy.prototxt", where, e)
        input_shape = _deploy_shapes(lp, model_path)
        if input_shape is None:
            raise MinicaffeError(
                f"{where}: cannot tell the shape of top '{lp.top[0]}' (its source "
                f"'{source}' cannot be read and no deploy.prototxt beside the model names "
                f"it); give --input_shape C,H,W")
    return [(batch,) + tuple(input_shape)] + [(batch,)] * (len(lp.top) - 1)


def synthetic_net_param(param, model_path=None, batch=None, input_shape=None):
    """(NetParameter, replaced): ``param`` (its ``state`` says phase, level and stages)
    filtered to its layers, with every data layer replaced by an Input layer of the same
    tops and shapes (batch dimension ``batch`` when given).  ``replaced`` lists
    (layer name, type, [(top, shape)])."""
    phase = param.state.phase
    filtered = filter_net(param)
    out = caffe_pb2.NetParameter()
    out.CopyFrom(filtered)
    del out.layer[:]
    replaced = []
    for lp in filtered.layer:
        if lp.type not in DATA_LAYER_TYPES or len(lp.bottom):
            out.layer.add().CopyFrom(lp)
            continue
        shapes = data_top_shapes(lp, phase, model_path, input_shape)
        if batch:
            shapes = [(int(batch),) + tuple(s[1:]) for s in shapes]
        inp = out.layer.add(name=lp.name, type="Input")
        inp.top.extend(lp.top)
        for s in shapes:
            inp.input_param.shape.add(dim=s)
        replaced.append((lp.name, lp.type, list(zip(lp.top, shapes))))
    if not replaced:
        raise MinicaffeError(f"net '{param.name}' has no data layer to replace "
                             f"(looked for {', '.join(DATA_LAYER_TYPES)})")
    return out, replaced


def _consumers(net, name):
    """(layer index, bottom index) of every layer reading blob ``name``, through Splits."""
    out = []
    for i, ids in enumerate(net.bottom_id_vecs):
        for k, b in enumerate(ids):
            if net.blob_names[b] != name:
                continue
            if net.layers[i].type == "Split":
                for t in net.top_id_vecs[i]:
                    out.extend(_consumers(net, net.blob_names[t]))
            else:
                out.append((i, k))
    return out


def label_classes(net, name):
    """The number of classes a label blob may index: the class axis of the scores that
    the loss layers reading it (as bottom 1) compare it with, the smallest if several; None
    when no such layer reads it."""
    ks = []
    for i, k in _consumers(net, name):
        layer = net.layers[i]
        axis_of = _CLASS_CONSUMERS.get(layer.type)
        if axis_of is not None and k == 1:
            scores = net.bottom_vecs[i][0]
            ks.append(scores.shape[axis_of(layer.layer_param) % scores.num_axes])
    return min(ks) if ks else None


def fill_synthetic_inputs(net, num_classes=None, seed=SEED):
    """Fill every input blob of ``net`` once.  Class labels -- blobs that a loss or
    Accuracy reads as labels -- get random integers in [0, K), K the class count of the
    scores they are compared with (see :func:`label_classes`) or ``num_classes``;
    ``num_classes`` also makes labels of the later tops of a data layer that no
    regression loss reads.  Anything else gets N(0, 1).  Returns {blob name:
    description}."""
    rs = np.random.RandomState(seed)
    later_tops = set()
    for i, layer in enumerate(net.layers):
        if layer.type == "Input":
            later_tops.update(net.blob_names[t] for t in net.top_id_vecs[i][1:])
    described = {}
    for name in net.inputs:
        blob = net.blob_by_name(name)
        k = label_classes(net, name)
        if num_classes and k is not None and num_classes > k:
            raise MinicaffeError(f"--num_classes {num_classes}: label '{name}' is compared "
                                 f"with {k} classes")
        if k is None and num_classes and name in later_tops and not any(
                net.layers[i].type in _VALUE_CONSUMERS for i, _ in _consumers(net, name)):
            k = num_classes
        if k is not None:
            k = int(num_classes or k)
            values = rs.randint(0, k, size=blob.shape)
            described[name] = f"integers in [0, {k})"
        else:
            values = rs.standard_normal(blob.shape)
            described[name] = "N(0, 1)"
        blob.mutable_cpu_data()[...] = values.astype(blob.dtype)
    return described


def _train_net_param(sp, solver_path, level=0, stages=()):
    """(NetParameter in phase TRAIN with the solver's train_state, its path or None)."""
    d = os.path.dirname(os.path.abspath(solver_path)) if solver_path else None

    def read(path):
        if d and not os.path.exists(path) and not os.path.isabs(path):
            alt = os.path.join(d, path)
            path = alt if os.path.exists(alt) else path
        return read_net_param(path), path
    if sp.HasField("train_net_param"):
        param, path = read_net_param(sp.train_net_param), None
    elif sp.HasField("train_net"):
        param, path = read(sp.train_net)
    elif sp.HasField("net_param"):
        param, path = read_net_param(sp.net_param), None
    elif sp.HasField("net"):
        param, path = read(sp.net)
    else:
        raise MinicaffeError(f"{solver_path or 'solver'}: the solver defines no net")
    state = caffe_pb2.NetState(phase=TRAIN)
    state.MergeFrom(param.state)
    state.MergeFrom(sp.train_state)
    state.level = level or state.level
    state.stage.extend(s for s in stages if s not in state.stage)
    param.state.CopyFrom(state)
    return param, path


def default_solver_param():
    """The solver ``--model`` trains with: SGD, lr 0.001 (fixed), momentum 0.9, weight
    decay 0.0005, Caffe's test seed."""
    sp = caffe_pb2.SolverParameter(**DEFAULT_SOLVER)
    sp.random_seed = SEED
    return sp


def synthetic_solver(model=None, solver=None, batch=None, input_shape=None, num_classes=None,
                     level=0, stages=()):
    """(solver, info): a Solver training ``model`` (with :func:`default_solver_param`)
    or the train net of ``solver`` (its type and settings), on synthetic inputs filled
    once; test nets, display and snapshots are switched off.  ``info`` holds the
    replaced data layers and the input descriptions."""
    from .solvers import read_solver_param, solver_class
    if solver:
        sp, path = read_solver_param(solver)
        param, model_path = _train_net_param(sp, path, level, stages)
    else:
        sp, path = default_solver_param(), None
        param = read_net_param(model)
        param.state.phase = TRAIN
        param.state.level = level
        del param.state.stage[:]
        param.state.stage.extend(stages)
        model_path = model
    net_param, replaced = synthetic_net_param(param, model_path, batch, input_shape)
    for f in ("net", "net_param", "train_net", "train_net_param"):
        sp.ClearField(f)
    for f in ("test_net", "test_net_param", "test_iter", "test_state"):
        sp.ClearField(f)
    sp.net_param.CopyFrom(net_param)
    sp.test_interval = 0
    sp.test_initialization = False
    sp.display = 0
    sp.snapshot = 0
    sp.snapshot_after_train = False
    sp.debug_info = False
    sp.max_iter = max(sp.max_iter, 1 << 30)
    s = solver_class(sp.type or "SGD", path or "solver")(sp, source=path)
    inputs = fill_synthetic_inputs(s.net, num_classes)
    return s, {"replaced": replaced, "inputs": inputs, "solver_param": sp}


def synthetic_test_net(model, batch=None, input_shape=None, num_classes=None, level=0,
                       stages=()):
    """(Net, info): the TEST net of ``model`` on synthetic inputs filled once."""
    param = read_net_param(model)
    param.state.phase = TEST
    param.state.level = level
    del param.state.stage[:]
    param.state.stage.extend(stages)
    net_param, replaced = synthetic_net_param(param, model, batch, input_shape)
    net = Net(net_param)
    inputs = fill_synthetic_inputs(net, num_classes)
    return net, {"replaced": replaced, "inputs": inputs, "solver_param": None}


# -- timing and memory --------------------------------------------------------------------------
def time_iterations(run, iterations, repeats, warmup, sync=lambda: None):
    """``run(k)`` runs k iterations.  Runs ``warmup`` iterations, then ``repeats`` timed
    repeats of ``iterations`` each, with ``sync()`` before and after each repeat; returns
    the ms per iteration of each repeat."""
    if warmup:
        run(warmup)
    sync()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        run(iterations)
        sync()
        out.append((time.perf_counter() - t0) * 1e3 / iterations)
    return out


def _status_kib(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes():
    """The process's resident set size now (bytes; 0 where /proc is missing)."""
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


def reset_peak_rss():
    """Start a new peak-RSS mark (Linux: writing 5 to /proc/self/clear_refs).  Returns
    whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes():
    """The process's peak resident set size since the last reset (bytes)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def release_free_memory():
    """Collect garbage and hand the C heap's free pages back to the system (glibc's
    malloc_trim), so that memory freed by an earlier net is not reused unseen by the next
    one's peak-RSS growth."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _CpuPeak:
    """Peak RSS growth over a stretch of code."""

    def start(self):
        release_free_memory()
        self.exact = reset_peak_rss()
        self.base = rss_bytes()
        return self

    def bytes(self):
        return max(0, peak_rss_bytes() - self.base)


class Result:
    """One engine's figures for one net: ms per iteration of each repeat (``ms``), the
    median, images per second and peak memory in bytes (``peak_what`` says which)."""

    def __init__(self, engine, ms, images, peak_bytes, peak_what):
        self.engine, self.ms, self.images = engine, list(ms), images
        self.peak_bytes, self.peak_what = int(peak_bytes), peak_what

    @property
    def median_ms(self):
        return statistics.median(self.ms)

    @property
    def images_per_s(self):
        return self.images * 1e3 / self.median_ms

    def as_dict(self):
        return {"engine": self.engine, "ms_per_iter": self.median_ms, "ms_repeats": self.ms,
                "images_per_iter": self.images, "images_per_s": self.images_per_s,
                "peak_bytes": self.peak_bytes, "peak_what": self.peak_what}


def _images_per_iter(net, iter_size=1):
    """Batch size of the first input, times iter_size."""
    blob = net.input_blobs[0]
    return (blob.shape[0] if blob.num_axes else 1) * iter_size


def bench_minicaffe(run, net, iterations, repeats, warmup, gpu, iter_size=1, peak_start=None):
    """Time minicaffe's ``run(k)`` (``solver.step`` or the TEST forward) on GPU ``gpu``
    (None: the CPU).  ``peak_start`` is the CPU peak tracker started before the model was
    built (GPU: the allocator's mark was reset then)."""
    sync = backend.synchronize if gpu is not None else (lambda: None)
    ms = time_iterations(run, iterations, repeats, warmup, sync)
    if gpu is not None:
        peak, what = backend.peak_gpu_bytes(), "minicaffe GPU allocator (CuPy pool total_bytes)"
    else:
        peak, what = peak_start.bytes(), "peak RSS growth"
    return Result("minicaffe", ms, _images_per_iter(net, iter_size), peak, what)


def bench_torch(net, blobs, solver_param, iterations, repeats, warmup, gpu, train=True):
    """(eager Result, CUDA-graph Result or None, twin notes): the same net and step in
    PyTorch (see torch_twin), eager and, on the GPU, captured as one CUDA graph."""
    import torch
    from .torch_twin import TorchTwin, make_optimizer
    device = f"cuda:{gpu}" if gpu is not None else "cpu"
    iter_size = solver_param.iter_size if (train and solver_param is not None) else 1
    clip = solver_param.clip_gradients if (train and solver_param is not None) else -1.0
    sync = (lambda: torch.cuda.synchronize(device)) if gpu is not None else (lambda: None)
    images = _images_per_iter(net, iter_size)
    if gpu is not None:
        torch.cuda.set_device(gpu)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _warm_up_torch_cpu(torch)
        cpu_peak = _CpuPeak().start()
    twin = TorchTwin(net, device, blobs=blobs)
    twin.train(train)
    inputs = twin.inputs_from(net)
    if train:
        opt = make_optimizer(twin, solver_param)

        def step():
            twin.train_step(inputs, opt, iter_size, clip)
    else:
        def step():
            with torch.no_grad():
                twin(inputs)

    def run(k):
        for _ in range(k):
            step()
    ms = time_iterations(run, iterations, repeats, warmup, sync)
    if gpu is not None:
        eager = Result("torch eager", ms, images, torch.cuda.max_memory_allocated(device),
                       "torch.cuda.max_memory_allocated")
    else:
        eager = Result("torch eager", ms, images, cpu_peak.bytes(), "peak RSS growth")
    graph = None
    if gpu is not None:
        if train:
            opt.zero_grad(set_to_none=True)
            del opt
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        replay = capture_cuda_graph(twin, inputs, solver_param if train else None,
                                    max(3, warmup), iter_size, clip)

        def run_graph(k):
            for _ in range(k):
                replay()
        ms = time_iterations(run_graph, iterations, repeats, warmup, sync)
        graph = Result("torch graph", ms, images, torch.cuda.max_memory_allocated(device),
                       "torch.cuda.max_memory_allocated")
    notes = list(twin.notes)
    del twin, inputs
    gc.collect()
    if gpu is not None:
        torch.cuda.empty_cache()
    return eager, graph, notes


_TORCH_CPU_WARM = []


def _warm_up_torch_cpu(torch):
    """One tiny convolution step, once per process, so that the first net's peak RSS
    does not count PyTorch's one-time set-up (oneDNN, thread pools)."""
    if _TORCH_CPU_WARM:
        return
    x = torch.randn(2, 3, 9, 9)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    v = torch.randn(10, 4 * 3 * 3, requires_grad=True)
    opt = torch.optim.SGD([w, v], lr=0.1, momentum=0.9)
    y = torch.nn.functional.max_pool2d(torch.relu(torch.nn.functional.conv2d(x, w)), 2)
    torch.nn.functional.cross_entropy(y.flatten(1) @ v.t(), torch.tensor([1, 2])).backward()
    opt.step()
    _TORCH_CPU_WARM.append(True)


def capture_cuda_graph(twin, inputs, solver_param, warmup, iter_size=1, clip=-1.0):
    """The whole step (zero_grad, forward, loss, backward, optimizer step; or the
    forward alone when ``solver_param`` is None) captured as one CUDA graph, as PyTorch's
    docs show: static inputs, warm-up on a side stream, then capture.  Returns the
    graph's replay function."""
    import torch
    from .torch_twin import make_optimizer
    train = solver_param is not None
    opt = make_optimizer(twin, solver_param, capturable=True) if train else None

    def step():
        if train:
            twin.train_step(inputs, opt, iter_size, clip)
        else:
            with torch.no_grad():
                twin(inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if train:
        opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        # the grads are None: backward allocates them from the graph's pool, and on each
        # replay writes them (zero_grad(set_to_none) inside is no kernel at all)
        step()
    keep = (graph, opt, inputs)  # the graph reads and writes these tensors

    def replay():
        keep[0].replay()
    return replay


# -- the machine ---------------------------------------------------------------------------------
def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_threads():
    """Threads numpy's BLAS (OpenBLAS) uses: asked of the loaded library (as
    threadpoolctl does), else from OPENBLAS_NUM_THREADS/OMP_NUM_THREADS, else the CPU
    count."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower()
                    and line.split()[-1].startswith("/")}
    except OSError:
        libs = set()
    names = ("openblas_get_num_threads", "openblas_get_num_threads64_",
             "scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads")
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                return int(fn())
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            pass
    return os.cpu_count() or 1


def gpu_name(device_id):
    try:
        name = backend.cp.cuda.runtime.getDeviceProperties(device_id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # pragma: no cover - depends on the driver
        return "?"


def minicaffe_tf32():
    """Whether minicaffe's GEMMs may use TF32: CuPy's cuBLAS calls do when CUPY_TF32 is a
    positive integer (GPU mode only)."""
    try:
        on = int(os.environ.get("CUPY_TF32", "0") or 0) > 0
    except ValueError:
        on = False
    return context.is_gpu() and on


def machine_info(gpu, torch_mod=None):
    """The header facts: CPU, threads, load, GPU, library versions."""
    from . import __version__
    info = {"cpu": cpu_model(), "logical_cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "blas_threads": blas_threads(), "gpu": None, "device": "cpu"}
    if gpu is not None:
        info["gpu"] = gpu_name(gpu)
        info["device"] = f"gpu:{gpu}"
    versions = {"python": platform.python_version(), "minicaffe": __version__,
                "numpy": np.__version__, "cupy": None, "torch": None}
    if backend.cp is not None:
        versions["cupy"] = backend.cp.__version__
        try:
            versions["cuda_runtime"] = backend.cp.cuda.runtime.runtimeGetVersion()
        except Exception:  # pragma: no cover - depends on the driver
            pass
    if torch_mod is not None:
        versions["torch"] = torch_mod.__version__
        versions["torch_cuda"] = torch_mod.version.cuda
        try:
            versions["torch_cudnn"] = torch_mod.backends.cudnn.version()
        except Exception:  # pragma: no cover
            versions["torch_cudnn"] = None
        info["torch_threads"] = torch_mod.get_num_threads()
    return info, versions


def set_torch_precision(torch_mod, tf32, gpu):
    """TF32 off unless asked (both matmul and cuDNN), cuDNN autotuning on for the fixed
    shapes, and on the CPU as many threads as numpy's BLAS."""
    torch_mod.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch_mod.backends.cudnn.allow_tf32 = bool(tf32)
    torch_mod.backends.cudnn.benchmark = True
    if gpu is None:
        torch_mod.set_num_threads(blas_threads())


# -- the command ------------------------------------------------------------------------------
def _mib(n):
    return n / 2 ** 20


def _f(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def _table(rows, compare, graphs):
    """The results table (one line per net); ``graphs``: with the CUDA-graph columns."""
    cols = ["net", "batch", "minicaffe ms"]
    if compare:
        cols += ["torch eager ms"] + (["torch graph ms"] if graphs else [])
        cols += ["mc/eager"] + (["mc/graph"] if graphs else [])
    cols += ["mc img/s"]
    if compare:
        cols += ["eager img/s"] + (["graph img/s"] if graphs else [])
    cols += ["mc peak MiB"]
    if compare:
        cols += ["eager peak MiB"] + (["graph peak MiB"] if graphs else [])
    lines = []
    for row in rows:
        r = {res["engine"]: res for res in row["results"]}
        mc, eager, graph = r.get("minicaffe"), r.get("torch eager"), r.get("torch graph")
        cells = [row["net"], str(row["batch"]), _f(mc["ms_per_iter"])]
        if compare:
            cells += [_f(eager["ms_per_iter"])] + ([_f(graph["ms_per_iter"])] if graphs else [])
            cells += [_f(row["ratios"].get("minicaffe/torch_eager"))]
            cells += [_f(row["ratios"].get("minicaffe/torch_graph"))] if graphs else []
        cells += [_f(mc["images_per_s"], 1)]
        if compare:
            cells += [_f(eager["images_per_s"], 1)]
            cells += [_f(graph["images_per_s"], 1)] if graphs else []
        cells += [_f(_mib(mc["peak_bytes"]), 1)]
        if compare:
            cells += [_f(_mib(eager["peak_bytes"]), 1)]
            cells += [_f(_mib(graph["peak_bytes"]), 1)] if graphs else []
        lines.append(cells)
    widths = [max(len(c), *(len(line[k]) for line in lines)) for k, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(c.rjust(w) if k else c.ljust(w)
                                  for k, (c, w) in enumerate(zip(cells, widths)))
    return [fmt(cols)] + [fmt(line) for line in lines]


def _solver_words(sp, given):
    what = f"{sp.type or 'SGD'} lr {sp.base_lr:g} ({sp.lr_policy}) momentum {sp.momentum:g} " \
           f"weight_decay {sp.weight_decay:g}"
    return what + (f" (from {given})" if given else " (bench default)")


def check_settings(flags):
    """One-line errors for settings bench cannot use."""
    if not flags.model and not flags.solver:
        raise MinicaffeError("need a model (--model FILE[,FILE...]) or a solver "
                             "(--solver FILE) to benchmark")
    if flags.model and flags.solver:
        raise MinicaffeError("give --model or --solver, not both")
    if flags.phase not in ("", "TRAIN", "TEST"):
        raise MinicaffeError(f"phase must be \"TRAIN\" or \"TEST\" (got '{flags.phase}')")
    if flags.solver and flags.phase == "TEST":
        raise MinicaffeError("--phase TEST times a model's TEST net: give --model, not "
                             "--solver")
    for name in ("iterations", "repeats"):
        if getattr(flags, name) < 1:
            raise MinicaffeError(f"--{name} must be at least 1")
    if flags.warmup < 0:
        raise MinicaffeError("--warmup must not be negative")
    if flags.batch < 0 or flags.num_classes < 0:
        raise MinicaffeError("--batch and --num_classes must not be negative")
    if flags.compare not in ("", "torch"):
        raise MinicaffeError(f"--compare {flags.compare}: only 'torch' can be compared")
    for path in (flags.model.split(",") if flags.model else []) + [flags.solver]:
        if path and not os.path.isfile(path):
            raise MinicaffeError(f"{path}: no such file")
    if flags.json:
        d = os.path.dirname(os.path.abspath(flags.json))
        if not os.path.isdir(d):
            raise MinicaffeError(f"{flags.json}: cannot write the JSON there (no folder {d})")
    return parse_input_shape(flags.input_shape)


def parse_input_shape(text):
    if not text:
        return None
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) <= 0:
        raise MinicaffeError(f"--input_shape '{text}': give positive sizes like 3,224,224")
    return dims


def _import_torch():
    try:
        import torch
    except Exception as e:
        raise MinicaffeError(f"--compare torch needs PyTorch, which cannot be imported "
                             f"({type(e).__name__}: {e}); pip install torch") from None
    return torch


def run(flags, gpu=None, out=None):
    """``minicaffe bench``: benchmark each model (or the solver's net) on ``gpu`` (None:
    the CPU), print the header and the table to ``out`` and write ``--json``.  Returns
    the report dict."""
    out = out or sys.stdout
    input_shape = check_settings(flags)
    torch_mod = _import_torch() if flags.compare == "torch" else None
    train = flags.phase != "TEST"
    iterations = flags.iterations if "iterations" in flags.given else 10
    stages = [s for s in flags.stage.split(",") if s] if flags.stage else []
    if torch_mod is not None:
        set_torch_precision(torch_mod, flags.tf32, gpu)
    machine, versions = machine_info(gpu, torch_mod)
    report = {"command": " ".join(["minicaffe"] + list(getattr(flags, "argv", ["bench"]))),
              "machine": machine, "versions": versions, "dtype": "float32",
              "tf32": {"minicaffe": minicaffe_tf32(),
                       "torch": bool(flags.tf32) if torch_mod is not None else None},
              "cudnn_benchmark": True if torch_mod is not None and gpu is not None else None,
              "phase": "TRAIN" if train else "TEST",
              "timing": {"warmup": flags.warmup, "repeats": flags.repeats,
                         "iterations": iterations, "statistic": "median of repeats",
                         "synchronised": gpu is not None},
              "nets": []}
    _print_header(report, flags, out)
    sources = flags.model.split(",") if flags.model else [flags.solver]
    for source in sources:
        row = _bench_one(source, flags, gpu, train, iterations, input_shape, stages,
                         torch_mod)
        report["nets"].append(row)
        _print_net_lines(row, out)
    for line in _table(report["nets"], torch_mod is not None, gpu is not None):
        print(line, file=out)
    out.flush()
    if flags.json:
        with open(flags.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return report


def _print_header(report, flags, out):
    m, v = report["machine"], report["versions"]
    what = "training step (solver.step: forward, backward, update)" if \
        report["phase"] == "TRAIN" else "TEST forward"
    print(f"minicaffe bench: {what}, synthetic inputs filled once, {report['dtype']}",
          file=out)
    threads = f"numpy BLAS threads {m['blas_threads']}"
    if "torch_threads" in m:
        threads += f", torch threads {m['torch_threads']}"
    print(f"CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs, load average "
          f"{' '.join(str(x) for x in m['load_average'])}); {threads}", file=out)
    print(f"GPU: {m['gpu'] + ' (' + m['device'] + ')' if m['gpu'] else 'none (CPU mode)'}",
          file=out)
    vs = [f"python {v['python']}", f"minicaffe {v['minicaffe']}", f"numpy {v['numpy']}",
          f"cupy {v['cupy'] or '-'}"]
    if v["torch"]:
        vs.append(f"torch {v['torch']} (CUDA {v.get('torch_cuda') or '-'}, cuDNN "
                  f"{v.get('torch_cudnn') or '-'})")
    print("versions: " + ", ".join(vs), file=out)
    tf = report["tf32"]
    line = f"dtype: {report['dtype']}; TF32: minicaffe {'on' if tf['minicaffe'] else 'off'}"
    if tf["torch"] is not None:
        line += f", torch {'on' if tf['torch'] else 'off'}"
    if report["cudnn_benchmark"]:
        line += "; torch.backends.cudnn.benchmark on"
    print(line, file=out)
    t = report["timing"]
    sync = ", synchronised around each repeat" if t["synchronised"] else ""
    print(f"timing: {t['warmup']} warm-up iterations, then the median of {t['repeats']} "
          f"repeats of {t['iterations']} iterations{sync}", file=out)


def _print_net_lines(row, out):
    ins = "; ".join(f"{name} {'x'.join(map(str, shape))} ({row['inputs'][name]})"
                    for layer in row["replaced"] for name, shape in layer["tops"])
    layers = ", ".join(f"'{layer['layer']}' ({layer['type']})" for layer in row["replaced"])
    print(f"{row['net']}: {layers} -> Input: {ins}", file=out)
    if row.get("solver"):
        print(f"{row['net']}: solver {row['solver']}", file=out)
    for note in row.get("notes", []):
        print(f"{row['net']}: torch twin: {note}", file=out)


def _bench_one(source, flags, gpu, train, iterations, input_shape, stages, torch_mod):
    """Build, time and describe one net (minicaffe, then the twin)."""
    release_free_memory()
    if gpu is not None:
        backend.reset_peak_gpu_bytes()
    cpu_peak = _CpuPeak().start()
    common = dict(batch=flags.batch or None, input_shape=input_shape,
                  num_classes=flags.num_classes or None, level=flags.level, stages=stages)
    if train:
        kw = dict(solver=source) if flags.solver else dict(model=source)
        solver, info = synthetic_solver(**kw, **common)
        net, sp = solver.net, info["solver_param"]
        run_mc = solver.step
        iter_size = sp.iter_size
    else:
        net, info = synthetic_test_net(source, **common)
        solver, sp, iter_size = None, None, 1

        def run_mc(k):
            for _ in range(k):
                net.forward_prefilled()
    blobs = None
    if torch_mod is not None:  # the twin starts from the initial weights
        blobs = [[np.array(b.cpu_data(), copy=True) for b in layer.blobs]
                 for layer in net.layers]
    log.info("bench: timing minicaffe on %s", net.name)
    mc = bench_minicaffe(run_mc, net, iterations, flags.repeats, flags.warmup, gpu,
                         iter_size, cpu_peak)
    row = {"net": net.name or os.path.basename(source), "source": source,
           "batch": _images_per_iter(net), "iter_size": iter_size,
           "replaced": [{"layer": n, "type": t, "tops": [[top, list(s)] for top, s in tops]}
                        for n, t, tops in info["replaced"]],
           "inputs": info["inputs"], "results": [mc.as_dict()], "ratios": {}, "notes": []}
    if sp is not None:
        row["solver"] = _solver_words(sp, flags.solver)
    if torch_mod is not None:
        log.info("bench: timing the PyTorch twin of %s", net.name)
        eager, graph, notes = bench_torch(net, blobs, sp, iterations, flags.repeats,
                                          flags.warmup, gpu, train)
        row["notes"] = notes
        row["results"].append(eager.as_dict())
        row["ratios"]["minicaffe/torch_eager"] = mc.median_ms / eager.median_ms
        if graph is not None:
            row["results"].append(graph.as_dict())
            row["ratios"]["minicaffe/torch_graph"] = mc.median_ms / graph.median_ms
    del solver, net, blobs
    gc.collect()
    return row

