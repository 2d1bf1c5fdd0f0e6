"""One run's configuration, and the MINICAFFE_* environment variables, read in one place.

``RunConfig`` is a frozen dataclass: the settings of one run that used to travel through
process globals.  The CLI (from its flags) or a Python user builds one and hands it to
the Solver, which hands it to its Nets, which hand it to their layers (``Layer.config``):

- ``tf32``: the GPU math of this run's nets (cuDNN convolutions and cuBLAS GEMMs may use
  TensorFloat-32); a solver's ``minicaffe_precision`` sets it for that solver's nets only;
- ``precision``: ``fp32``, ``tf32``, ``bf16`` or ``fp16`` (``--precision``, the solver's
  ``minicaffe_precision``): the storage type of every layer that does not set its own
  (core/precision.py's rules); None: the nets' own NVIDIA Caffe type fields (fp32 when
  unset).  ``tf32`` sets ``tf32``; ``fp32`` clears it;
- ``offload_policy`` / ``offload_budget``: the command line's ``--offload`` and
  ``--gpu_mem_limit``, which override every net's ``offload_param`` (None: the net's own);
  a budget is bytes, or ``"auto"`` / ``"N%"`` resolved on the device when the step is
  planned (``parse_gpu_mem_limit``, ``budget_bytes``);
- ``cuda_graphs``: None keeps the solver's ``cuda_graph`` field; True/False overrides it;
- ``workspace_limit``: bytes of workspace cuDNN's Find may try (None: the default rule);
- ``rank``, ``world_size``: this solver's place in a data-parallel run (its data layers
  read that shard), in place of the order-dependent ``set_solver_count`` global;
- ``data_workers``: worker processes per Data/ImageData layer (``--data_workers``, else
  MINICAFFE_DECODE_THREADS; None: the layer's ``data_param.workers`` or the default);
- ``gpu_decode``: GPU mode decodes the JPEGs of Data/ImageData layers on the GPU with
  nvImageCodec (``--gpu_decode``; False: the CPU workers decode, the default);
- ``cpu_replicas``: CPU mode: the training iteration's batch split across this many
  worker processes of one thread each, their gradients summed before one update
  (``--replicas N``; engine/replicas.py; 1, the default: one process; ``"auto"``:
  ``auto_replicas()``, the usable CPUs less one (2 on two), logged once).  Ignored on a GPU.

Caffe has no such object (its settings are flags and the process-wide ``Caffe`` singleton);
PyTorch keeps them in ``torch.backends`` flags.  Unset fields take the environment's values
(``RunConfig.from_environment()``), and ``gpu.options`` stays the process default that a
Python user may set (as ``torch.backends.cuda.matmul.allow_tf32``) before building nets.

Environment variables are overrides read here and nowhere else (``env(name)``), each one
validated: a bad value raises ConfigError naming the variable, the value and what is
accepted, and the CLI checks them all before it does anything (``check_environment``).
The table ``VARIABLES`` is their documentation (docs/cli.md lists it).
"""
import dataclasses
import os

from .errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(text):
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError


def _count(text):
    n = int(text.strip())
    if n < 0:
        raise ValueError
    return n


def _bytes(text):
    v = float(text.strip())
    if not v >= 0 or v != v or v == float("inf"):
        raise ValueError
    return int(v)


def _allocator(text):
    t = text.strip().lower()
    if t not in ("async", "default"):
        raise ValueError
    return t


def _file(text):
    if not os.path.isfile(text):
        raise ValueError
    return text


def _folder(text):
    if not os.path.isdir(text):
        raise ValueError
    return text


