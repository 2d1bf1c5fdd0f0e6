"""The Solver: Caffe's ``solver.cpp`` (nets, the training loop, tests, snapshots).

``Solver(param)`` builds the train net (one of net / net_param / train_net /
train_net_param, in phase TRAIN, with ``train_state`` merged in) and on the root
solver the test nets (test_net / test_net_param, then the generic net once per
remaining test_iter, in phase TEST).  ``solve()`` runs ``step(max_iter - iter)``,
snapshots at the end (snapshot_after_train) and prints the final loss and tests;
``step(n)`` is Caffe's ``Solver::Step``: clear the param diffs, test every
test_interval, forward-backward iter_size times, smooth and display the loss,
``on_gradients_ready`` callbacks, ``apply_update``, snapshot every ``snapshot``
iterations, and obey action requests (SIGINT/SIGHUP in the CLI).

Subclasses (``sgd_solvers.py``) implement ``apply_update``, ``snapshot_solver_state``
and ``restore_solver_state``.  Only the root solver (``context.root_solver()``)
logs, tests and snapshots.
"""
import contextlib
import math
import os
import time

import numpy as np

from ..core import context, fileio, log, observers
from ..core.errors import ConfigError, MinicaffeError, WaitInterrupted
from ..network.net import Net, read_net_param
from ..proto import caffe_pb2
from . import lr_policy, snapshot as snap
from .param import check_solver_param, read_solver_param

TRAIN = caffe_pb2.TRAIN
TEST = caffe_pb2.TEST
_f = np.float32


class SolverAction:
    """What an action request asks for (Caffe's SolverAction::Enum)."""
    NONE = "none"
    STOP = "stop"
    SNAPSHOT = "snapshot"


class NonFiniteLossError(MinicaffeError):
    """The training loss became NaN or infinite."""


def _fmt(x):
    """A number as C++ iostream prints it by default (6 significant digits)."""
    return "%g" % float(x)


class _FunctionCallback:
    """pycaffe's add_callback(on_start, on_gradients_ready) as a callback object."""

    def __init__(self, on_start, on_gradients_ready):
        self.on_start = on_start
        self.on_gradients_ready = on_gradients_ready


