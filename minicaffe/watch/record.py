"""A run's record: the scalars a training run reports and the facts about it.

No Caffe counterpart (NVIDIA DIGITS kept the same per job).  ``RunRecord`` holds, per
series name, the (iteration, value) points; the run's facts (net, solver, precision,
devices, batch, offload policy...); the snapshots written; and the run's status
(``training``, ``finished``, ``stopped`` or ``failed``).  It is thread-safe: the
training thread adds points, a server thread reads ``to_dict()``.

``Recorder(record)`` fills a record from a Solver through its observer hook
(``solver.observers``: ``on_display``, ``on_test``, ``on_snapshot``, ``on_finish``,
called on the root solver with what it already computed for its log lines).  Series:

- ``train/smoothed_loss``: the loss of the display line (smoothed over Caffe's
  ``average_loss`` iterations);
- ``train/<output>``: each train net output at display (each loss of a multi-loss net);
- ``test/<output>`` (``test<k>/<output>`` for test net k > 0): the mean test scores;
- ``lr``: the learning rate at display;
- ``speed/iter_per_s``, ``speed/images_per_s``: since the previous display;
- ``data_wait_share``: the share of the iteration spent waiting for data
  (``solver.data_wait_share``, when the solver measures it);
- ``device_memory_mib``: the GPU allocator's high-water mark (GPU runs only).
"""
import math
import threading
import time


def test_prefix(test_net_id):
    return "test" if test_net_id == 0 else f"test{test_net_id}"


class RunRecord:
    """Scalars per iteration, facts and status of one training run."""

    def __init__(self, facts=None, source=None):
        self._lock = threading.Lock()
        self.facts = dict(facts or {})
        self.series = {}           # name -> [[iteration, value], ...]
        self.snapshots = []        # [[iteration, model file], ...]
        self.status = "training"
        self.source = source       # where a record read from a file came from
        self.started = time.time()
        self.iteration = 0
        self.max_iter = None
        self.version = 0           # grows with every change

    def add(self, name, iteration, value):
        """One point of series ``name`` (None values are not recorded)."""
        if value is None:
            return
        value = float(value)
        with self._lock:
            self.series.setdefault(name, []).append([int(iteration), value])
            self.iteration = max(self.iteration, int(iteration))
            self.version += 1

    def set_fact(self, key, value):
        with self._lock:
            self.facts[key] = value
            self.version += 1

    def add_snapshot(self, iteration, path):
        with self._lock:
            self.snapshots.append([int(iteration), str(path)])
            self.version += 1

    def set_status(self, status, iteration=None):
        with self._lock:
            self.status = status
            if iteration is not None:
                self.iteration = max(self.iteration, int(iteration))
            self.version += 1

    def points(self, name):
        """A copy of series ``name``: [(iteration, value), ...]."""
        with self._lock:
            return [tuple(p) for p in self.series.get(name, [])]

    def to_dict(self):
        """A JSON-ready copy (non-finite values as None, JSON has no NaN)."""
        with self._lock:
            return {
                "facts": dict(self.facts),
                "series": {k: [[i, v if math.isfinite(v) else None] for i, v in pts]
                           for k, pts in self.series.items()},
                "snapshots": [list(s) for s in self.snapshots],
                "status": self.status,
                "iteration": self.iteration,
                "max_iter": self.max_iter,
                "source": self.source,
                "version": self.version,
            }


def _images_per_iteration(solver):
    """Images one iteration consumes: the first train input's batch x iter_size x solvers."""
    from ..core import context
    n = 0
    for tops in solver.net.top_vecs:  # the first layer with a top: the data layer
        if tops and tops[0].shape:
            n = int(tops[0].shape[0])
            break
    return n * int(solver.param.iter_size) * max(1, context.solver_count())


def _device_memory_mib():
    from ..core import backend, context
    if not context.is_gpu():
        return None
    return backend.peak_gpu_bytes() / float(1 << 20)


def solver_facts(solver, devices=None):
    """The facts of a run, from its solver (and the device ids it trains on)."""
    from ..core import context
    from ..engine import offload
    from ..gpu import options
    p = solver.param
    gpu = context.is_gpu()
    if devices is None:
        devices = [context.device_id()] if gpu else []
    per_iter = _images_per_iteration(solver)
    return {
        "net": solver.net.name,
        "solver": f"{solver.type or type(solver).__name__} ({solver.source})",
        "lr policy": f"{p.lr_policy}, base_lr {p.base_lr:g}",
        "precision": options.describe() if gpu else "fp32 (CPU, numpy)",
        "devices": (", ".join(f"GPU {d}" for d in devices) if gpu and devices
                    else ("GPU" if gpu else "CPU")),
        "batch": f"{per_iter} images per iteration" if per_iter else "n/a",
        "offload policy": offload.settings(solver.net.net_param)[0] if gpu else "n/a (CPU)",
        "max_iter": int(p.max_iter),
    }


class Recorder:
    """A Solver observer that fills a RunRecord from what the solver already computed."""

    def __init__(self, record, solver=None, devices=None):
        self.record = record
        self._images = 0
        if solver is not None:
            self.attach(solver, devices)

    def attach(self, solver, devices=None):
        self._images = _images_per_iteration(solver)
        for k, v in solver_facts(solver, devices).items():
            self.record.set_fact(k, v)
        self.record.max_iter = int(solver.param.max_iter)
        self.record.set_status("training", solver.iter)
        solver.observers.append(self)
        return self

    def on_display(self, solver, iteration, smoothed_loss, iter_per_s, outputs):
        r = self.record
        r.add("train/smoothed_loss", iteration, smoothed_loss)
        for name, value in outputs:
            r.add(f"train/{name}", iteration, value)
        r.add("lr", iteration, solver.lr)
        if iter_per_s:
            r.add("speed/iter_per_s", iteration, iter_per_s)
            if self._images:
                r.add("speed/images_per_s", iteration, iter_per_s * self._images)
        r.add("data_wait_share", iteration, getattr(solver, "data_wait_share", None))
        r.add("device_memory_mib", iteration, _device_memory_mib())

    def on_test(self, solver, test_net_id, scores, loss):
        prefix = test_prefix(test_net_id)
        for name, value in scores:
            self.record.add(f"{prefix}/{name}", solver.iter, value)

    def on_snapshot(self, solver, model_file, state_file):
        self.record.add_snapshot(solver.iter, model_file)

    def on_finish(self, solver, status):
        self.record.set_status(status, solver.iter)
