"""``minicaffe bench``: the speed of minicaffe's training step on synthetic inputs
(minicaffe/synthetic.py), and of the same step in PyTorch (``--compare torch``,
minicaffe/torch_twin.py), in one process.

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

The pieces, for other code (benchmarks, the memory plan's checks), with
``synthetic.synthetic_solver`` for the solver:

- :func:`time_iterations` -- warm-up, repeats, synchronisation, ms per iteration;
- :func:`bench_minicaffe`, :func:`bench_torch` -- one engine's :class:`Result`;
- :func:`run` -- the whole command: header, table, JSON.
"""
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from .core import backend, context, log
from .core.errors import MinicaffeError
from .synthetic import synthetic_solver, synthetic_test_net

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
        from .gpu import pool
        st = getattr(getattr(run, "__self__", None), "gpu_step", None)
        private = st.private_bytes() if st is not None else 0
        peak = backend.peak_gpu_bytes() + private
        what = (f"minicaffe GPU allocator high-water mark ({pool.name()} pool)"
                + (" + the CUDA graphs' own pools" if private else ""))
    else:
        peak, what = peak_start.bytes(), "peak RSS growth"
    return Result("minicaffe", ms, _images_per_iter(net, iter_size), peak, what)


def bench_torch(net, blobs, solver_param, iterations, repeats, warmup, gpu, train=True,
                precision=None):
    """(eager Result, CUDA-graph Result or None, twin notes): the same net and step in
    PyTorch (see torch_twin), eager and, on the GPU, captured as one CUDA graph;
    ``precision`` bf16/fp16 (GPU): under torch.autocast in that type with channels_last
    convolutions (fp16 without a GradScaler: the time of the step, not its scaling)."""
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
    if precision in ("bf16", "fp16") and gpu is not None:
        twin.autocast = torch.bfloat16 if precision == "bf16" else torch.float16
        twin.to_channels_last()
        inputs = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v
                  for k, v in inputs.items()}
        twin.notes.append(f"torch.autocast({precision}) + channels_last" +
                          (" (no GradScaler)" if precision == "fp16" else ""))
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


def minicaffe_tf32(config=None):
    """Whether minicaffe's cuDNN and cuBLAS calls may use TF32 (the run's ``config``, else
    the process default gpu/options.py; GPU mode only)."""
    from .gpu import options
    return context.is_gpu() and (options.tf32 if config is None else config.tf32)


def machine_info(gpu, torch_mod=None):
    """The header facts: CPU, threads, load, GPU, library versions."""
    from . import __version__
    info = {"cpu": cpu_model(), "logical_cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "blas_threads": blas_threads(), "gpu": None, "device": "cpu"}
    if gpu is not None:
        info["gpu"] = backend.gpu_name(gpu)
        info["device"] = f"gpu:{gpu}"
    versions = {"python": platform.python_version(), "minicaffe": __version__,
                "numpy": np.__version__, "cupy": None, "torch": None}
    if backend.cupy_available():
        versions["cupy"] = backend.cupy_version()
        try:
            versions["cuda_runtime"] = backend.runtime_version()
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


def bench_config(flags, gpu):
    """The run's RunConfig (the CLI's ``--offload``/``--gpu_mem_limit``) with ``--tf32``
    applied on a GPU."""
    from .core.config import RunConfig
    config = getattr(flags, "run_config", None) or RunConfig.from_environment()
    return config.replace(tf32=bool(flags.tf32)) if gpu is not None else config


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
    config = bench_config(flags, gpu)
    machine, versions = machine_info(gpu, torch_mod)
    report = {"command": " ".join(["minicaffe"] + list(getattr(flags, "argv", ["bench"]))),
              "machine": machine, "versions": versions, "dtype": "float32",
              "precision": config.precision or "fp32",
              "tf32": {"minicaffe": minicaffe_tf32(config),
                       "torch": bool(flags.tf32) if torch_mod is not None else None},
              "cudnn_benchmark": True if torch_mod is not None and gpu is not None else None,
              "phase": "TRAIN" if train else "TEST",
              "cpu_replicas": config.cpu_replicas,
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
    if report.get("cpu_replicas", 1) > 1 and not m["gpu"]:
        threads += (f"; minicaffe: {report['cpu_replicas']} replica processes of one "
                    "thread each (--replicas)")
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
    if report.get("precision", "fp32") != "fp32":
        line = (f"precision: minicaffe {report['precision']} (feature maps and diffs; "
                f"fp32 master weights); " + line)
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
    st = row.get("gpu_step")
    if st is not None:
        print(f"{row['net']}: GPU step " + ("replayed as a CUDA graph" if st["cuda_graph"] else
                                           "run eagerly (no CUDA graph)"), file=out)
    for note in row.get("notes", []):
        print(f"{row['net']}: torch twin: {note}", file=out)


def _bench_one(source, flags, gpu, train, iterations, input_shape, stages, torch_mod):
    """Build, time and describe one net (minicaffe, then the twin)."""
    release_free_memory()
    if gpu is not None:
        backend.reset_peak_gpu_bytes()
    cpu_peak = _CpuPeak().start()
    common = dict(batch=flags.batch or None, input_shape=input_shape,
                  num_classes=flags.num_classes or None, level=flags.level, stages=stages,
                  config=bench_config(flags, gpu))
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
    st = solver.gpu_step if solver is not None else None
    if st is not None:
        row["gpu_step"] = {"cuda_graph": bool(st.graphs_on and st.graphs),
                           "planned_peak_bytes": st.plan.peak if st.plan else None}
    if torch_mod is not None:
        log.info("bench: timing the PyTorch twin of %s", net.name)
        eager, graph, notes = bench_torch(net, blobs, sp, iterations, flags.repeats,
                                          flags.warmup, gpu, train,
                                          precision=getattr(flags, "precision", None) or None)
        row["notes"] = notes
        row["results"].append(eager.as_dict())
        row["ratios"]["minicaffe/torch_eager"] = mc.median_ms / eager.median_ms
        if graph is not None:
            row["results"].append(graph.as_dict())
            row["ratios"]["minicaffe/torch_graph"] = mc.median_ms / graph.median_ms
    if solver is not None:
        solver.close()      # its CPU replicas (--replicas), if any
    del solver, net, blobs
    gc.collect()
    return row