# name -> (parser, what is accepted, default when unset or empty, what it does)
VARIABLES = {
    "MINICAFFE_TF32": (_bool, "1/0, true/false, yes/no, on/off", False,
                       "default GPU math: TF32 tensor cores for float32 (off: strict fp32)"),
    "MINICAFFE_DETERMINISTIC": (_bool, "1/0, true/false, yes/no, on/off", False,
                                "only cuDNN algorithms that give the same bits run to run"),
    "MINICAFFE_CUDNN": (_bool, "1/0, true/false, yes/no, on/off", True,
                        "0 forbids the cuDNN engine (every layer takes Caffe's)"),
    "MINICAFFE_CUDNN_WORKSPACE_LIMIT": (_bytes, "a number of bytes >= 0 (e.g. 0, 1e9)", None,
                                        "most workspace cuDNN's Find may try"),
    "MINICAFFE_SHARE_DATA": (_bool, "1/0, true/false, yes/no, on/off", False,
                             "the GPU training step lets blob data that no backward reads "
                             "share memory (1); off: every blob keeps its data after a step, "
                             "as Caffe (pycaffe reads net.blobs); minicaffe train and bench "
                             "turn it on (--noshare_data: off)"),
    "MINICAFFE_CHANNELS_LAST": (_bool, "1/0, true/false, yes/no, on/off", True,
                                "bf16/fp16 on the GPU: 2-byte feature maps held channels-last"
                                " (NHWC) inside the engine (on by default; 0: NCHW)"),
    "MINICAFFE_CONV_GEMM": (_bool, "1/0, true/false, yes/no, on/off", None,
                            "1x1 convolutions in channels-last as cuBLAS GEMMs: always (1), "
                            "never (0); unset: where timed faster than cuDNN"),
    "MINICAFFE_CONV_DIRECT": (_bool, "1/0, true/false, yes/no, on/off", None,
                              "the filter gradient of channels-last bf16/fp16 convolutions "
                              "over at most 4 input channels by minicaffe's direct kernels: "
                              "always (1), never (0); unset: where timed faster than cuDNN"),
    "MINICAFFE_ONE_WEIGHT_CAST": (_bool, "1/0, true/false, yes/no, on/off", None,
                                  "the bf16/fp16 training step casts every weight copy in one "
                                  "launch at its start: always (1), never (0: each layer "
                                  "casts its own); unset: where the copies total at most "
                                  "16 MiB"),
    "MINICAFFE_CONV_PAD8": (_bool, "1/0, true/false, yes/no, on/off", False,
                            "a first convolution's input channels (fewer than 8) padded with "
                            "zeros to 8 in channels-last for its forward and filter "
                            "gradient (1); off by default"),
    "MINICAFFE_FUSE_BN_RELU": (_bool, "1/0, true/false, yes/no, on/off", True,
                               "the fused type BatchNorm+Scale+ReLU (on by default; 0: "
                               "BatchNorm+Scale, then the ReLU apart)"),
    "MINICAFFE_CUDNN_LIBRARY": (_file, "the path of an existing libcudnn.so file", None,
                                "the cuDNN library to load first"),
    "MINICAFFE_GPU_ALLOCATOR": (_allocator, "async or default", "async",
                                "the GPU allocator: stream-ordered pool or CuPy's cache"),
    "MINICAFFE_DECODE_THREADS": (_count, "an integer >= 0 (0: read in the prefetch thread)",
                                 None, "worker processes that read and decode each Data/"
                                 "ImageData layer's records (unset: from the cores)"),
    "MINICAFFE_MNIST_DIR": (_folder, "an existing folder", None,
                            "a folder holding MNIST's four files, tried first when fetching"),
    "MINICAFFE_TRACEBACK": (_bool, "1/0, true/false, yes/no, on/off", False,
                            "the CLI shows Python's traceback instead of one error line"),
    "MINICAFFE_LAUNCHED": (_bool, "1/0, true/false, yes/no, on/off", False,
                           "set by the process-mode launcher in the processes it starts"),
}


def env(name):
    """The parsed value of environment variable ``name`` (its default when unset or
    empty); ConfigError naming the variable and what it accepts when the value is bad."""
    parse, accepted, default, _ = VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return parse(raw)
    except (ValueError, TypeError, OverflowError):
        raise ConfigError(f"environment variable {name}={raw!r} is not valid: "
                          f"accepted values are {accepted}") from None


