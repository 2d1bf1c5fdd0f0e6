"""The ``minicaffe`` command line: Caffe's ``tools/caffe.cpp``.

    minicaffe train --solver S [--gpu 0|0,1|all] [--snapshot X.solverstate | --weights A[,B]]
                    [--level N] [--stage a,b] [--sigint_effect stop|snapshot|none]
                    [--sighup_effect ...] [--log FILE] [--debug_info]
                    [--parallel thread|process] [--rank R --world_size N --init_file F]
                    [--dashboard [HOST:]PORT] [--tensorboard DIR]
    minicaffe dashboard RUN [--port [HOST:]PORT]
    minicaffe plot LOG [--out FILE] [--chart N]
    minicaffe test --model M --weights W [--iterations 50] [--gpu 0]
    minicaffe time --model M [--iterations 50] [--phase TRAIN|TEST] [--gpu 0]
    minicaffe device_query [--gpu 0]
    minicaffe bench --model M[,M2...] | --solver S [--gpu 0] [--batch N] [--iterations 10]
                    [--repeats 5] [--warmup 3] [--phase TRAIN|TEST] [--compare torch]
                    [--tf32] [--json FILE] [--num_classes K] [--input_shape C,H,W]
    minicaffe memory --model M | --solver S [--batch N] [--input_shape C,H,W] [--gpu 0]
                     [--offload NONE|ALL|CONV|DYNAMIC] [--gpu_mem_limit SIZE|N%|auto]
                     [--schedule]
                     (CPU mode: host memory; the GPU plan with --gpu, --offload or
                     --gpu_mem_limit)
    minicaffe draw | extract_features | upgrade_net_proto_text | upgrade_net_proto_binary
                   (positional arguments, as Caffe's tools; ``minicaffe draw --help``)
    every command: [--threads N] [--quiet] [--minloglevel N]; ``minicaffe CMD --help``

Flags are spelled as gflags accepts them: ``--solver S``, ``--solver=S``,
``-solver S``, ``-solver=S``.  A mistake in the input is one line on stderr and
exit status 1, never a traceback (set MINICAFFE_TRACEBACK=1 to see one).
"""
import logging
import os
import signal
import sys
import time as _time
import warnings

import numpy as np

from .core import backend, config, context, log
from .core.errors import MinicaffeError

USAGE = """minicaffe: command line brew
usage: minicaffe <command> <args>

commands:
  train           train or finetune a model
  test            score a model
  device_query    show GPU diagnostic information
  draw            draw a net definition (draw NET.prototxt OUT.{dot,png,svg,pdf} [--rankdir LR]
                  [--phase TRAIN|TEST|ALL] [--display_lrm]), as pycaffe's draw_net.py
  time            benchmark model execution time
  bench           time the training step on synthetic inputs (and its PyTorch twin)
  memory          print the memory of a training iteration: host memory in CPU mode; the
                  GPU plan (per layer, planned peak) with --gpu, --offload or --gpu_mem_limit
  dashboard       serve the dashboard page of a run from its log or TensorBoard events
                  (dashboard RUN [--port [HOST:]PORT]; docs/watching.md)
  plot            chart a training log (plot LOG [--out FILE.png|svg] [--chart 0-7]), as
                  Caffe's plot_training_log.py
  extract_features  write blobs of a trained net to LMDB/LevelDB (Caffe's extract_features:
                  extract_features WEIGHTS MODEL BLOB[,B2] DB[,DB2] NUM_BATCHES lmdb|leveldb
                  [CPU|GPU] [DEVICE_ID])
  upgrade_net_proto_text    upgrade an old (V0/V1) net prototxt: IN OUT
  upgrade_net_proto_binary  upgrade an old (V0/V1) binary net (.caffemodel): IN OUT

"minicaffe COMMAND --help" prints that command's own flags.

flags:
  --solver FILE        the solver definition (prototxt or .yaml)
  --model FILE         the model definition (prototxt or .yaml)
  --snapshot FILE      the solver state (.solverstate or .solverstate.h5) to resume from
  --weights A[,B]      pretrained weights (.caffemodel or .caffemodel.h5) to start from
                       (train: finetuning; cannot be given with --snapshot)
  --gpu IDS            run on GPU: a device id, ids separated by ',' or 'all'
                       (train: overrides solver_mode and device_id; several GPUs train
                       data-parallel, the prototxt's batch divided among them)
  --parallel MODE      train on several GPUs: thread (default; one thread per GPU) or
                       process (one process per GPU)
  --rank R             train: this process's rank in a run of one process per GPU started
                       by hand (with --world_size and --init_file; --gpu names its GPU)
  --world_size N       train: the number of processes of that run
  --init_file F        train: a file every process sees; rank 0 writes the NCCL id there
                       (it must not exist yet)
  --iterations N       test/time: the number of iterations to run (default 50);
                       bench: iterations per timed repeat (default 10)
  --phase TRAIN|TEST   time/bench: the network phase (default TRAIN)
  --level N            the network level (default 0)
  --stage a,b          the network stages
  --sigint_effect E    train: what SIGINT does: stop (default), snapshot or none
  --sighup_effect E    train: what SIGHUP does: snapshot (default), stop or none
  --log FILE           also write the log to FILE (overwritten)
  --threads N          the CPU threads numpy's BLAS may use (default 1, or what
                       OPENBLAS_NUM_THREADS/OMP_NUM_THREADS/MKL_NUM_THREADS say); N > 1:
                       batch-parallel convolutions and poolings on N threads, the BLAS
                       on one (docs/cli.md#cpu-threads)
  --replicas N         train/time/bench (CPU): split each iteration's batch across N worker
                       processes of one thread each, their gradients summed before one
                       update (default 1: one process; auto: the usable CPUs less one for
                       the main process, 2 on two; docs/cli.md#cpu-replicas---replicas-n)
  --quiet              print only the progress (display lines, test scores) and the result,
                       and warnings; a --log file still gets every line
  --minloglevel N      glog's: 0 INFO (default), 1 WARNING, 2 ERROR (as GLOG_minloglevel)
  --debug_info         train: print per-blob data and diff norms at each display
  --cuda_graph         train (GPU): capture the iteration as CUDA graphs and replay them
                       (default on; --nocuda_graph runs it eagerly; overrides the solver's
                       cuda_graph)
  --tf32               train/bench (GPU): let cuDNN and cuBLAS use TF32 tensor cores (the
                       solver's minicaffe_precision: "TF32"); strict fp32 otherwise; bench:
                       PyTorch too
  --precision P        train/test/time/bench/memory: fp32, tf32, bf16 or fp16: the storage
                       type of feature maps and their diffs (master weights, solver history,
                       losses and softmax stay fp32; fp16 scales the loss dynamically);
                       overrides the solver's minicaffe_precision and the net's NVIDIA Caffe
                       default_*_type fields (docs/precision.md)
  --batch N            bench: the batch size of every data layer (default: the model's)
  --repeats N          bench: timed repeats; the median is reported (default 5)
  --warmup N           bench: untimed iterations first (default 3)
  --compare torch      bench: also time the same net and step in PyTorch
  --json FILE          bench: also write the results as JSON
  --num_classes K      bench: labels are integers in [0, K) (default: from the net)
  --input_shape C,H,W  bench: the data shape when the model's data cannot be read
  --schedule           memory: also print the schedule of one training iteration (the
                       engine's ops: forward, backward, fused pairs, offload copies, update)
  --offload POLICY     train/bench/memory: offload feature maps to host memory: NONE, ALL, CONV
                       or DYNAMIC (overrides the net's offload_param; docs/offload.md)
  --gpu_mem_limit L    train/bench/memory: the device memory the training step may plan
                       for: 12GiB, 12000MiB, 12GB (KB/MB/GB are powers of 1000, KiB/MiB/GiB
                       and K/M/G of 1024), bytes (12000000000), a share of the device (60%)
                       or auto (its free memory less a margin); overrides offload_param's
                       gpu_memory_budget; with DYNAMIC a net larger than the budget trains
                       by offloading (docs/offload.md)
  --share_data         train/bench/memory (GPU): the training step's memory plan lets blob
                       data that no backward reads share memory, as PyTorch frees such
                       tensors (default on; --noshare_data keeps every blob's data after a
                       step, as Caffe; pycaffe's default; docs/gpu_engine.md)
  --dashboard [H:]P    train: serve a live page of the run (curves, facts) on port P of
                       127.0.0.1, or of host H (then a token in the printed URL is needed)
  --tensorboard DIR    train: write TensorBoard event files into DIR (the solver's
                       minicaffe_tensorboard_dir; needs pip install ".[tensorboard]")
  --data_workers N     train: worker processes that read and decode each Data/ImageData
                       layer's records (0: in the prefetch thread; default: from the cores;
                       overrides $MINICAFFE_DECODE_THREADS and data_param.workers)
  --gpu_decode         train (GPU): decode the JPEGs of Data/ImageData layers on the GPU
                       with nvImageCodec (pip install ".[gpu-jpeg]"; default: CPU workers)
  --version            print the version
"""