class Solver:
    """Base solver.  ``Solver(file_or_param)``; pycaffe surface: ``net``,
    ``test_nets``, ``iter``, ``step(n)``, ``solve(resume_file=None)``,
    ``restore(path)``, ``snapshot()``, ``add_callback(obj)``."""

    type = None

    def __init__(self, param, source=None, config=None):
        self.param, path = read_solver_param(param)
        if config is None:
            from ..core.config import RunConfig
            config = RunConfig.from_environment()
        self.config = config      # the run's settings, handed to every net (config.py)
        path = path or (os.fspath(source) if source else None)
        self.source = path or "<solver>"
        self._solver_dir = os.path.dirname(os.path.abspath(path)) if path else None
        self.callbacks = []
        # watchers of the run (minicaffe/watch): on_display, on_test, on_snapshot, on_finish
        self.observers = []
        self.action_request_function = None
        self.requested_early_exit = False
        self.progress = None  # an object with update(n) (the CLI's tqdm bar)
        self.iter = 0
        self.current_step = 0
        self.losses = []
        self.smoothed_loss = _f(0)
        self.iterations_last = 0
        # share of the last display interval the training thread waited for input (data
        # layers with a prefetch thread); None when unknown (no such layer, no interval yet)
        self.data_wait_share = None
        self._said_bottleneck = False
        self.last_snapshot = None  # (iter, solver state file) of the last snapshot
        self.net = None
        self.test_nets = []
        self._init()

    # -- construction -------------------------------------------------------------------
    @property
    def root(self):
        return context.root_solver()

    def _init(self):
        p = self.param
        if self.root:
            log.info("Initializing solver from parameters: \n%s", _debug_string(p))
        if p.average_loss < 1:
            raise ConfigError(f"{self.source}: average_loss should be at least 1")
        if p.iter_size < 1:
            raise ConfigError(f"{self.source}: iter_size should be at least 1")
        if p.regularization_type not in ("L1", "L2"):
            raise ConfigError(f"{self.source}: unknown regularization_type "
                              f"'{p.regularization_type}' (L1 or L2)")
        lr_policy.check_policy(p, self.source)
        prec = p.minicaffe_precision.upper()
        if prec not in ("FLOAT", "FP32", "TF32", "BF16", "BFLOAT16", "FP16", "FLOAT16"):
            raise ConfigError(f"{self.source}: minicaffe_precision must be \"FLOAT\" (strict "
                              f"fp32), \"TF32\", \"BF16\" or \"FP16\", got "
                              f"\"{p.minicaffe_precision}\"")
        if p.HasField("minicaffe_precision"):   # this solver's nets only
            from ..core.precision import parse_precision
            self.config = self.config.replace(
                precision=parse_precision("fp32" if prec == "FLOAT" else prec))
            if self.root:
                from ..gpu import options
                log.info("GPU math: %s; precision %s", options.describe(self.config.tf32),
                         self.config.precision)
        if p.solver_data_type not in (caffe_pb2.FLOAT, caffe_pb2.FLOAT16, caffe_pb2.BFLOAT16):
            raise ConfigError(f"{self.source}: solver_data_type "
                              f"{caffe_pb2.Type.Name(p.solver_data_type)} is not supported "
                              "(FLOAT; FLOAT16 and BFLOAT16 are read as FLOAT)")
        if p.solver_data_type != caffe_pb2.FLOAT and self.root:
            log.info("solver_data_type %s: minicaffe keeps master weights and solver history "
                     "in FLOAT", caffe_pb2.Type.Name(p.solver_data_type))
        check_solver_param(p, self.source)
        if p.snapshot_format == caffe_pb2.SolverParameter.HDF5:
            try:
                import h5py  # noqa: F401
            except ImportError:
                raise ConfigError(f"{self.source}: snapshot_format HDF5 needs h5py "
                                  "(pip install \".[data]\")") from None
        self.check_params()
        self.check_snapshot_write_permissions()
        if p.random_seed >= 0:
            context.set_random_seed(p.random_seed + self.config.rank)
        self.init_train_net()
        self.loss_scaler = None     # loss scaling where the net asks (engine/precision.py)
        if self.net.types.loss_scale is not None:
            from ..engine.precision import LossScaler
            self.loss_scaler = LossScaler(self.net, self.net.types.loss_scale)
            if self.root:
                log.info("Loss scaling: %s", self.loss_scaler.describe())
        if self.root:
            self.init_test_nets()
            log.info("Solver scaffolding done.")
        # what the packages above registered (watch/tensorboard.py: an event-file writer
        # on the root solver when minicaffe_tensorboard_dir is set)
        observers.attach(self)
        self.iter = 0
        self.current_step = 0
        self.pre_solve()
        from ..engine.offload import check_solver
        check_solver(self)      # a net asking for offload where none can run: a warning

    def check_params(self):
        """Type-specific checks (overridden)."""

    def pre_solve(self):
        """Allocate solver state (overridden)."""

    def _net_path(self, path):
        """A net file named in the solver: relative to the working directory (as
        Caffe reads it), else relative to the solver file's folder."""
        if os.path.exists(path) or self._solver_dir is None or os.path.isabs(path):
            return path
        alt = os.path.join(self._solver_dir, path)
        return alt if os.path.exists(alt) else path

    def _read_net(self, path):
        return read_net_param(self._net_path(path))

    def init_train_net(self):
        p = self.param
        fields = [p.HasField("net"), p.HasField("net_param"), p.HasField("train_net"),
                  p.HasField("train_net_param")]
        names = "net, net_param, train_net, train_net_param"
        if sum(fields) < 1:
            raise ConfigError(f"{self.source}: the solver defines no net; give a train net "
                              f"using one of these fields: {names}")
        if sum(fields) > 1:
            raise ConfigError(f"{self.source}: the solver must not contain more than one of "
                              f"these fields specifying a train net: {names}")
        if p.HasField("train_net_param"):
            if self.root:
                log.info("Creating training net specified in train_net_param.")
            net_param = read_net_param(p.train_net_param)
            where = f"{self.source} (train_net_param)"
        elif p.HasField("train_net"):
            if self.root:
                log.info("Creating training net from train_net file: %s", p.train_net)
            net_param = self._read_net(p.train_net)
            where = self._net_path(p.train_net)
        elif p.HasField("net_param"):
            if self.root:
                log.info("Creating training net specified in net_param.")
            net_param = read_net_param(p.net_param)
            where = f"{self.source} (net_param)"
        else:
            if self.root:
                log.info("Creating training net from net file: %s", p.net)
            net_param = self._read_net(p.net)
            where = self._net_path(p.net)
        state = caffe_pb2.NetState(phase=TRAIN)
        state.MergeFrom(net_param.state)
        state.MergeFrom(p.train_state)
        net_param.state.CopyFrom(state)
        self.net = Net(net_param, config=self.config)
        if not self.net.layers:
            raise ConfigError(f"{where}: the train net has no layers (in phase TRAIN)")
        if not any(self.net.blob_loss_weights.values()):
            raise ConfigError(f"{where}: the train net has no loss (no layer has a loss weight "
                              "in phase TRAIN): training would change nothing")

    def init_test_nets(self):
        p = self.param
        has_net_param, has_net_file = p.HasField("net_param"), p.HasField("net")
        if has_net_param and has_net_file:
            raise ConfigError(f"{self.source}: both net_param and net may not be specified")
        n_params, n_files = len(p.test_net_param), len(p.test_net)
        n_test = n_params + n_files
        if has_net_param or has_net_file:
            if len(p.test_iter) < n_test:
                raise ConfigError(f"{self.source}: test_iter must be specified for each test "
                                  f"network ({n_test} test nets, {len(p.test_iter)} test_iter)")
        elif len(p.test_iter) != n_test:
            raise ConfigError(f"{self.source}: test_iter must be specified for each test "
                              f"network ({n_test} test nets, {len(p.test_iter)} test_iter)")
        n_generic = len(p.test_iter) - n_test
        n_instances = n_test + n_generic
        if len(p.test_state) and len(p.test_state) != n_instances:
            raise ConfigError(f"{self.source}: test_state must be unspecified or specified once "
                              f"per test net ({n_instances} test nets, {len(p.test_state)} given)")
        if n_instances and p.test_interval <= 0:
            raise ConfigError(f"{self.source}: test_interval must be positive when test nets "
                              f"are defined (test_iter is given)")
        sources, params = [], []
        for tp in p.test_net_param:
            sources.append("test_net_param")
            params.append(read_net_param(tp))
        for f in p.test_net:
            sources.append("test_net file: " + f)
            params.append(self._read_net(f))
        for _ in range(n_generic):
            if has_net_param:
                sources.append("net_param")
                params.append(read_net_param(p.net_param))
            else:
                sources.append("net file: " + p.net)
                params.append(self._read_net(p.net))
        self.test_nets = []
        for i, np_ in enumerate(params):
            state = caffe_pb2.NetState(phase=TEST)
            state.MergeFrom(np_.state)
            if len(p.test_state):
                state.MergeFrom(p.test_state[i])
            np_.state.CopyFrom(state)
            log.info("Creating test net (#%d) specified by %s", i, sources[i])
            net = Net(np_, config=self.config)
            if not net.layers:
                raise ConfigError(f"{self.source}: test net #{i} ({sources[i]}) has no layers "
                                  "(in phase TEST)")
            net.debug_info = p.debug_info
            self.test_nets.append(net)
        self.mean_scores = [[] for _ in self.test_nets]

    # -- callbacks and action requests ----------------------------------------------
    def add_callback(self, callback, on_gradients_ready=None):
        """``callback.on_start()`` runs before each forward-backward, and
        ``callback.on_gradients_ready()`` before each update (Caffe's Solver::Callback).
        pycaffe's form ``add_callback(on_start, on_gradients_ready)`` (two functions) works too."""
        if on_gradients_ready is not None:
            callback = _FunctionCallback(callback, on_gradients_ready)
        self.callbacks.append(callback)

    @property
    def lr(self):
        """The learning rate of the current iteration (computed, nothing logged or advanced)."""
        return float(lr_policy.learning_rate(self.param, self.iter, self.current_step,
                                             log_steps=False)[0])

    def set_action_function(self, fn):
        """``fn()`` returns SolverAction.NONE/STOP/SNAPSHOT (or Caffe's names)."""
        self.action_request_function = fn

    def get_requested_action(self):
        if self.action_request_function is None:
            return SolverAction.NONE
        return str(self.action_request_function() or SolverAction.NONE).lower()

    # -- training ---------------------------------------------------------------------
    def step(self, iters):
        """Run ``iters`` training iterations (Caffe's Solver::Step): one loop for every
        device, the iteration itself run by ``executor()`` (engine/executor.py)."""
        p = self.param
        ex = self.executor()
        start_iter = self.iter
        stop_iter = self.iter + int(iters)
        self.losses = []
        self.smoothed_loss = _f(0)
        self.iterations_last = self.iter
        timer_start = time.perf_counter()
        while self.iter < stop_iter:
            ex.before_iteration()
            if p.test_interval and self.iter % p.test_interval == 0 and \
                    (self.iter > 0 or p.test_initialization):
                self._drain(ex, start_iter)
                self.test_all()  # a no-op without test nets (non-root ranks unless parallel)
                if self.requested_early_exit:
                    break
            for cb in self.callbacks:
                cb.on_start()
            display = bool(p.display) and self.iter % p.display == 0
            if ex.full():
                self._drain(ex, start_iter)
            ex.begin(display)
            try:
                # with loss scaling, an overflow of the fp16 diffs is expected (the step
                # is skipped): no numpy warning for it
                with np.errstate(over="ignore", invalid="ignore") if self.loss_scaler \
                        is not None else contextlib.nullcontext():
                    loss = ex.forward_backward()
            except WaitInterrupted as e:  # a stop signal during a stalled read
                ex.abandon()
                self._stop_on(e)
                break
            if loss is not None:     # known now (else read back at the next drain)
                self._account_loss(loss / p.iter_size, start_iter)
            if display:
                self._drain(ex, start_iter, current=self.iter)
                if self.root:
                    timer_start = self._log_display(timer_start)
            for cb in self.callbacks:
                cb.on_gradients_ready()
            # loss scaling: the eager path checks the diffs here; the GPU step on the
            # device, inside its update (engine/precision.DeviceLossScale)
            if self.loss_scaler is None or ex.step is not None or self.loss_scaler.unscale():
                ex.update()
            if self.loss_scaler is not None and display and self.root:
                log.info("Iteration %d, %s", self.iter, self.loss_scaler.describe())
            if ex.rate is not None and display and self.root:
                log.info("Iteration %d, lr = %s", self.iter, _fmt(ex.rate))
            ex.end(self.iter)
            self.iter += 1
            if self.progress is not None:
                self.progress.update(1)
            request = self.get_requested_action()
            if (p.snapshot and self.iter % p.snapshot == 0 and self.root) or \
                    request == SolverAction.SNAPSHOT:
                self._drain(ex, start_iter)
                self.snapshot()
            if request == SolverAction.STOP:
                self.requested_early_exit = True
                break
        self._drain(ex, start_iter)

    def executor(self):
        """What runs this solver's iterations (engine/executor.py): the GPU step of the
        SGD family where it applies (``uses_gpu_step``), else the eager executor of the
        schedule, layer by layer in this thread's mode."""
        from ..engine.executor import Executor
        replicas = self._replica_pool()     # None on a GPU (said once)
        if self.uses_gpu_step:
            return Executor(self, self._gpu_step())
        return Executor(self, replicas=replicas)

    # -- CPU replicas (engine/replicas.py) -----------------------------------------------------
    def _replica_pool(self):
        """The worker processes of ``config.cpu_replicas`` (started on the first step, once
        per solver), or None: one replica, a GPU, several solvers, or a net that cannot
        be split (said once, in one line; the run goes on in one process)."""
        n = self.config.cpu_replicas
        pool = getattr(self, "_replicas", None)
        if n <= 1 or getattr(self, "_replicas_refused", False):
            return None
        if pool is not None and not pool.closed:
            return pool
        from ..engine import replicas
        why = None
        if context.is_gpu():
            why = "CPU mode only; ignored on a GPU"
        elif self.config.world_size > 1:
            why = "ignored in a multi-GPU/multi-process run"
        elif self.param.debug_info:
            why = "not split: debug_info prints every layer's blobs, which one process holds"
        elif self.loss_scaler is not None:
            why = "not split: loss scaling runs in one process"
        seed = self.param.random_seed if self.param.random_seed >= 0 else None
        pool = None if why is not None and not self.root else \
            replicas.start(self.net, n, self.config, seed, why=why,   # says why not
                           solver=self)
        self._replicas = pool
        self._replicas_refused = pool is None
        return pool

    def replica_pids(self):
        """The process ids of this solver's CPU replicas (``config.cpu_replicas`` > 1, once
        the first step started them), else []."""
        pool = getattr(self, "_replicas", None)
        return [] if pool is None or pool.closed else pool.pids

    def _account_loss(self, loss, start_iter, iteration=None):
        """One iteration's loss (averaged over iter_size): refused when not finite, then
        into the smoothed loss."""
        if not math.isfinite(loss):
            self._report_nonfinite(loss, iteration)
        self.update_smoothed_loss(loss, start_iter, self.param.average_loss, iteration)

    def _drain(self, ex, start_iter, current=None):
        """The losses of the iterations the executor ran ahead (the GPU's ring), oldest
        first: the clipping lines, then the smoothed loss."""
        p = self.param
        clip = np.float32(p.clip_gradients)
        for it, loss, norm in ex.drain(current):
            if clip >= 0 and np.float32(norm) > clip and self.root:
                log.info("Gradient clipping: scaling down gradients (L2 norm %s > %s) by scale "
                         "factor %s", _fmt(np.float32(norm)), _fmt(clip),
                         _fmt(np.float32(clip / np.float32(norm))))
            self._account_loss(loss / p.iter_size, start_iter, it)

    # -- the GPU step (engine/step.py) -----------------------------------------------------
    def _gpu_step_wanted(self):
        """The SGD family on one GPU runs its iterations through engine.step.GpuStep (fused
        update, deferred loss reads, CUDA graphs where they capture); debug_info needs the
        host after every layer and keeps the layer-by-layer path, and so does a rule with no
        fused kernel (``fused_rule`` None: a subclass that writes its own update)."""
        return (context.is_gpu() and hasattr(self, "history_flat") and not self.param.debug_info
                and not self.net.net_param.debug_info
                and getattr(self, "fused_rule", None) is not None)

    @property
    def uses_gpu_step(self):
        """True when ``step`` runs through the GPU step (fused update, deferred loss reads,
        CUDA graphs where they capture) rather than layer by layer."""
        return self._gpu_step_wanted()

    @property
    def gpu_step(self):
        """The GPU step that ran the last ``step`` (engine.step.GpuStep: its memory ``plan``,
        ``graphs``, ``offload``, ``private_bytes()``), or None before the first GPU step
        or in CPU mode.  Read-only: for inspection and reports."""
        return getattr(self, "_gpu_step_obj", None)

    def _gpu_step(self):
        st = getattr(self, "_gpu_step_obj", None)
        if st is None or not st.update.intact():
            from ..engine.step import GpuStep
            graphs = self.config.cuda_graphs
            st = self._gpu_step_obj = GpuStep(
                self, graphs=self.param.cuda_graph if graphs is None else graphs)
        return st

    def fused_extra(self):
        """The update rule's per-iteration scalar for the fused GPU kernel (Adam's)."""
        return 0.0

    def _stop_on(self, interrupted):
        """Stop as the pending request asks, after a wait for data that a stop signal
        ended: the iteration did not happen, the snapshot is of the one before."""
        log.info("%s", interrupted)
        while self.get_requested_action() != SolverAction.NONE:
            pass
        self.requested_early_exit = True

    def _log_display(self, timer_start):
        """Caffe's display lines (speed, smoothed loss, the train net's outputs); returns
        the new start of the display timer."""
        lapse = time.perf_counter() - timer_start
        per_s = (self.iter - self.iterations_last) / (lapse if lapse else 1.0)
        self._measure_data_wait(lapse)
        wait = "" if self.data_wait_share is None else \
            f", data wait {100 * self.data_wait_share:.1f}%"
        log.info("Iteration %d (%s iter/s, %ss/%d iters%s), loss = %s", self.iter,
                 _fmt(_f(per_s)), _fmt(_f(lapse)), self.param.display, wait,
                 _fmt(self.smoothed_loss))
        self._say_bottleneck()
        self.iterations_last = self.iter
        outputs = self._log_outputs(self.net, "Train")
        self._notify("on_display", self.iter, float(self.smoothed_loss), float(per_s), outputs)
        return time.perf_counter()

    def _notify(self, event, *args):
        """Tell the observers (minicaffe/watch) what the solver just logged."""
        for ob in self.observers:
            fn = getattr(ob, event, None)
            if fn is not None:
                fn(self, *args)

    def _measure_data_wait(self, lapse):
        """Set ``data_wait_share``: the seconds the train net's prefetching data layers
        waited for a batch since the last display (CPU: the training thread's waits; GPU:
        the compute stream's idling for input, timed by events), over the interval's
        ``lapse``."""
        layers = [l for l in self.net.layers if hasattr(l, "data_wait")]
        if not layers:
            self.data_wait_share = None
            return
        if context.is_gpu():
            waited = sum(l.data_wait()["gpu_wait_ms"] for l in layers) / 1000.0
        else:
            waited = sum(l.data_wait()["host_wait_s"] for l in layers)
        for l in layers:
            l.reset_data_wait()
        if self.iter == self.iterations_last or lapse <= 0:  # the first display: start
            self.data_wait_share = None
            return
        self.data_wait_share = min(1.0, max(0.0, waited / lapse))

    def _say_bottleneck(self):
        """Once per solver: say when input holds the step back (waits over 10%)."""
        share = self.data_wait_share
        if share is None or share <= 0.10 or self._said_bottleneck:
            return
        self._said_bottleneck = True
        from ..data.workers import ENV
        log.info("Input is the bottleneck: the step waited for data %.0f%% of the last %d "
                 "iterations; add data workers (minicaffe train --data_workers N, "
                 "data_param.workers or $%s; this machine has %d cores)", 100 * share,
                 self.iter - self.iterations_last, ENV, os.cpu_count() or 1)

    def _log_outputs(self, net, kind):
        """Log the net's outputs; returns them as [(blob name, value)]."""
        index = 0
        values = []
        for j, blob in enumerate(net.output_blobs):
            bid = net.output_blob_indices[j]
            name = net.blob_names[bid]
            weight = _f(net.blob_loss_weights[bid])
            for v in np.asarray(blob.cpu_data(), dtype=np.float32).reshape(-1):
                extra = f" (* {_fmt(weight)} = {_fmt(weight * v)} loss)" if weight else ""
                log.info("    %s net output #%d: %s = %s%s", kind, index, name, _fmt(v), extra)
                values.append((name, float(v)))
                index += 1
        return values

    def _report_nonfinite(self, loss, iteration=None):
        where = self.net.first_nonfinite()
        what = "nan" if math.isnan(loss) else "inf"
        if where:
            detail = f"the first non-finite output is top '{where[1]}' of layer '{where[0]}'"
        else:
            detail = "no layer output is non-finite (a parameter or the loss weights may be)"
        it = self.iter if iteration is None else iteration
        raise NonFiniteLossError(f"Iteration {it}: the loss is {what}; {detail}")

    def update_smoothed_loss(self, loss, start_iter, average_loss, iteration=None):
        loss = _f(loss)
        if len(self.losses) < average_loss:
            self.losses.append(loss)
            size = len(self.losses)
            self.smoothed_loss = _f((self.smoothed_loss * _f(size - 1) + loss) / _f(size))
        else:
            idx = ((self.iter if iteration is None else iteration) - start_iter) % average_loss
            self.smoothed_loss = _f(self.smoothed_loss + (loss - self.losses[idx]) / _f(average_loss))
            self.losses[idx] = loss

    def solve(self, resume_file=None):
        """Train to max_iter (Caffe's Solver::Solve), optionally resuming from a
        .solverstate(.h5) first."""
        status = "failed"
        try:
            self._solve(resume_file)
            status = "stopped" if self.requested_early_exit else "finished"
        finally:
            self._notify("on_finish", status)

    def _solve(self, resume_file):
        if not self.root:
            raise MinicaffeError("solve() runs on the root solver only")
        p = self.param
        log.info("Solving %s", self.net.name)
        log.info("Learning Rate Policy: %s", p.lr_policy)
        self.requested_early_exit = False
        if resume_file:
            log.info("Restoring previous solver status from %s", resume_file)
            self.restore(resume_file)
        start_iter = self.iter
        self.step(p.max_iter - self.iter)
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        if self.requested_early_exit:
            log.info("Optimization stopped early.")
            return
        if p.display and self.iter % p.display == 0:
            loss = self.net.forward_prefilled()
            self.update_smoothed_loss(loss, start_iter, p.average_loss)
            log.info("Iteration %d, loss = %s", self.iter, _fmt(self.smoothed_loss))
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")

    # -- testing ------------------------------------------------------------------------
    def test_all(self):
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            self.test(i)

    def test(self, test_net_id=0):
        p = self.param
        log.info("Iteration %d, Testing net (#%d)", self.iter, test_net_id)
        test_net = self.test_nets[test_net_id]
        test_net.share_trained_layers_with(self.net)
        scores, score_output_id = [], []
        loss = 0.0
        n_iter = p.test_iter[test_net_id]
        for i in range(n_iter):
            request = self.get_requested_action()
            while request != SolverAction.NONE:
                if request == SolverAction.SNAPSHOT:
                    self.snapshot()
                elif request == SolverAction.STOP:
                    self.requested_early_exit = True
                request = self.get_requested_action()
            if self.requested_early_exit:
                break
            try:
                iter_loss = test_net.forward_prefilled()
            except WaitInterrupted as e:
                self._stop_on(e)
                break
            if p.test_compute_loss:
                loss += iter_loss
            k = 0
            for j, blob in enumerate(test_net.output_blobs):
                for v in np.asarray(blob.cpu_data(), dtype=np.float32).reshape(-1):
                    if i == 0:
                        scores.append(_f(v))
                        score_output_id.append(j)
                    else:
                        scores[k] = _f(scores[k] + v)
                    k += 1
        if self.requested_early_exit:
            log.info("Test interrupted.")
            return
        loss, scores, n_iter = self.gather_test_results(loss, scores, n_iter)
        if p.test_compute_loss:
            loss /= n_iter
            log.info("Test loss: %s", _fmt(_f(loss)))
        mean_scores, named = [], []
        for i, total in enumerate(scores):
            bid = test_net.output_blob_indices[score_output_id[i]]
            name = test_net.blob_names[bid]
            weight = _f(test_net.blob_loss_weights[bid])
            mean = _f(total / _f(n_iter))
            mean_scores.append(float(mean))
            named.append((name, float(mean)))
            extra = f" (* {_fmt(weight)} = {_fmt(weight * mean)} loss)" if weight else ""
            log.info("    Test net output #%d: %s = %s%s", i, name, _fmt(mean), extra)
        self.mean_scores[test_net_id] = mean_scores
        self._notify("on_test", test_net_id, named, float(loss) if p.test_compute_loss else None)
        return mean_scores

    def gather_test_results(self, loss, scores, n_iter):
        """(loss, scores, iterations) summed over every rank that tested: callbacks with
        ``gather_test_results`` (multi-GPU: each rank tests its own shard) return totals."""
        for cb in self.callbacks:
            gather = getattr(cb, "gather_test_results", None)
            if gather is not None:
                loss, scores, n_iter = gather(loss, scores, n_iter)
        return loss, scores, n_iter

    # -- snapshots ----------------------------------------------------------------------
    def check_snapshot_write_permissions(self):
        """Caffe's check, made whenever a snapshot will be written (periodic ones, or the
        final one of snapshot_after_train), so a final snapshot is never lost to a folder
        found unwritable only after training."""
        p = self.param
        if not self.root or not (p.snapshot or p.snapshot_after_train):
            return
        if p.snapshot and not p.HasField("snapshot_prefix"):
            raise ConfigError(f"{self.source}: snapshot is specified but snapshot_prefix is not")
        probe = self.snapshot_filename(".tempfile")
        try:
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError:
            where = "" if os.path.isabs(p.snapshot_prefix) else \
                f" (relative to the working directory {os.getcwd()}, as in Caffe)"
            raise MinicaffeError(f"cannot write to snapshot prefix '{p.snapshot_prefix}'"
                                 f"{where}; make sure that the directory exists and is "
                                 "writeable") from None

    def snapshot_filename(self, extension):
        """Caffe's Solver::SnapshotFilename: PREFIX_iter_N + extension."""
        return f"{self.param.snapshot_prefix}_iter_{self.iter}{extension}"

    def snapshot(self):
        """Write the weights and the solver state (BINARYPROTO or HDF5)."""
        if not self.root:
            raise MinicaffeError("only the root solver snapshots")
        p = self.param
        fileio.remove_leftovers(f"{p.snapshot_prefix}_iter_")  # of snapshots killed mid-write
        if p.snapshot_format == caffe_pb2.SolverParameter.HDF5:
            model_filename = self.snapshot_filename(".caffemodel.h5")
            log.info("Snapshotting to HDF5 file %s", model_filename)
            self.net.save_hdf5(model_filename, write_diff=p.snapshot_diff)
        else:
            model_filename = self.snapshot_filename(".caffemodel")
            log.info("Snapshotting to binary proto file %s", model_filename)
            self.net.save(model_filename, write_diff=p.snapshot_diff)
        self.last_snapshot = (self.iter, self.snapshot_solver_state(model_filename))
        self._notify("on_snapshot", model_filename, self.last_snapshot[1])
        return model_filename

    def restore(self, state_file):
        """Continue from a .solverstate or .solverstate.h5 (Caffe's Solver::Restore)."""
        self.restore_solver_state(os.fspath(state_file))

    def resume_state(self):
        """minicaffe's addition to a solver state (SolverState.resume): this thread's
        generator and every data layer's position, as of this iteration."""
        r = caffe_pb2.ResumeState()
        snap.rng_to_proto(context.rng().get_state(), r.rng)
        for net_id, net in enumerate([self.net] + self.test_nets):
            for name, layer in zip(net.layer_names, net.layers):
                position = getattr(layer, "data_position", None)
                if position is not None:
                    snap.position_to_proto(position(), r.data.add(net=net_id, layer=name))
        if self.loss_scaler is not None:
            r.loss_scale, r.loss_scale_good, r.loss_scale_skipped = self.loss_scaler.state()
        return r

    def restore_resume_state(self, resume, state_file):
        """Put the data layers and the generator where ``resume`` says (None: a state
        written by Caffe, which has no positions: the data starts at its first record)."""
        if resume is None:
            log.info("%s holds no data positions (written by Caffe?): the data layers start "
                     "from their first record", state_file)
            return
        nets = [self.net] + self.test_nets
        for d in resume.data:
            net = nets[d.net] if d.net < len(nets) else None
            layer = net.layer_dict.get(d.layer) if net is not None else None
            if layer is None or not hasattr(layer, "set_data_position"):
                log.warning("%s: data layer '%s' of net #%d is not in this solver's nets: its "
                            "position is not restored", state_file, d.layer, d.net)
                continue
            layer.set_data_position(snap.position_from_proto(d))
        if resume.HasField("rng"):
            context.rng().set_state(snap.rng_from_proto(resume.rng))
        if resume.HasField("loss_scale") and self.loss_scaler is not None:
            self.loss_scaler.set_state(resume.loss_scale, resume.loss_scale_good,
                                       resume.loss_scale_skipped)

    def snapshot_solver_state(self, model_filename):
        raise NotImplementedError

    def restore_solver_state(self, state_file):
        raise NotImplementedError

    def apply_update(self):
        raise NotImplementedError

    # -- pycaffe aliases ------------------------------------------------------------------
    def close(self):
        """Stop the nets' background work (data prefetch threads, CPU replicas) now."""
        pool = getattr(self, "_replicas", None)
        if pool is not None:
            pool.close()
        for net in [self.net] + list(self.test_nets):
            if net is not None:
                net.close()

    def share_weights(self, net):
        """Make ``net`` use this solver's trained weights (pycaffe's share_weights)."""
        net.share_trained_layers_with(self.net)

    @property
    def test_net(self):
        return self.test_nets[0] if self.test_nets else None

    def copy_weights(self, paths):
        """``--weights a,b``: copy each .caffemodel into the train and test nets."""
        if isinstance(paths, str):
            paths = [s for s in paths.split(",") if s]
        for path in paths:
            log.info("Finetuning from %s", path)
            self.net.copy_from(path)
            for t in self.test_nets:
                t.copy_from(path)


def _debug_string(p):
    from google.protobuf import text_format
    q = caffe_pb2.SolverParameter()
    q.CopyFrom(p)
    # inline nets are printed by each Net when it is built
    for f in ("net_param", "train_net_param"):
        if q.HasField(f):
            getattr(q, f).Clear()
            getattr(q, f).name = getattr(p, f).name or "(inline)"
    for tp in q.test_net_param:
        tp.ClearField("layer")
    return text_format.MessageToString(q)