# The process defaults of the GPU math that a Python user may set before building nets
# (gpu/options.py names them: ``options.tf32``, ``set_tf32``...), each from its variable
# on first use.  Kept here, not in gpu/, so that ``RunConfig.from_environment`` reads them
# without importing a level above the core.
_DEFAULT_VARIABLES = {"tf32": "MINICAFFE_TF32", "deterministic": "MINICAFFE_DETERMINISTIC",
                      "cudnn": "MINICAFFE_CUDNN"}
_defaults = {}


def default(name):
    """The process default ``name`` (tf32, deterministic, cudnn): set from Python, else
    its MINICAFFE_* variable."""
    if name not in _defaults:
        _defaults[name] = env(_DEFAULT_VARIABLES[name])
    return _defaults[name]


def set_default(name, on):
    if name not in _DEFAULT_VARIABLES:
        raise KeyError(name)
    _defaults[name] = bool(on)


def check_environment():
    """Validate every MINICAFFE_* variable that is set (the CLI calls this first); an
    unknown MINICAFFE_ name is an error too (a misspelt variable would do nothing)."""
    for name in sorted(os.environ):
        if name.startswith("MINICAFFE_") and name not in VARIABLES:
            raise ConfigError(f"environment variable {name} is not one of minicaffe's: "
                              f"{', '.join(sorted(VARIABLES))}")
    for name in VARIABLES:
        env(name)


OFFLOAD_POLICIES = ("NONE", "ALL", "CONV", "DYNAMIC")


def parse_offload_policy(text):
    """'all' -> 'ALL'; a MinicaffeError for anything not a policy (engine/offload.py's
    ``parse_policy``; here so that the core does not import the engine)."""
    name = str(text).strip().upper()
    if name not in OFFLOAD_POLICIES:
        raise ConfigError(f"unknown offload policy '{text}' (NONE, ALL, CONV or DYNAMIC)")
    return name


# --gpu_mem_limit: sizes with units, a share of the device's memory, or what it has free
_SIZE_UNITS = {"": 1, "b": 1,
               "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
               "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
# ``auto``: the device's free memory when the step is planned, plus what this process's
# allocator already holds in use (parameters the plan counts, blobs the arena replaces),
# less this margin (CUDA graphs' pools, a test net, cuDNN's Find, other processes)
AUTO_MARGIN_SHARE = 0.05
AUTO_MARGIN_MIN = 512 << 20


def parse_gpu_mem_limit(text):
    """A device memory budget as written on the command line or given to RunConfig:
    bytes as a whole number (``12000000000``, ``12e9``: the old spelling), a size with a
    unit (``12GiB``, ``12000MiB``, ``12GB`` -- KB/MB/GB/TB are powers of 1000,
    KiB/MiB/GiB/TiB and the one letters K/M/G/T powers of 1024, as docker's --memory),
    a share of the device's total memory (``60%``) or ``auto`` (what the device has
    free, less a margin).  Returns int bytes, ``"auto"`` or ``"N%"`` (resolved by
    ``budget_bytes`` on the device); 0 means no budget.  A ConfigError naming
    --gpu_mem_limit for anything else."""
    if isinstance(text, bool):
        raise ConfigError(f"--gpu_mem_limit {text!r}: give a size like 12GiB, a share of "
                          "the device like 60%, or auto")
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = repr(text)
    t = str(text).strip().lower().replace(" ", "").replace("_", "")
    bad = ConfigError(f"--gpu_mem_limit {text!r}: give a size like 12GiB or 12000MiB (or "
                      "bytes), a share of the device like 60%, or auto")
    if t == "auto":
        return "auto"
    if t.endswith("%"):
        try:
            share = float(t[:-1])
        except ValueError:
            raise bad from None
        if not 0 < share <= 100:
            raise ConfigError(f"--gpu_mem_limit {text!r}: a share of the device's memory "
                              "must be above 0% and at most 100%")
        return f"{share:g}%"
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in _SIZE_UNITS or not num:
        raise bad
    try:
        value = float(num)
    except ValueError:
        raise bad from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"--gpu_mem_limit must be at least 0 bytes (got {text!r})")
    n = value * _SIZE_UNITS[unit]
    if unit in ("", "b") and n != int(n):
        raise ConfigError(f"--gpu_mem_limit {text!r}: a number alone is bytes (whole); a "
                          "share of the device is written 60%")
    return int(n)