# name: (kind, default)
FLAGS = {
    "solver": ("str", ""),
    "model": ("str", ""),
    "snapshot": ("str", ""),
    "weights": ("str", ""),
    "gpu": ("str", None),
    "iterations": ("int", 50),
    "phase": ("str", ""),
    "level": ("int", 0),
    "stage": ("str", ""),
    "sigint_effect": ("str", "stop"),
    "sighup_effect": ("str", "snapshot"),
    "log": ("str", ""),
    "debug_info": ("bool", False),
    "cuda_graph": ("bool", True),
    "tf32": ("bool", False),
    "precision": ("str", ""),
    "parallel": ("str", "thread"),
    "rank": ("int", -1),
    "world_size": ("int", 0),
    "init_file": ("str", ""),
    "batch": ("int", 0),
    "repeats": ("int", 5),
    "warmup": ("int", 3),
    "compare": ("str", ""),
    "json": ("str", ""),
    "num_classes": ("int", 0),
    "input_shape": ("str", ""),
    "offload": ("str", ""),
    "gpu_mem_limit": ("str", ""),
    "dashboard": ("str", ""),
    "tensorboard": ("str", ""),
    "threads": ("int", 0),
    "replicas": ("str", 1),     # a count or "auto" (config.check_replicas)
    "quiet": ("bool", False),
    "minloglevel": ("int", 0),
    "data_workers": ("int", -1),
    "gpu_decode": ("bool", False),
    "schedule": ("bool", False),
    "share_data": ("bool", True),
}
COMMANDS = ("train", "test", "time", "device_query", "bench", "memory")
# commands with positional arguments (Caffe's separate tools), each parsing its own
TOOLS = {"draw": "minicaffe.compat.draw",
         "dashboard": "minicaffe.watch.commands:dashboard_main",
         "plot": "minicaffe.watch.commands:plot_main",
         "extract_features": "minicaffe.tools.extract_features",
         "upgrade_net_proto_text": "minicaffe.tools.upgrade_net_proto:main_text",
         "upgrade_net_proto_binary": "minicaffe.tools.upgrade_net_proto:main_binary"}
ACTIONS = COMMANDS[:4] + ("draw",) + COMMANDS[4:] + tuple(TOOLS)[1:]

_EVERY = ("log", "threads", "quiet", "minloglevel")
# each command's flags, what ``minicaffe CMD --help`` lists and what CMD accepts
COMMAND_FLAGS = {
    "train": ("solver", "snapshot", "weights", "gpu", "parallel", "rank", "world_size",
              "init_file", "level", "stage", "sigint_effect", "sighup_effect", "debug_info",
              "cuda_graph", "tf32", "offload", "gpu_mem_limit", "dashboard",
              "tensorboard", "data_workers", "gpu_decode", "precision", "replicas",
              "share_data") + _EVERY,
    "test": ("model", "weights", "gpu", "iterations", "level", "stage",
             "precision") + _EVERY,
    "time": ("model", "gpu", "iterations", "phase", "level", "stage", "precision",
             "replicas") + _EVERY,
    "device_query": ("gpu",) + _EVERY,
    "bench": ("model", "solver", "gpu", "batch", "iterations", "repeats", "warmup", "phase",
              "compare", "tf32", "json", "num_classes", "input_shape", "level",
              "stage", "precision", "offload", "gpu_mem_limit", "replicas",
              "share_data") + _EVERY,
    "memory": ("model", "solver", "gpu", "batch", "input_shape", "num_classes", "offload",
               "gpu_mem_limit", "level", "stage", "schedule", "precision",
               "share_data") + _EVERY,
}
COMMAND_USAGE = {
    "train": ("minicaffe train --solver FILE [flags]", "train or finetune a model"),
    "test": ("minicaffe test --model FILE --weights FILE [flags]", "score a model"),
    "time": ("minicaffe time --model FILE [flags]",
             "benchmark model execution time (forward and backward, per layer)"),
    "device_query": ("minicaffe device_query [--gpu IDS]", "show GPU diagnostic information"),
    "bench": ("minicaffe bench --model FILE[,FILE2...] | --solver FILE [flags]",
              "time the training step on synthetic inputs (and its PyTorch twin)"),
    "memory": ("minicaffe memory --model FILE | --solver FILE [flags]",
               "the memory of a training iteration: host memory in CPU mode; the GPU plan "
               "with --gpu, --offload or --gpu_mem_limit (planned on a machine without GPU)"),
}
# the largest batch a command accepts (Caffe's blob counts are int32)
MAX_BATCH = 2 ** 31 - 1