def budget_bytes(spec, free, total, held=0):
    """The bytes of a parsed budget (``parse_gpu_mem_limit``) on a device with ``free``
    and ``total`` bytes, this process's allocator holding ``held`` bytes in use."""
    if spec == "auto":
        margin = max(AUTO_MARGIN_MIN, int(AUTO_MARGIN_SHARE * total))
        return max(1, int(free) + int(held) - margin)
    if isinstance(spec, str) and spec.endswith("%"):
        return max(1, int(float(spec[:-1]) / 100 * total))
    return int(spec)


def describe_budget(spec):
    """How a parsed budget reads in a message: '12.00 GiB', 'auto', '60%'."""
    return spec if isinstance(spec, str) else f"{int(spec) / (1 << 30):.2f} GiB"


def offload_settings(net_param, config=None):
    """(policy name, budget bytes) of a NetParameter's ``offload_param`` under a run's
    ``config`` (``offload_policy``/``offload_budget``: the command line's ``--offload`` and
    ``--gpu_mem_limit``), which overrides each field it sets.  A budget with no policy
    named anywhere (neither ``--offload`` nor ``offload_param { policy }``) is DYNAMIC's:
    the net trains within it, offloading only what must move.  Here, not in offload.py,
    so that the Net reads its settings without importing the offload engine."""
    from ..proto import caffe_pb2
    p = net_param.offload_param
    over_policy = config.offload_policy if config is not None else None
    over_budget = config.offload_budget if config is not None else None
    policy = over_policy or caffe_pb2.OffloadParameter.Policy.Name(p.policy)
    budget = over_budget if over_budget is not None else int(p.gpu_memory_budget)
    if budget and not over_policy and not p.HasField("policy"):
        policy = "DYNAMIC"     # a budget alone: fit it, offloading what must move
    return policy, budget


def usable_cpus():
    """The CPUs this process may run on: its affinity mask (``os.sched_getaffinity``, which
    a container's or ``taskset``'s limit narrows), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_replicas(cpus=None):
    """``--replicas auto``: the usable CPUs (``usable_cpus()``) less one for the main
    process, except on two CPUs, where it is 2 (and on one, 1: one process, no workers).
    Measured (docs/performance.md, "On 16 cores" and the 2-CPU paragraph after it): on the
    16-CPU Xeon 16 replicas beside the main process lost a CPU each step (1.0-1.4 workers
    preempted; LeNet's step 9.5 ms), 15 seldom (0.23; 5.9 ms); on the 2-CPU machine 3
    replicas likewise (1.5 preempted, 10.1-10.6 ms), while 2 were preempted 0.3 times a
    step and took 6.7-7.0 ms against one process's 10.5-10.8."""
    cpus = usable_cpus() if cpus is None else int(cpus)
    return max(1, cpus if cpus <= 2 else cpus - 1)


_REPLICAS_EXPECTED = ("expected a whole number of worker processes, at least 1 (1: one "
                      "process), or auto (the usable CPUs less one for the main process)")


def check_replicas(n, what="--replicas"):
    """``n`` (CPU worker processes of one training iteration) as a positive int, or a
    ConfigError naming ``what``.  ``"auto"`` is ``auto_replicas()``."""
    if isinstance(n, str):
        if n.strip().lower() == "auto":
            return auto_replicas()
        try:
            n = int(n.strip())
        except ValueError:
            raise ConfigError(f"{what} {n!r}: {_REPLICAS_EXPECTED}") from None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{what} {n!r}: {_REPLICAS_EXPECTED}")
    limit = 4 * (os.cpu_count() or 1)
    if n > limit:
        raise ConfigError(f"{what} {n}: more than 4x this machine's {os.cpu_count()} CPU(s)")
    return n


def describe_auto_replicas():
    """The line that says what ``--replicas auto`` resolved to here."""
    cpus = usable_cpus()
    n = auto_replicas(cpus)
    if n == 1:
        return "replicas: auto = 1 (1 CPU: one process, no workers)"
    if n == cpus:
        return (f"replicas: auto = {n} ({cpus} CPUs: with two workers the main process "
                "mostly waits)")
    return f"replicas: auto = {n} ({cpus} CPUs, one for the main process)"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run's settings (see the module docstring); ``replace(**changes)`` makes a copy."""
    tf32: bool = False
    offload_policy: str = None
    offload_budget: int = None
    cuda_graphs: bool = None
    workspace_limit: int = None
    rank: int = 0
    world_size: int = 1
    data_workers: int = None
    gpu_decode: bool = False
    precision: str = None
    channels_last: bool = None
    cpu_replicas: int = 1
    share_data: bool = None

    def __post_init__(self):
        if isinstance(self.cpu_replicas, str) and self.cpu_replicas.strip().lower() == "auto":
            from . import log
            log.info("%s", describe_auto_replicas())
        object.__setattr__(self, "cpu_replicas", check_replicas(self.cpu_replicas))
        if self.precision is not None:
            from .precision import parse_precision
            prec = parse_precision(self.precision)
            object.__setattr__(self, "precision", prec)
            if prec in ("fp32", "tf32"):
                object.__setattr__(self, "tf32", prec == "tf32")
        if self.share_data is not None and not isinstance(self.share_data, bool):
            raise ConfigError(f"share_data={self.share_data!r}: expected True, False or None "
                              "(MINICAFFE_SHARE_DATA)")
        if not isinstance(self.gpu_decode, bool):
            raise ConfigError(f"gpu_decode={self.gpu_decode!r}: expected True or False "
                              "(--gpu_decode decodes JPEGs on the GPU in GPU mode)")
        if self.offload_policy is not None:
            object.__setattr__(self, "offload_policy",
                               parse_offload_policy(self.offload_policy))
        if self.data_workers is not None and int(self.data_workers) < 0:
            raise ConfigError(f"--data_workers {self.data_workers}: expected the number of "
                              "data worker processes (0 reads in the prefetch thread)")
        if self.offload_budget is not None:
            object.__setattr__(self, "offload_budget", parse_gpu_mem_limit(self.offload_budget))

    @classmethod
    def from_environment(cls, **fields):
        """A RunConfig whose unset fields take the process defaults: ``gpu.options.tf32``
        (MINICAFFE_TF32 unless set from Python), MINICAFFE_CUDNN_WORKSPACE_LIMIT, and this
        thread's ``solver_count``/``solver_rank`` (pycaffe's ``set_solver_count`` before
        building a solver, as in Caffe)."""
        from . import context
        fields.setdefault("tf32", default("tf32"))
        fields.setdefault("world_size", context.solver_count())
        fields.setdefault("rank", context.solver_rank())
        fields.setdefault("workspace_limit", env("MINICAFFE_CUDNN_WORKSPACE_LIMIT"))
        fields.setdefault("data_workers", env("MINICAFFE_DECODE_THREADS"))
        fields.setdefault("channels_last", env("MINICAFFE_CHANNELS_LAST"))
        return cls(**fields)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    @property
    def shares_data(self):
        """True when the GPU training step's memory plan lets blob data that no backward
        reads share memory (``share_data``; unset: MINICAFFE_SHARE_DATA, off by default:
        every blob keeps its data after a step, as Caffe's)."""
        return bool(env("MINICAFFE_SHARE_DATA") if self.share_data is None
                    else self.share_data)

    @property
    def nhwc(self):
        """True when bf16/fp16 feature maps are held channels-last on the GPU
        (``channels_last``; unset: MINICAFFE_CHANNELS_LAST, on by default)."""
        return bool(env("MINICAFFE_CHANNELS_LAST") if self.channels_last is None
                    else self.channels_last)

    @property
    def offloads(self):
        """True when feature maps are offloaded: a policy other than NONE, or a budget.
        A layer's config carries its net's settings (the Net resolves ``offload_param``
        against the run's override), so this is the layer's net's answer (cuDNN's Find
        takes less scratch in such a net)."""
        return self.offload_policy not in (None, "NONE") or bool(self.offload_budget)