def _flag_help():
    """{flag: its lines of USAGE's flags section}."""
    import re
    entries, name = {}, None
    for line in USAGE.split("\nflags:\n", 1)[1].splitlines():
        m = re.match(r"  --(\w+)", line)
        if m:
            name = m.group(1)
            entries[name] = [line]
        elif name and line.strip():
            entries[name].append(line)
    return entries


def command_help(command):
    """The text of ``minicaffe COMMAND --help``."""
    usage, what = COMMAND_USAGE[command]
    entries = _flag_help()
    lines = [f"usage: {usage}", "", what, "", "flags:"]
    for f in COMMAND_FLAGS[command]:
        lines += entries.get(f, [f"  --{f}"])
    lines += ["", "Flags are spelled as gflags accepts them: --flag V, --flag=V, -flag V; "
              "docs/cli.md."]
    return "\n".join(lines) + "\n"


class Flags:
    def __init__(self, **kw):
        for name, (_, default) in FLAGS.items():
            setattr(self, name, default)
        self.__dict__.update(kw)
        self.given = set()


def parse_args(argv):
    """(command, Flags) from argv, gflags style.  Raises MinicaffeError."""
    flags = Flags()
    command = None
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok == "--":
            continue
        if tok.startswith("-") and len(tok) > 1 and not _is_number(tok):
            body = tok.lstrip("-")
            name, eq, value = body.partition("=")
            if name in ("h", "help", "helpshort", "helpfull"):
                flags.help_command = command or next(
                    (t for t in argv[i:] if t in COMMANDS), None)
                return "help", flags
            if name == "version":
                return "version", flags
            if name not in FLAGS and name.startswith("no") and name[2:] in FLAGS and \
                    FLAGS[name[2:]][0] == "bool" and not eq:
                setattr(flags, name[2:], False)
                flags.given.add(name[2:])
                continue
            if name not in FLAGS:
                raise MinicaffeError(f"unknown command line flag '{name}' (see minicaffe --help)")
            kind = FLAGS[name][0]
            if kind == "bool":
                if eq:
                    v = value.lower()
                    if v not in ("true", "false", "1", "0", "yes", "no", "t", "f", "y", "n"):
                        raise MinicaffeError(f"illegal value '{value}' specified for bool flag "
                                             f"'{name}'")
                    setattr(flags, name, v in ("true", "1", "yes", "t", "y"))
                else:
                    setattr(flags, name, True)
                flags.given.add(name)
                continue
            if not eq:
                if i >= len(argv):
                    raise MinicaffeError(f"flag '{name}' is missing its argument")
                value = argv[i]
                i += 1
            if kind == "int":
                try:
                    value = int(value)
                except ValueError:
                    raise MinicaffeError(f"illegal value '{value}' specified for int32 flag "
                                         f"'{name}'") from None
            setattr(flags, name, value)
            flags.given.add(name)
        elif command is None:
            command = tok
        else:
            raise MinicaffeError(f"unexpected argument '{tok}' (one command at a time; "
                                 "see minicaffe --help)")
    return command, flags


def _is_number(tok):
    try:
        float(tok)
        return True
    except ValueError:
        return False


# -- devices -------------------------------------------------------------------------------
def get_gpus(flag):
    """Device ids from --gpu ('0', '0,1' or 'all'); [] when not given."""
    if flag is None or flag == "":
        return []
    if flag == "all":
        if backend.gpu_count() == 0:
            raise MinicaffeError(f"--gpu all asked for GPUs, but none is usable: "
                                 f"{backend.why_no_gpu()}")
        return list(range(backend.gpu_count()))
    try:
        ids = [int(s) for s in flag.split(",") if s.strip() != ""]
    except ValueError:
        raise MinicaffeError(f"illegal value '{flag}' specified for flag 'gpu' (use a device "
                             "id, ids separated by ',', or 'all')") from None
    if not ids or any(i < 0 for i in ids):
        raise MinicaffeError(f"illegal value '{flag}' specified for flag 'gpu'")
    return ids


def _check_gpus(gpus):
    n = backend.gpu_count()
    if gpus and n == 0:
        raise MinicaffeError(f"--gpu {','.join(map(str, gpus))} asked for a GPU, but none is "
                             f"usable: {backend.why_no_gpu()}")
    for g in gpus:
        if g >= n:
            raise MinicaffeError(f"GPU {g} requested but only {n} device(s) exist")


def _single_gpu(gpus):
    while len(gpus) > 1:
        log.info("Not using GPU #%d for single-GPU function", gpus[-1])
        gpus = gpus[:-1]
    return gpus


def _set_mode(gpus, words="Use GPU with device ID %d"):
    if gpus:
        log.info(words, gpus[0])
        context.set_device(gpus[0])
        context.set_mode_gpu()
    else:
        log.info("Use CPU.")
        context.set_mode_cpu()


def _stages(flags):
    return [s for s in flags.stage.split(",") if s] if flags.stage else []


# -- progress bar -------------------------------------------------------------------------
class _TqdmStream:
    """stderr for the log handler while a tqdm bar is shown: whole lines go through
    tqdm.write so the bar stays at the bottom."""

    def __init__(self, stream):
        self.stream = stream
        self.bar = None
        self._buf = ""

    def write(self, s):
        if self.bar is None:
            return self.stream.write(s)
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self.bar.write(line, file=self.stream)

    def flush(self):
        self.stream.flush()

    def isatty(self):
        return self.stream.isatty()


def _make_progress(stream_wrapper, solver):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    try:
        cols = os.get_terminal_size(stream_wrapper.stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        cols = 0
    # a fresh pseudo-terminal may report 0 x 0, and tqdm then draws nothing
    size = dict(dynamic_ncols=True) if cols > 0 else dict(ncols=80, nrows=24)
    bar = tqdm(total=solver.param.max_iter, initial=solver.iter, file=stream_wrapper.stream,
               unit="iter", leave=False, **size)
    stream_wrapper.bar = bar
    from .watch.progress import ProgressLine
    return ProgressLine(bar, solver)   # loss, lr, images/s, data wait beside the bar


# -- commands ------------------------------------------------------------------------------
def train(flags, stream=None):
    from .proto import caffe_pb2
    from .solvers import read_solver_param, solver_class
    from .solvers.signal_handler import SignalHandler, check_effect
    if not flags.solver:
        raise MinicaffeError("need a solver definition to train (--solver FILE)")
    if flags.snapshot and flags.weights:
        raise MinicaffeError("give a snapshot to resume training or weights to finetune, "
                             "but not both")
    check_effect(flags.sigint_effect, "sigint_effect")
    check_effect(flags.sighup_effect, "sighup_effect")
    if flags.snapshot and not os.path.isfile(flags.snapshot):
        raise MinicaffeError(f"{flags.snapshot}: no such file (--snapshot)")
    for w in [s for s in flags.weights.split(",") if s]:
        if not os.path.isfile(w):
            raise MinicaffeError(f"{w}: no such file (--weights)")
    param, path = read_solver_param(flags.solver)
    if flags.dashboard:
        from .watch.server import parse_address
        parse_address(flags.dashboard)   # a bad address fails before anything is built
    if flags.tensorboard:
        param.minicaffe_tensorboard_dir = flags.tensorboard
    param.train_state.level = flags.level
    param.train_state.stage.extend(_stages(flags))
    if flags.debug_info:
        param.debug_info = True
    if "cuda_graph" in flags.given:
        param.cuda_graph = flags.cuda_graph
    if flags.tf32:
        param.minicaffe_precision = "TF32"
    if flags.run_config.precision is not None:     # --precision: over the solver's field
        param.minicaffe_precision = flags.run_config.precision.upper()
        if flags.tf32:      # --tf32 --precision bf16: the layers left in fp32 use TF32
            flags.run_config = flags.run_config.replace(tf32=True)
    if flags.gpu is None or flags.gpu == "":
        gpus = []
        if param.solver_mode == caffe_pb2.SolverParameter.GPU:
            dev = param.device_id if param.HasField("device_id") else 0
            if backend.gpu_count() == 0:  # the README promises CPU by default: no warning
                log.info("solver_mode is GPU but no GPU is usable (%s): training on the CPU",
                         backend.why_no_gpu())
            else:
                gpus = [dev]
    else:
        gpus = get_gpus(flags.gpu)
    _check_gpus(gpus)
    from .multigpu.comm import launched_by_mpirun
    if len(gpus) > 1 or flags.rank >= 0 or flags.world_size or flags.init_file or \
            launched_by_mpirun() > 1:
        return _train_parallel(flags, param, path, gpus, stream)
    if not gpus:
        log.info("Use CPU.")
        context.set_mode_cpu()
        for f in ("cuda_graph", "tf32"):
            if f in flags.given:
                log.warning("--%s has no effect in CPU mode", f)
    else:
        log.info("Using GPUs %s", ", ".join(map(str, gpus)))
        for g in gpus:
            log.info("GPU %d: %s", g, backend.gpu_name(g))
        param.device_id = gpus[0]
        context.set_device(gpus[0])
        context.set_mode_gpu()
        context.set_solver_count(len(gpus))
    solver = solver_class(param.type, path or flags.solver)(param, source=path,
                                                            config=flags.run_config)
    dash = None
    if flags.dashboard:
        from .watch.commands import start_train_dashboard
        dash = start_train_dashboard(flags.dashboard, solver, gpus, stream)
    with SignalHandler(flags.sigint_effect, flags.sighup_effect) as handler:
        solver.set_action_function(handler.get_action)
        if flags.snapshot:
            log.info("Resuming from %s", flags.snapshot)
            solver.restore(flags.snapshot)
        elif flags.weights:
            solver.copy_weights(flags.weights)
        log.info("Starting Optimization")
        bar = None
        if isinstance(stream, _TqdmStream) and stream.isatty():
            bar = solver.progress = _make_progress(stream, solver)
        solved = False
        try:
            solver.solve()
            solved = True
        finally:
            if bar is not None:
                stream.bar = None
                bar.close()
            solver.close()  # stop the prefetch threads
            if dash is not None and not solved:
                dash.close()
    if dash is not None:
        from .watch.commands import keep_serving
        keep_serving(dash, stream)   # an interactive run's page stays up until Ctrl-C
        dash.close()
    if handler.stopped_by:
        last_iter, state_file = solver.last_snapshot or (None, None)
        if last_iter == solver.iter:
            log.result("Stopped by %s at iteration %d; resume with --snapshot %s",
                     handler.stopped_by, solver.iter, state_file)
        else:
            log.result("Stopped by %s at iteration %d; no snapshot was written "
                     "(snapshot_after_train is false)", handler.stopped_by, solver.iter)
        if handler.stopped_by == "SIGTERM":
            return 128 + signal.SIGTERM  # the status of a process SIGTERM ended
    log.info("Optimization Done.")
    return 0


def _train_parallel(flags, param, path, gpus, stream):
    """Several GPUs, or one rank of a run of one process per GPU (parallel_launch.py)."""
    from .multigpu.parallel import root_only_logging
    from .multigpu.parallel_launch import train_parallel

    def describe(ids):
        log.info("Using GPUs %s", ", ".join(map(str, ids)))
        for g in ids:
            log.info("GPU %d: %s", g, backend.gpu_name(g))
    bars = []
    dashboards = []
    if flags.dashboard and (flags.parallel == "process" or flags.rank >= 0):
        raise MinicaffeError("--dashboard serves from the training process: use it with "
                             "--parallel thread (the default), or serve the log with "
                             "`minicaffe dashboard LOG`")

    def progress(solver):   # called with the root solver (thread mode)
        if flags.dashboard and not dashboards:
            from .watch.commands import start_train_dashboard
            dashboards.append(start_train_dashboard(flags.dashboard, solver, gpus, stream))
        if isinstance(stream, _TqdmStream) and stream.isatty():
            bars.append(_make_progress(stream, solver))
            return bars[-1]
        return None
    try:
        with root_only_logging():  # a process of rank > 0 logs warnings and errors only
            train_parallel(flags, param, path, gpus, progress, describe)
            log.info("Optimization Done.")
    finally:
        context.set_solver_rank(0)
        for bar in bars:
            stream.bar = None
            bar.close()
        for d in dashboards:
            d.close()
    return 0


def test(flags):
    from .network.net import Net, TEST
    if not flags.model:
        raise MinicaffeError("need a model definition to score (--model FILE)")
    if not flags.weights:
        raise MinicaffeError("need model weights to score (--weights FILE)")
    if flags.iterations < 1:
        raise MinicaffeError("--iterations must be at least 1")
    gpus = _single_gpu(get_gpus(flags.gpu))
    _check_gpus(gpus)
    _set_mode(gpus)
    net = Net(flags.model, TEST, level=flags.level, stages=_stages(flags),
              config=flags.run_config)
    net.copy_from(flags.weights)
    log.info("Running for %d iterations.", flags.iterations)
    f32 = np.float32
    scores, score_output_id = [], []
    loss = f32(0)
    for i in range(flags.iterations):
        iter_loss = net.forward_prefilled()
        loss = f32(loss + f32(iter_loss))
        idx = 0
        for j, blob in enumerate(net.output_blobs):
            name = net.blob_names[net.output_blob_indices[j]]
            for v in np.asarray(blob.cpu_data(), dtype=np.float32).reshape(-1):
                if i == 0:
                    scores.append(f32(v))
                    score_output_id.append(j)
                else:
                    scores[idx] = f32(scores[idx] + v)
                log.info("Batch %d, %s = %s", i, name, _g(v))
                idx += 1
    loss = f32(loss / f32(flags.iterations))
    log.result("Loss: %s", _g(loss))
    for i, total in enumerate(scores):
        bid = net.output_blob_indices[score_output_id[i]]
        name = net.blob_names[bid]
        weight = f32(net.blob_loss_weights[bid])
        mean = f32(total / f32(flags.iterations))
        extra = f" (* {_g(weight)} = {_g(weight * mean)} loss)" if weight else ""
        log.result("%s = %s%s", name, _g(mean), extra)
    return 0


def time(flags):
    from .network.net import Net, TRAIN, TEST
    if not flags.model:
        raise MinicaffeError("need a model definition to time (--model FILE)")
    if flags.phase not in ("", "TRAIN", "TEST"):
        raise MinicaffeError(f"phase must be \"TRAIN\" or \"TEST\" (got '{flags.phase}')")
    if flags.iterations < 1:
        raise MinicaffeError("--iterations must be at least 1")
    phase = TEST if flags.phase == "TEST" else TRAIN
    gpus = _single_gpu(get_gpus(flags.gpu))
    _check_gpus(gpus)
    _set_mode(gpus)
    net = Net(flags.model, phase, level=flags.level, stages=_stages(flags),
              config=flags.run_config)
    gpu = context.is_gpu()
    if flags.replicas > 1:
        pool = _time_pool(net, flags)
        if pool is not None:
            return _time_replicas(net, pool, flags)
    sync = backend.synchronize if gpu else (lambda: None)
    clock = _time.perf_counter
    log.info("Performing Forward")
    initial_loss = net.forward_prefilled()
    log.info("Initial loss: %s", _g(initial_loss))
    log.info("Performing Backward")
    net.backward_from_to()
    sync()
    layers = net.layers
    n = len(layers)
    log.info("*** Benchmark begins ***")
    log.info("Testing for %d iterations.", flags.iterations)
    fwd_layer = [0.0] * n
    bwd_layer = [0.0] * n
    fwd_total = bwd_total = 0.0
    total_start = clock()
    for j in range(flags.iterations):
        iter_start = clock()
        f_start = clock()
        for i in range(n):
            t0 = clock()
            layers[i].forward(net.bottom_vecs[i], net.top_vecs[i])
            sync()
            fwd_layer[i] += (clock() - t0) * 1e6
        fwd_total += (clock() - f_start) * 1e6
        b_start = clock()
        for i in range(n - 1, -1, -1):
            t0 = clock()
            if net.layer_need_backward[i]:
                layers[i].backward(net.top_vecs[i], net.bottom_need_backward[i],
                                   net.bottom_vecs[i])
            sync()
            bwd_layer[i] += (clock() - t0) * 1e6
        bwd_total += (clock() - b_start) * 1e6
        log.info("Iteration: %d forward-backward time: %s ms.", j + 1,
                 _g(np.float32((clock() - iter_start) * 1e3)))
    sync()
    total_ms = (clock() - total_start) * 1e3
    its = flags.iterations
    log.info("Average time per layer: ")
    for i in range(n):
        name = net.layer_names[i]
        log.info("%10s\tforward: %s ms.", name, _g(fwd_layer[i] / 1000 / its))
        log.info("%10s\tbackward: %s ms.", name, _g(bwd_layer[i] / 1000 / its))
    log.result("Average Forward pass: %s ms.", _g(fwd_total / 1000 / its))
    log.result("Average Backward pass: %s ms.", _g(bwd_total / 1000 / its))
    log.result("Average Forward-Backward: %s ms.", _g(np.float32(total_ms) / its))
    log.result("Total Time: %s ms.", _g(np.float32(total_ms)))
    log.info("*** Benchmark ends ***")
    return 0


def _time_pool(net, flags):
    """The replicas of ``time --replicas N`` (engine/replicas.py), or None (one line says
    why: a GPU, or a net that cannot be split)."""
    from .engine import replicas
    return replicas.start(net, flags.replicas, flags.run_config,
                          fallback="timed in one process")


def _time_replicas(net, pool, flags):
    """``time --replicas N``: the forward-backward of the whole batch through the
    replicas (no per-layer times: the layers run in the workers)."""
    clock = _time.perf_counter
    try:
        net.clear_param_diffs()
        log.info("Initial loss: %s", _g(pool.forward_backward()))
        log.info("*** Benchmark begins ***")
        log.info("Testing for %d iterations.", flags.iterations)
        total_start = clock()
        for j in range(flags.iterations):
            t0 = clock()
            net.clear_param_diffs()
            pool.forward_backward()
            log.info("Iteration: %d forward-backward time: %s ms.", j + 1,
                     _g(np.float32((clock() - t0) * 1e3)))
        total_ms = (clock() - total_start) * 1e3
    finally:
        pool.close()
    log.info("(no per-layer times: the layers run in the %d replica processes)", pool.n)
    log.result("Average Forward-Backward (%d replicas): %s ms.", pool.n,
               _g(np.float32(total_ms) / flags.iterations))
    log.result("Total Time: %s ms.", _g(np.float32(total_ms)))
    log.info("*** Benchmark ends ***")
    return 0


_DEVICE_FIELDS = [
    ("Major revision number:         ", "major"),
    ("Minor revision number:         ", "minor"),
    ("Name:                          ", "name"),
    ("Total global memory:           ", "totalGlobalMem"),
    ("Total shared memory per block: ", "sharedMemPerBlock"),
    ("Total registers per block:     ", "regsPerBlock"),
    ("Warp size:                     ", "warpSize"),
    ("Maximum memory pitch:          ", "memPitch"),
    ("Maximum threads per block:     ", "maxThreadsPerBlock"),
    ("Maximum dimension of block:    ", "maxThreadsDim"),
    ("Maximum dimension of grid:     ", "maxGridSize"),
    ("Clock rate:                    ", "clockRate"),
    ("Total constant memory:         ", "totalConstMem"),
    ("Texture alignment:             ", "textureAlignment"),
    ("Concurrent copy and execution: ", "deviceOverlap"),
    ("Number of multiprocessors:     ", "multiProcessorCount"),
    ("Kernel execution timeout:      ", "kernelExecTimeoutEnabled"),
]
_YES_NO = {"deviceOverlap", "kernelExecTimeoutEnabled"}


def device_query(flags):
    log.info("Querying GPUs %s", flags.gpu or "")
    gpus = get_gpus(flags.gpu) if flags.gpu else [0]
    if backend.gpu_count() == 0:
        raise MinicaffeError(f"device_query needs a GPU, but none is usable: "
                             f"{backend.why_no_gpu()}")
    _check_gpus(gpus)
    for g in gpus:
        context.set_device(g)
        props = backend.device_properties(g)
        log.info("Device id:                     %d", g)
        for label, key in _DEVICE_FIELDS:
            v = props.get(key, "n/a")
            if isinstance(v, bytes):
                v = v.decode(errors="replace")
            elif isinstance(v, (tuple, list)):
                v = ", ".join(str(x) for x in v)
            elif key in _YES_NO and v != "n/a":
                v = "Yes" if v else "No"
            log.info("%s%s", label, v)
    return 0


def bench(flags):
    """Time the training step on synthetic inputs (minicaffe/bench.py)."""
    from . import bench as _bench
    if "GLOG_minloglevel" not in os.environ:  # the report is the output, not net set-up
        log.logger.setLevel(logging.WARNING)
    gpus = _single_gpu(get_gpus(flags.gpu))
    _check_gpus(gpus)
    _set_mode(gpus)
    _bench.run(flags, gpus[0] if gpus else None)
    return 0


def memory(flags):
    """Print the memory plan of a training iteration (engine/plan.py) before running anything:
    per-layer bytes, the arena, and the planned peak."""
    from .engine.plan import MemoryPlan
    from .synthetic import synthetic_solver
    if not flags.model and not flags.solver:
        raise MinicaffeError("need a model (--model FILE) or a solver (--solver FILE) to plan")
    if "GLOG_minloglevel" not in os.environ:  # the plan is the output, not net set-up
        log.logger.setLevel(logging.WARNING)
    gpus = _single_gpu(get_gpus(flags.gpu))
    _check_gpus(gpus)
    _set_mode(gpus)
    from .bench import parse_input_shape
    from .engine import offload
    kw = dict(solver=flags.solver) if flags.solver else dict(model=flags.model)
    config = flags.run_config
    # CPU mode: its host memory, measured over set-up and a step; the GPU plan with --gpu,
    # or on a machine without one when a GPU flag (--offload, --gpu_mem_limit) asks for it
    cpu = not gpus and not {"offload", "gpu_mem_limit"} & flags.given
    if cpu:
        import tracemalloc
        tracemalloc.start()
    try:
        # (building the solver must not warn that nothing trains: no offload while it is built)
        solver, info = synthetic_solver(**kw, batch=flags.batch or None,
                                        input_shape=parse_input_shape(flags.input_shape),
                                        num_classes=flags.num_classes or None,
                                        level=flags.level, stages=_stages(flags),
                                        config=config.replace(offload_policy=None,
                                                              offload_budget=None))
        if cpu:
            return _memory_cpu(solver, flags.schedule)
    finally:
        if cpu:
            tracemalloc.stop()
    net = solver.net
    net._share_workspace(config)    # the workspace an offloading net would take (--offload)
    hist = len(getattr(solver, "history_flat", [])) or 1
    policy, budget = offload.settings(net.net_param, config)     # as the GPU step plans:
    real = policy == "NONE" and not budget      # 16-bit storage unless offloaded
    plan = MemoryPlan(net, train=True, history_sets=hist, reduced_storage=real)
    shared = MemoryPlan(net, train=True, history_sets=hist, share_data=True,
                        reduced_storage=real)
    engine = ("cuDNN" if any(type(l).__name__.startswith("CuDNN") for l in net.layers)
              else "Caffe's")
    print(f"memory plan of {net.name}: batch {net.blobs[net.inputs[0]].shape[0]}, "
          f"training (forward, backward, {solver.type} update), {engine} engine"
          f"{' on GPU ' + str(gpus[0]) if gpus else ' (no GPU: cuDNN workspaces not counted)'}")
    for line in plan.report():
        print(line)
    _print_precision(net)
    mib = 1 << 20
    print(f"with the data that backward does not read sharing memory too: arena "
          f"{shared.arena_bytes / mib:.1f} MiB, peak {shared.peak / mib:.1f} MiB")
    print("the training step plans "
          + ("the latter (share_data on: minicaffe train's and bench's default)"
             if config.shares_data and real else
             "the former (" + ("share_data off: every blob keeps its data after a step, "
                               "as Caffe" if not config.shares_data else
                               "an offloading net shares no data") + ")"))
    print()
    for line in offload.memory_lines(net, hist, config):   # per offload policy (offload.py)
        print(line)
    if flags.schedule:
        policy, budget = offload.settings(net.net_param, config)
        budget = offload.resolve_budget(budget)
        oplan = None
        if policy != "NONE":
            times = offload.estimate_times(net) if policy == "DYNAMIC" else None
            oplan = offload.build(net, policy, budget, hist, times=times)
        _print_schedule(solver, oplan, real=real)
    solver.close()
    return 0


def _print_schedule(solver, oplan=None, real=True):
    """``memory --schedule``: the engine's ops of one training iteration (engine/schedule.py);
    ``real``: with the GPU step's 16-bit storage and its cast ops (the CPU rounds fp32
    buffers instead)."""
    from .engine.precision import precision_pass
    from .engine.schedule import schedule_for
    print()
    print(precision_pass(schedule_for(solver.net, solver.param.iter_size, oplan), solver.net,
                         None if real else {}))


def _memory_cpu(solver, schedule=False):
    """``minicaffe memory`` in CPU mode: each blob's host memory (numpy: one buffer per blob's
    data and diff, no arena) and the peak numpy/Python allocations over the set-up and one
    training step on the synthetic inputs, as tracemalloc measured them."""
    import tracemalloc
    net = solver.net
    mib = 1 << 20
    ids = net.blob_names
    print(f"host memory of {net.name} in CPU mode: batch {net.blobs[net.inputs[0]].shape[0]}, "
          f"training (forward, backward, {solver.type} update); numpy keeps each blob's data "
          f"and diff in buffers of their own (the GPU plan: --gpu N)")
    print(f"{'layer':<28} {'type':<18} {'top data+diff MiB':>18} {'params MiB':>11}")
    seen, params_seen = set(), set()
    tops_total = params_total = 0
    for i, layer in enumerate(net.layers):
        top = 0
        for b in net.top_vecs[i]:
            if id(b) not in seen:
                seen.add(id(b))
                top += 2 * b.count() * b.dtype.itemsize
        par = 0
        for b in layer.blobs:
            if id(b) not in params_seen:
                params_seen.add(id(b))
                par += 2 * b.count() * b.dtype.itemsize
        tops_total += top
        params_total += par
        print(f"{net.layer_names[i]:<28} {layer.type:<18} {top / mib:>18.2f} {par / mib:>11.2f}")
    hist_sets = len(getattr(solver, "history_flat", []))
    history = hist_sets * sum(b.count() * b.dtype.itemsize for b in net.learnable_params)
    print()
    print(f"blobs (data and diff): {tops_total / mib:.1f} MiB")
    print(f"parameters and their diffs: {params_total / mib:.1f} MiB; solver history "
          f"({hist_sets} set(s)): {history / mib:.1f} MiB")
    before, _ = tracemalloc.get_traced_memory()
    solver.step(1)
    after, peak = tracemalloc.get_traced_memory()
    print(f"measured (tracemalloc, numpy buffers and Python objects): {before / mib:.1f} MiB "
          f"after set-up, {after / mib:.1f} MiB after one training step, peak {peak / mib:.1f} "
          f"MiB (the rest of the peak is scratch: im2col columns, temporaries)")
    _print_precision(net)
    if schedule:
        _print_schedule(solver, real=False)
    solver.close()
    return 0


def _print_precision(net):
    """``memory --precision``: the storage types the net resolved (core/precision.py).
    On the CPU the blobs are fp32 buffers holding the reduced type's values; the GPU
    step's plan holds them in 2-byte words (docs/precision.md): the listing says which
    layers run on them and which between cast ops."""
    t = net.types
    if not t.reduced:
        return
    full = sum(b.count() * 4 for b in net.blobs.values())
    reduced = sum(t.bytes_of(n, b.count()) for n, b in net.blobs.items())
    print(f"precision {t.precision or 'from the net'}: {t.describe()}")
    print(f"feature-map data in its storage types: {reduced / (1 << 20):.1f} MiB (the CPU and "
          f"a net outside the GPU step hold fp32 buffers: {full / (1 << 20):.1f} MiB)")
    for line in t.lines():
        print("  " + line)
    from .engine.precision import storage_lines
    for line in storage_lines(net):
        print(line)


def _g(x):
    return "%g" % float(x)


# -- flags checked up front ------------------------------------------------------------------
def _at_least(flags, name, low, why=""):
    if name in flags.given and getattr(flags, name) < low:
        raise MinicaffeError(f"--{name} must be at least {low}{why} (got "
                             f"{getattr(flags, name)})")


def _glog_env(var, low, high):
    value = os.environ.get(var)
    if value is None or value.strip() == "":
        return
    try:
        ok = low <= int(value) <= high
    except ValueError:
        ok = False
    if not ok:
        raise MinicaffeError(f"{var}={value!r}: must be a whole number from {low} to {high}")


def validate(command, flags):
    """Every flag of ``command`` checked before anything runs or is written: a wrong value,
    or a flag the command does not take, is one line naming the flag."""
    from .solvers.signal_handler import check_effect
    from .core.threads import check_threads
    allowed = COMMAND_FLAGS[command]
    for name in sorted(flags.given):
        if name not in allowed:
            raise MinicaffeError(f"--{name} is not a flag of '{command}' (its flags: "
                                 f"minicaffe {command} --help)")
    if "threads" in flags.given:
        check_threads(flags.threads)
    if "replicas" in flags.given:
        config.check_replicas(flags.replicas)
    if "minloglevel" in flags.given and not 0 <= flags.minloglevel <= 3:
        raise MinicaffeError(f"--minloglevel must be 0 (INFO), 1 (WARNING), 2 (ERROR) or "
                             f"3 (FATAL) (got {flags.minloglevel})")
    _glog_env("GLOG_minloglevel", 0, 3)
    _glog_env("GLOG_v", 0, 9)
    _at_least(flags, "iterations", 1)
    _at_least(flags, "repeats", 1)
    if "warmup" in flags.given and flags.warmup < 0:
        raise MinicaffeError(f"--warmup must not be negative (got {flags.warmup})")
    _at_least(flags, "num_classes", 1)
    _at_least(flags, "world_size", 1)
    _at_least(flags, "rank", 0)
    if "gpu_mem_limit" in flags.given:
        flags.gpu_mem_limit = config.parse_gpu_mem_limit(flags.gpu_mem_limit)
    if "batch" in flags.given:
        _at_least(flags, "batch", 1, " (leave it out for the model's own batch)")
        if flags.batch > MAX_BATCH:
            raise MinicaffeError(f"--batch {flags.batch} is too large (at most {MAX_BATCH}: "
                                 "Caffe's blob sizes are 32-bit)")
    if flags.phase not in ("", "TRAIN", "TEST"):
        raise MinicaffeError(f"phase must be \"TRAIN\" or \"TEST\" (got '{flags.phase}')")
    if command == "train":
        check_effect(flags.sigint_effect, "sigint_effect")
        check_effect(flags.sighup_effect, "sighup_effect")
    if "parallel" in flags.given:
        from .multigpu.parallel_launch import MODES
        if flags.parallel not in MODES:
            raise MinicaffeError(f"--parallel must be thread or process (got "
                                 f"'{flags.parallel}')")
    if flags.compare not in ("", "torch"):
        raise MinicaffeError(f"--compare {flags.compare}: only 'torch' can be compared")
    if flags.offload:
        from .engine.offload import parse_policy
        parse_policy(flags.offload)
    if flags.input_shape:
        from .bench import parse_input_shape
        parse_input_shape(flags.input_shape)
    if command == "train" and flags.snapshot and flags.weights:
        raise MinicaffeError("give a snapshot to resume training or weights to finetune, "
                             "but not both")
    if command in ("bench", "memory") and flags.model and flags.solver:
        raise MinicaffeError("give --model or --solver, not both")
    if flags.gpu not in (None, ""):
        _check_gpus(get_gpus(flags.gpu))   # the spelling and the devices
    files = [("solver", flags.solver), ("snapshot", flags.snapshot)]
    files += [("model", m) for m in flags.model.split(",") if m] if command == "bench" else \
        [("model", flags.model)]
    files += [("weights", w) for w in flags.weights.split(",") if w]
    for name, path in files:         # before the log file is opened
        if path and name in allowed and not os.path.isfile(path):
            raise MinicaffeError(f"{path}: no such file" + ("" if name in ("solver", "model")
                                                            else f" (--{name})"))


# -- main ------------------------------------------------------------------------------------
def _log_error_to_files(msg):
    for h in log.logger.handlers:
        if isinstance(h, logging.FileHandler):
            rec = log.logger.makeRecord(log.logger.name, logging.ERROR, "cli.py", 0, msg, (),
                                        None)
            rec.thread_native = 0
            h.handle(rec)


def main(argv=None):
    """Run ``minicaffe <command> <flags>``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    showwarning = warnings.showwarning
    try:
        return _main(argv)
    except (MinicaffeError, OSError, ValueError) as e:
        if _traceback_wanted():
            raise
        msg = str(e).replace("\n", " ").strip() or type(e).__name__
        if isinstance(e, OSError) and not isinstance(e, MinicaffeError):
            msg = f"{e.filename + ': ' if getattr(e, 'filename', None) else ''}" \
                  f"{e.strerror or msg}"
        _log_error_to_files(msg)
        _flush_log()
        print(f"minicaffe: error: {msg}", file=sys.stderr)
        return 1
    except MemoryError as e:      # numpy's _ArrayMemoryError: a batch too large for the host
        if os.environ.get("MINICAFFE_TRACEBACK"):
            raise
        what = str(e).replace("\n", " ").strip()
        msg = (f"out of host memory ({what or 'MemoryError'}); "
               f"try a smaller --batch or a smaller model")
        _log_error_to_files(msg)
        _flush_log()
        print(f"minicaffe: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _flush_log()
        print("minicaffe: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = showwarning


def _warning_to_log(message, category, filename, lineno, file=None, line=None):
    """Python warnings (numpy overflow...) as glog lines, so logs stay parseable."""
    log.warning("%s: %s (%s:%d)", category.__name__, message, os.path.basename(filename), lineno)


def _flush_log():
    for h in log.logger.handlers:
        try:
            h.flush()
        except Exception:
            pass


def _traceback_wanted():
    try:
        return config.env("MINICAFFE_TRACEBACK")
    except MinicaffeError:
        return False


def _run_tool(name, argv):
    """A command with positional arguments (draw, dashboard, plot, extract_features, upgrade_*)."""
    import importlib
    module, _, func = TOOLS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), func or "main")(list(argv))
    except SystemExit as e:  # argparse: --help (0), or a usage error it printed (2)
        return e.code if isinstance(e.code, int) else 1


def _main(argv):
    config.check_environment()     # a bad MINICAFFE_* value: one line, before anything runs
    if argv and argv[0] in TOOLS:  # Caffe's separate tools (and pycaffe's draw_net.py)
        return _run_tool(argv[0], argv[1:])
    command, flags = parse_args(argv)
    if command == "help":
        if getattr(flags, "help_command", None):
            print(command_help(flags.help_command), end="")
        else:
            print(USAGE, end="")
        return 0
    if command == "version":
        from . import __version__
        print(f"minicaffe {__version__}")
        return 0
    if command is None:
        print(USAGE, end="", file=sys.stderr)
        return 1
    if command not in COMMANDS:
        raise MinicaffeError(f"unknown action: {command} (available: {', '.join(ACTIONS)})")
    validate(command, flags)
    stream = _TqdmStream(sys.stderr) if command == "train" else sys.stderr
    if flags.log:
        d = os.path.dirname(os.path.abspath(flags.log))
        if not os.path.isdir(d):
            raise MinicaffeError(f"{flags.log}: cannot write the log there (no folder {d})")
        open(flags.log, "w").close()  # a new log per run, as glog starts a new file
    level = log._LEVELS[flags.minloglevel] if "minloglevel" in flags.given else None
    log.init_log(level, log_file=flags.log or None, stream=stream,
                 volume="quiet" if flags.quiet else "caffe")
    warnings.showwarning = _warning_to_log
    from .core import threads
    with threads.limit(flags.threads if "threads" in flags.given else None):
        if command in ("train", "test", "time"):
            count, var = threads.describe()
            log.info("CPU threads for numpy's BLAS: %s%s", count,
                     " (--threads)" if "threads" in flags.given else
                     f" (from {var})" if var else " (the default; --threads N to change)")
        return _run_command(command, flags, argv, stream)


def _share_data(command, flags):
    """--share_data as given; else MINICAFFE_SHARE_DATA where set (None: the RunConfig
    reads it); else on for the commands that train without user code reading the net's
    blobs after a step (train, bench, memory's plan of them)."""
    import os
    if "share_data" in flags.given:
        return bool(flags.share_data)
    if "MINICAFFE_SHARE_DATA" in os.environ:
        return None
    return True if command in ("train", "bench", "memory") else None


def _run_command(command, flags, argv, stream):
    from .core.config import RunConfig
    # the run's settings, handed to every solver and net this command builds (config.py)
    flags.run_config = RunConfig.from_environment(
        offload_policy=flags.offload or None,
        offload_budget=flags.gpu_mem_limit if "gpu_mem_limit" in flags.given else None,
        **({"data_workers": flags.data_workers} if "data_workers" in flags.given else {}),
        gpu_decode=bool(flags.gpu_decode), precision=flags.precision or None,
        cpu_replicas=flags.replicas,        # "auto" is resolved (and said) there
        share_data=_share_data(command, flags))
    flags.replicas = flags.run_config.cpu_replicas
    if command == "train":
        rc = train(flags, stream)
    else:
        flags.argv = list(argv)
        rc = {"test": test, "time": time, "device_query": device_query,
              "bench": bench, "memory": memory}[command](flags)
    failed = log.log_file_failure()
    if failed:
        why = getattr(failed[1], "strerror", None) or failed[1]
        raise MinicaffeError(f"{flags.log}: cannot write the log ({why}); it is incomplete")
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
