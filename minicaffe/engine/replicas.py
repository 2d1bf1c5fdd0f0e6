"""Data parallelism inside one CPU iteration: the batch split across worker processes
(``RunConfig.cpu_replicas``, ``minicaffe train --replicas N``; the executor's ``replicas``
mode, engine/executor.py).

Caffe has no counterpart in one process (Intel Caffe split the batch across MPI ranks,
PyTorch users run DistributedDataParallel on the CPU with gloo); here there is no GIL to
share: each worker is a process running its slice of the batch on one thread.

Contract:

- ``refusal(net)``: None when ``net`` (a TRAIN net) can be split, else the one line
  saying which layer keeps it whole.  Split: the layers with no bottoms (the data layers)
  give tops whose first axis is the batch; every other layer works sample by sample
  (``PER_SAMPLE``, with its axis where it has one), or is a loss layer normalised by the
  batch (SoftmaxWithLoss/InfogainLoss/SigmoidCrossEntropyLoss with VALID and no
  ignore_label, BATCH_SIZE or FULL; EuclideanLoss, HingeLoss, MultinomialLogisticLoss)
  or by nothing (NONE) -- not both kinds in one net -- or an Accuracy without
  ignore_label.  Refused: BatchNorm (its statistics span the batch), Python layers,
  recurrent layers, Concat/Slice/Reshape/InnerProduct... on axis 0, reduced precision,
  debug_info, and every type not checked to be per-sample.
- ``ReplicaPool(net, n, config, seed)`` starts ``n`` processes (``spawn``: the main process
  has threads; a user's ``__main__`` is not re-imported) that build the rest of the net
  (its data layers replaced by Input layers of their slice's shape: contiguous slices of
  the batch whose sizes differ by at most one) on one BLAS thread each, kernel pool off;
  one warning line first where they are more than ``--replicas auto`` gives, the main
  process and the workers then outnumbering the usable CPUs (``warn_oversubscribed``:
  workers are preempted each step).
  Everything they share lives in one file in /dev/shm, unlinked as soon as every worker
  has mapped it (no segment outlives the processes, whatever way they end): the
  parameters (the main net's flat parameter buffer is moved there, so the workers read
  the weights the solver updates in place, with no copy per step), the data layers'
  tops, and per replica its parameter gradients and its outputs.
- ``forward_backward()``: one pass: the main process runs the data layers (prefetch
  included) and copies their tops into the shared input; one byte wakes each worker,
  which runs forward and backward on its slice and answers with one byte.  Then the
  gradients (one row per replica) are summed inside the workers, a reduce-scatter: one
  byte wakes each worker whose share is not empty, which sums ``sum_k w_k grads[k]``
  over its own contiguous share of the parameters' columns (``shares(total, n)``: fixed
  for ``n``, cut at 16 floats, a cache line) into the shared ``summed`` row and answers
  with one byte; the main process adds ``summed`` into the net's diffs (``iter_size``
  passes accumulate there).  The weights ``w_k``, slice/batch for losses normalised by
  the batch (1 for NONE), are written into the file once.  Each element is summed by
  numpy in the fixed order k = 0, 1, ..., n-1, one rounding per product and per sum (no
  BLAS kernel, no FMA): the same bits for the same ``n`` run to run, whatever the
  shares and the machine, not the bits of one process.  The loss and the other outputs
  of the train net are combined the same way (per-sample outputs concatenated) by the
  main process.  Returns the pass's loss.  Nothing is pickled per step.
- With the solver (``ReplicaPool(..., solver=)``, what ``Solver`` passes; its
  ``share_update()``, solvers/shares.py): the main net's diffs and the solver's history
  sets live in the file too, the workers write their shares of the sum straight into
  the diffs (the first of iter_size passes overwrites them: no clearing), and with
  ``forward_backward(update=(rate, iteration))`` each then applies the solver's update
  (normalise, regularise, the rule, ``w -= update``) to its share -- the main process
  does no pass over the parameters.  Not where the loss is not finite (the solver
  refuses it with the weights untouched); with clip_gradients each worker adds its
  share's sum of squares first and ``finish_update(scale)`` sends the scale.  The
  executor (engine/executor.py) keeps the update in the main process for a step with
  an ``on_gradients_ready`` callback; the bits are the same either way.  Also with the
  solver: an InnerProduct layer whose weights outweigh the whole batch's inputs and
  top diffs (``ReplicaPool._gathered``; LeNet's ip1) has its weight gradient computed
  once over the batch instead of per replica: each worker writes its slice's inputs and
  top diffs (times its weight ``w_k``) into the file after that layer's backward (no
  dense N x K gradient per worker, nothing to clear there), and in the sum message each
  computes the rows of ``dW = DY^T X`` holding its share's columns (one BLAS product:
  the same bits run to run for the same ``n``, not those of the per-slice sum).
- A worker that fails (an exception, a signal, kill -9) ends the pass with a
  MinicaffeError naming the replica, its pid and the cause; the pool is closed first, so
  no process is left.  Workers ignore SIGINT and SIGTERM (the training process decides
  how to stop, as the data workers) and exit when their pipe closes.  ``close()`` stops
  and reaps them; ``pids`` names them.
"""
import contextlib
import math
import multiprocessing
import os
import selectors
import signal
import struct
import weakref

import numpy as np

from ..core import log
from ..core.errors import MinicaffeError
from ..data.workers import (death_cause, first_messages, main_hidden, map_shared_file,
                            stop_workers)

START_TIMEOUT = 120.0     # seconds for a worker to start, build its net and map the file
_ALIGN = 4096
_LINE = 16                # float32 per cache line (64 bytes): the shares' unit
# the solver's pass message: b"G" + (flags, rate, clip scale, iteration)
_G = struct.Struct("<Bddq")
_SUM, _ACC, _SUMSQ, _UPDATE = 1, 2, 4, 8     # sum the share; into the diffs (+=); its
#                                               sum of squares; then the update

# layer types that compute each sample from that sample alone (parameters shared),
# with the field naming their axis where they have one: (parameter field, axis field,
# default axis); None: no axis
PER_SAMPLE = {
    t: None for t in (
        "AbsVal", "BNLL", "Clip", "Dropout", "ELU", "Exp", "Log", "Power", "ReLU",
        "Sigmoid", "Swish", "TanH", "Threshold", "PReLU", "LRN", "Pooling", "SPP", "Im2col",
        "Convolution", "Deconvolution", "Split", "Silence", "Eltwise", "MVN", "Embed")}
PER_SAMPLE.update({
    "InnerProduct": ("inner_product_param", "axis", 1),
    "Softmax": ("softmax_param", "axis", 1),
    "Flatten": ("flatten_param", "axis", 1),
    "Concat": ("concat_param", "axis", 1),
    "Slice": ("slice_param", "axis", 1),
    "Scale": ("scale_param", "axis", 1),
    "Bias": ("bias_param", "axis", 1),
    "Crop": ("crop_param", "axis", 2),
    "Tile": ("tile_param", "axis", 1),
    "ArgMax": ("argmax_param", "axis", 1),
    "Reduction": ("reduction_param", "axis", 0),
    "Reshape": ("reshape_param", "axis", 0),
})
# loss layers: (the normalization's default, or None: divided by the batch's items)
LOSSES = {"SoftmaxWithLoss": "VALID", "InfogainLoss": "VALID",
          "SigmoidCrossEntropyLoss": "BATCH_SIZE", "EuclideanLoss": None,
          "HingeLoss": None, "MultinomialLogisticLoss": None}
WHY = {"BatchNorm": "its mean and variance span the batch",
       "Python": "a Python layer may do anything with the batch",
       "RNN": "recurrent", "LSTM": "recurrent", "LSTMUnit": "recurrent",
       "BatchReindex": "it reorders the batch", "Filter": "it drops samples",
       "HDF5Output": "it writes the batch to a file",
       "ContrastiveLoss": "a loss not checked to be split",
       "Parameter": "its top is not a batch"}


def _axis(layer_param, spec, ndim):
    field, name, default = spec
    p = getattr(layer_param, field)
    axis = getattr(p, name) if p.HasField(name) else default
    if layer_param.type == "Concat" and not p.HasField("axis") and p.HasField("concat_dim"):
        axis = p.concat_dim
    if layer_param.type == "Slice" and not p.HasField("axis") and p.HasField("slice_dim"):
        axis = p.slice_dim
    if layer_param.type == "ArgMax" and not p.HasField("axis"):
        return 1     # per sample: the max over each sample's values
    return axis + ndim if axis < 0 else axis


def _loss_kind(layer):
    """'mean' (normalised by the batch), 'sum' (NONE), or a refusal."""
    from ..layers.loss import normalization_mode
    from ..proto import caffe_pb2
    lp = layer.layer_param
    default = LOSSES[lp.type]
    if default is None:
        return "mean"
    norms = caffe_pb2.LossParameter.NormalizationMode
    mode = norms.Name(normalization_mode(lp, norms.Value(default)))
    if mode == "NONE":
        return "sum"
    if mode == "VALID" and lp.loss_param.HasField("ignore_label"):
        return "refuse:normalization VALID with an ignore_label divides by a count that " \
               "differs from slice to slice"
    return "mean"


def refusal(net):
    """None when ``net`` can be split across replicas, else the reason (one line naming
    the layer); see the module docstring."""
    if net.debug_info or net.net_param.debug_info:
        return "debug_info prints every layer's blobs, which only one process holds"
    if getattr(net.types, "reduced", None):
        return "reduced precision (bf16/fp16) runs in one process"
    batch, kinds = None, set()
    for i, (name, layer) in enumerate(zip(net.layer_names, net.layers)):
        t = layer.layer_param.type
        where = f"layer '{name}' ({t})"
        if not net.bottom_vecs[i]:
            for blob, top in zip(net.top_vecs[i], layer.layer_param.top):
                n = blob.shape[0] if blob.shape else None
                if batch is None:
                    batch = n
                if not n or n != batch:
                    return f"{where}: its top '{top}' is not a batch of {batch or n}"
                if blob.dtype != np.float32:
                    return f"{where}: its top '{top}' is not float32"
            continue
        if t in WHY:
            return f"{where}: {WHY[t]}"
        losses = [j for j in range(len(net.top_vecs[i])) if layer.loss(j)]
        if t in LOSSES:
            kind = _loss_kind(layer)
            if kind.startswith("refuse:"):
                return f"{where}: {kind[7:]}"
            kinds.add(kind)
            continue
        if losses:
            return f"{where}: a loss weight on a layer that is not a checked loss layer"
        if t == "Accuracy":
            if layer.layer_param.accuracy_param.HasField("ignore_label"):
                return f"{where}: an ignore_label makes the count differ from slice to slice"
            if len(net.top_vecs[i]) > 1:
                return f"{where}: the per-class accuracy (top 1) counts classes, not samples"
            continue
        if t not in PER_SAMPLE:
            return f"{where}: a layer type not checked to work sample by sample"
        spec = PER_SAMPLE[t]
        if spec is not None:
            ndim = len(net.bottom_vecs[i][0].shape)
            axis = _axis(layer.layer_param, spec, ndim)
            if t == "Reshape" and axis == 0:
                dims = list(layer.layer_param.reshape_param.shape.dim)
                if not dims or dims[0] != 0:
                    return f"{where}: it reshapes axis 0 (the batch); keep it (dim: 0)"
            elif axis == 0:
                return f"{where}: it works on axis 0, the batch"
    if batch is None:
        return "the net has no data layer (a layer without bottoms giving the batch)"
    if len(kinds) > 1:
        return ("the losses mix normalization NONE with normalizations by the batch, whose "
                "slices would need different weights")
    if batch < 2:
        return f"a batch of {batch} cannot be split"
    return None


def slices(batch, n):
    """Contiguous [a, b) ranges of ``batch`` for ``n`` replicas, sizes differing by at most
    one (the first ones larger), none empty (at most ``batch`` of them)."""
    n = min(n, batch)
    return [(batch * k // n, batch * (k + 1) // n) for k in range(n)]


def shares(total, n):
    """Contiguous [lo, hi) column ranges of ``total`` parameters for ``n`` replicas' sums:
    whole cache lines of 16 floats, the first shares one line more where they do not
    divide evenly, the last one the leftover floats; sizes differ by at most 16 floats,
    and a share is empty (lo == hi) when there are fewer lines than replicas."""
    lines, rest = divmod(int(total), _LINE)
    q, r = divmod(lines, n)
    cuts = [_LINE * (k * q + min(k, r)) for k in range(n)] + [int(total)]
    return [(cuts[k], cuts[k + 1]) for k in range(n)]


def weighted_sum(weights, rows, out, tmp):
    """``out[...] = sum_k weights[k] * rows[k]`` in the fixed order k = 0, 1, ...: numpy's
    elementwise multiply and add, each rounded once (a weight of 1 multiplies nothing).
    ``tmp``: scratch of ``out``'s size."""
    def term(k, dst):
        if weights[k] == 1:
            return rows[k]
        np.multiply(rows[k], weights[k], out=dst)
        return dst
    first = term(0, out)
    if first is not out:
        out[...] = first
    for k in range(1, len(rows)):
        np.add(out, term(k, tmp), out=out)


class _Region:
    """Offsets (bytes) of the shared file's arrays, laid out at 4 KiB boundaries."""

    def __init__(self):
        self.size = 0

    def add(self, nbytes):
        off = self.size
        self.size += -(-max(int(nbytes), 1) // _ALIGN) * _ALIGN
        return off


def _view(buf, offset, count, dtype=np.float32):
    dt = np.dtype(dtype)
    return buf[offset:offset + count * dt.itemsize].view(dt)


@contextlib.contextmanager
def _one_thread_env():
    """The BLAS variables at 1 while the workers start (they inherit them, so their BLAS
    starts no idle threads), the caller's after."""
    from ..core.threads import ENV_VARS
    saved = {v: os.environ.get(v) for v in ENV_VARS}
    try:
        os.environ.update({v: "1" for v in saved})
        yield
    finally:
        for v, value in saved.items():
            if value is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = value


def start(net, n, config, seed=None, why=None, fallback="training runs in one process",
          solver=None):
    """``n`` replicas of ``net`` (a ReplicaPool; ``solver``: the solver training it, see
    ReplicaPool), or None after one warning line saying why not: ``why`` (the caller's
    reason), a GPU, or ``refusal(net)`` (then ``fallback`` says what runs instead)."""
    from ..core import context
    if why is None and context.is_gpu():
        why = "CPU mode only; ignored on a GPU"
    if why is None:
        reason = refusal(net)
        if reason is not None:
            why = f"not split: {reason}; {fallback}"
    if why is not None:
        log.warning("--replicas %d: %s", n, why)
        return None
    return ReplicaPool(net, n, config, seed, solver)


def warn_oversubscribed(n, cpus=None):
    """One warning line when ``n`` workers are more than ``--replicas auto`` gives on the
    usable CPUs (``config.auto_replicas``: the main process and the workers would share
    them, the workers preempted each step); returns whether it warned."""
    from ..core.config import auto_replicas, usable_cpus
    cpus = usable_cpus() if cpus is None else cpus
    auto = auto_replicas(cpus)
    if n <= auto:
        return False
    log.warning("--replicas %d: the main process and %d workers share %d CPU(s), so workers "
                "are preempted each step (16 replicas on 16 CPUs: LeNet's step 9.5 ms, "
                "15: 5.9 ms); --replicas auto = %d here", n, n, cpus, auto)
    return True


class ReplicaPool:
    """``n`` worker processes, each running ``net``'s layers on a slice of the batch (see
    the module docstring).  With ``solver`` (whose ``share_update()`` gives the update
    the workers can run, solvers/shares.py), the net's diffs and the solver's history
    move into the shared file too and ``forward_backward`` takes ``first``/``update``:
    the workers sum their shares straight into the diffs and may apply the update."""

    def __init__(self, net, n, config, seed=None, solver=None):
        self.net = net
        self.closed = False
        op = getattr(solver, "share_update", None)
        self.update_op = op() if op is not None else None
        self._history = solver.history_flat if self.update_op is not None else []
        self._pending = None
        self.procs, self.conns = [], []
        self._selector = None
        self.path = None
        self.data_layers = [i for i in range(len(net.layers)) if not net.bottom_vecs[i]]
        tops = [(net.blob_names[b], net._blobs[b]) for i in self.data_layers
                for b in net.top_id_vecs[i]]
        self.batch = tops[0][1].shape[0]
        self.slices = slices(self.batch, n)
        self.n = len(self.slices)
        warn_oversubscribed(self.n)
        self.mode = "sum" if any(
            l.layer_param.type in LOSSES and _loss_kind(l) == "sum" for l in net.layers) \
            else "mean"
        fb = net.flat_params()
        self.counts = list(fb.counts)
        total = fb.total
        # the file: weights, inputs, then per replica its gradients and its outputs
        lay = _Region()
        w_off = lay.add(total * 4)
        self.input_specs = []
        for name, blob in tops:
            self.input_specs.append((name, tuple(blob.shape), lay.add(blob.count() * 4)))
        self.outputs = self._outputs()
        # each replica's results: its loss, then each output (a per-sample one with room
        # for the largest slice), float64
        big = max(b - a for a, b in self.slices)
        self.out_offsets, o = [], 1
        for _, _, c, per_sample in self.outputs:
            self.out_offsets.append(o)
            o += c * (big if per_sample else 1)
        self._sumsq_at = o         # the worker's share's sum of squared diffs
        n_results = o + 1
        # the gradients one after the other, one row each starting on a cache line
        # (``grads``: n x total), their weighted sum (``summed``) and the weights, then
        # the results
        stride = -(-total // _LINE) * _LINE
        g_off = lay.add(self.n * stride * 4)
        s_off = lay.add(total * 4)
        wt_off = lay.add(self.n * 4)
        per = [(g_off + k * stride * 4, lay.add(8 * n_results)) for k in range(self.n)]
        h_offs = [lay.add(total * 4) for _ in self._history]   # the solver's history sets
        # the InnerProduct layers whose weight gradient is one product over the batch
        # (each worker writes its slice's inputs and weighted top diffs)
        self.gathered = [g + (lay.add(self.batch * g[3] * 4), lay.add(self.batch * g[2] * 4))
                         for g in (self._gathered(fb) if self.update_op is not None else [])]
        self.shares = shares(total, self.n)
        self.path, self._mm = map_shared_file(lay.size, prefix="minicaffe-replicas")
        buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.weights = _view(buf, w_off, total)
        self.inputs = [(net.blob_by_name(name), _view(buf, off, int(np.prod(shape))).reshape(
            shape)) for name, shape, off in self.input_specs]
        self.summed = _view(buf, s_off, total)
        _view(buf, wt_off, self.n)[...] = self._weights("loss")
        self.results = [_view(buf, r, n_results, np.float64) for _, r in per]
        self.summers = [k for k, (lo, hi) in enumerate(self.shares) if hi > lo]
        if self.gathered:
            log.info("CPU replicas: the weight gradient of %s computed over the whole batch "
                     "by the workers, each on its share of the rows",
                     ", ".join(f"'{g[0]}'" for g in self.gathered))
        self.history = [_view(buf, off, total) for off in h_offs]
        self._attach_weights()
        net_param = self._replica_param()
        cfg = config.replace(cpu_replicas=1, data_workers=0)
        ctx = multiprocessing.get_context("spawn")
        try:
            for k, (a, b) in enumerate(self.slices):
                spec = {"path": self.path, "size": lay.size, "net": net_param, "config": cfg,
                        "index": k, "slice": (a, b), "inputs": self.input_specs, "weights": w_off,
                        "total": total, "counts": self.counts, "grads": per[k][0],
                        "sum": {"grads": (g_off, stride), "summed": s_off,
                                "weights": wt_off, "n": self.n, "share": self.shares[k],
                                "sumsq": self._sumsq_at},
                        "update": None if self.update_op is None else
                        (self.update_op, h_offs),
                        "gathered": self.gathered, "batch": self.batch,
                        "results": (per[k][1], n_results),
                        "outputs": [(o[0], off) for o, off in zip(self.outputs,
                                                                  self.out_offsets)],
                        "seed": None if seed is None else int(seed) + 1000 * (k + 1)}
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_worker_main, args=(child, spec),
                                name=f"minicaffe-replica-{k}", daemon=True)
                with main_hidden(), _one_thread_env():
                    p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            # a pool dropped without close() (a solver garbage-collected) still stops them
            self._finalizer = weakref.finalize(self, stop_workers, self.procs, self.conns,
                                               _goodbye)
            hellos = first_messages(self.procs, self.conns, self._who,
                                    lambda c: c.recv_bytes(), START_TIMEOUT)
            for k, msg in enumerate(hellos):
                if msg != b"R":
                    raise MinicaffeError(f"{self._who(k)} could not build its net: "
                                         f"{msg[1:].decode(errors='replace')}")
        except BaseException:
            self.close()
            raise
        finally:
            self._unlink()
        log.info("CPU replicas: %d worker processes of one thread each, slices %s of the "
                 "batch of %d (pids %s)", self.n,
                 "+".join(str(b - a) for a, b in self.slices), self.batch,
                 ", ".join(map(str, self.pids)))

    # -- construction ---------------------------------------------------------------------
    def _outputs(self):
        """[(name, kind, per-sample count or count, per_sample)] of the net's outputs: a
        loss ('loss'), an accuracy ('mean'), or a per-sample blob ('concat')."""
        net, out = self.net, []
        for b in net.output_blob_indices:
            name, blob = net.blob_names[b], net._blobs[b]
            kind = None
            for i, tops in enumerate(net.top_id_vecs):
                if b in tops:
                    j = tops.index(b)
                    layer = net.layers[i]
                    if layer.loss(j):
                        kind = "loss"
                    elif layer.layer_param.type == "Accuracy":
                        kind = "mean"
            if kind is not None:
                out.append((name, kind, blob.count(), False))
            elif blob.shape and blob.shape[0] == self.batch:
                out.append((name, "concat", blob.count(1), True))
            else:
                raise MinicaffeError(f"--replicas: the train net's output '{name}' is "
                                     "neither a loss, an accuracy nor one value per sample")
        return out

    def _gathered(self, fb):
        """[(layer name, its weight's offset in the flat buffer, N, K)] of the
        InnerProduct layers whose weight gradient the workers compute as one product over
        the whole batch (``dW = sum_k w_k dy_k^T x_k``: the slices' inputs and weighted top
        diffs side by side, each worker the rows of dW in its share) instead of each
        worker writing a dense N x K gradient that the sum then reads back: where N * K
        exceeds batch * (N + K), the floats of the inputs and top diffs of the whole
        batch (LeNet's ip1, 500 x 800 at batch 64; not CIFAR-10 quick's layers).  Only a
        layer whose weight (axis 1, not transposed) is its own, learnt, and shared with
        no other layer."""
        net, out = self.net, []
        owners = set(net.param_owners)
        for pid, (i, j) in enumerate(net.param_layer_indices):
            layer = net.layers[i]
            if j != 0 or layer.layer_param.type != "InnerProduct" or layer.transpose or \
                    net.param_owners[pid] != -1 or pid in owners or \
                    not layer.get_param_propagate_down(0) or layer.M != self.batch:
                continue
            n, k = layer.N, layer.K
            if n * k > self.batch * (n + k):
                lid = net.learnable_param_ids[pid]
                out.append((net.layer_names[i], fb.offsets[lid], n, k))
        return out

    def _replica_param(self):
        """The train net's NetParameter with its data layers as Input layers of the first
        replica's slice (each worker sets its own batch), serialised."""
        from ..proto import caffe_pb2
        src = self.net.net_param
        p = caffe_pb2.NetParameter()
        p.CopyFrom(src)
        del p.layer[:]
        data = set(self.data_layers)
        for i, l in enumerate(src.layer):
            if i in data:
                q = p.layer.add(name=l.name, type="Input")
                q.top.extend(l.top)
                for b in self.net.top_vecs[i]:
                    q.input_param.shape.add().dim.extend(b.shape)
            else:
                p.layer.add().CopyFrom(l)
        return p.SerializeToString()

    def _attach_weights(self):
        """Move the main net's flat parameter data into the shared file (again after a
        reshape or a restore replaced it); with the solver's update, its diffs (the
        workers' sum) and the solver's history too."""
        fb = self.net.flat_params()
        pairs = [(fb.data, self.weights)]
        if self.update_op is not None:
            pairs += [(fb.diff, self.summed)] + [(h.data, mine) for h, mine in
                                                 zip(self._history, self.history)]
        for mem, shared in pairs:
            if mem.host_array is shared:
                continue
            if list(fb.counts) != self.counts:
                raise MinicaffeError("--replicas: the net's parameters changed shape during "
                                     "training")
            shared[...] = mem.cpu_data()
            mem.set_cpu_data(shared)
        return fb

    @property
    def pids(self):
        return [p.pid for p in self.procs]

    # -- one pass -------------------------------------------------------------------------
    def forward_backward(self, first=True, update=None):
        """One forward and backward over the whole batch (see the module docstring); the
        gradients are added into the main net's diffs; returns the weighted loss.

        With the solver's update (``update_op``): the workers write their shares of the
        sum straight into the diffs, over what they hold where ``first`` (the first of
        iter_size passes: no clearing needed); ``update`` = (rate, iteration): then they
        apply the solver's update with that rate -- unless the loss is not finite (the
        solver refuses it, weights untouched), or clip_gradients needs the norm first:
        then each share's sum of squares is kept and ``finish_update`` applies it."""
        if self.closed:
            raise MinicaffeError("--replicas: the replica processes were stopped")
        net = self.net
        fb = self._attach_weights()
        fused = net.begin_pass()
        for i in self.data_layers:
            net.forward_layer(i, fused)
        for blob, shared in self.inputs:
            if tuple(blob.shape) != shared.shape:
                raise MinicaffeError(f"--replicas: the data blob changed shape from "
                                     f"{shared.shape} to {tuple(blob.shape)}")
            shared[...] = blob.cpu_data()
        try:
            self._phase(b"S", range(self.n))       # forward and backward on each slice
            loss = 0.0
            for w, r in zip(self._weights("loss"), self.results):
                loss += float(w) * float(r[0])
            if self.update_op is None:
                self._phase(b"A", self.summers)    # each share of sum_k w_k grads[k]
            else:
                flags = _SUM | (0 if first else _ACC)
                rate, it = update if update is not None else (0.0, 0)
                if update is not None and math.isfinite(loss):
                    flags |= _SUMSQ if self.update_op.clips else _UPDATE
                    self._pending = (rate, it) if self.update_op.clips else None
                self._phase(b"G" + _G.pack(flags, rate, 1.0, it), self.summers)
        except BaseException:
            self.close()
            raise
        if self.update_op is None:
            # added into the diffs (iter_size passes accumulate there)
            diff = fb.diff.mutable_cpu_data()
            diff += self.summed
        self._combine_outputs()
        return loss

    def sumsq(self):
        """The diffs' sum of squares (float32), added share by share in order: after a
        pass given ``update`` with clip_gradients set."""
        total = np.float32(0)
        for k in self.summers:
            total = np.float32(total + np.float32(self.results[k][self._sumsq_at]))
        return total

    @property
    def update_pending(self):
        """True after a pass that left the update to ``finish_update``."""
        return self._pending is not None

    def finish_update(self, scale=None):
        """The update the last pass left pending (clip_gradients: ``scale``, the factor
        from ``sumsq()``, None for none), applied by the workers to their shares."""
        if self._pending is None:
            return
        (rate, it), self._pending = self._pending, None
        msg = b"G" + _G.pack(_UPDATE, rate, 1.0 if scale is None else float(scale), it)
        try:
            self._phase(msg, self.summers)
        except BaseException:
            self.close()
            raise

    def _weights(self, kind):
        if kind == "loss" and self.mode == "sum":
            return [np.float32(1)] * self.n
        return [np.float32((b - a) / self.batch) for a, b in self.slices]

    def _combine_outputs(self):
        for (name, kind, count, per_sample), o in zip(self.outputs, self.out_offsets):
            out = self.net.blob_by_name(name).mutable_cpu_data().reshape(-1)
            if per_sample:
                for (a, b), r in zip(self.slices, self.results):
                    out[a * count:b * count] = r[o:o + (b - a) * count]
            else:
                total = np.zeros(count, np.float64)
                for w, r in zip(self._weights(kind), self.results):
                    total += float(w) * r[o:o + count]
                out[...] = total

    def _phase(self, msg, workers):
        """Wake ``workers`` with the byte ``msg`` and wait for each one's answer."""
        for k in workers:
            try:
                self.conns[k].send_bytes(msg)
            except (OSError, ValueError):
                pass         # a dead worker: the wait says which and why
        self._wait(workers)

    def _wait(self, workers):
        """Until each of ``workers`` has answered: one epoll set of every worker's pipe
        and process sentinel, made once (a select per answer over all of them cost the
        main process O(n^2) per phase).  A worker that is not waited for but is ready
        has died (or said why it failed): that ends the pass too."""
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
            for k, (c, p) in enumerate(zip(self.conns, self.procs)):
                self._selector.register(c.fileno(), selectors.EVENT_READ, k)
                self._selector.register(p.sentinel, selectors.EVENT_READ, k)
        pending = set(workers)
        while pending:
            for k in {key.data for key, _ in self._selector.select()}:
                c, p = self.conns[k], self.procs[k]
                msg = None
                try:
                    if c.poll():
                        msg = c.recv_bytes()
                except (EOFError, OSError):
                    msg = None
                if msg == b"K":
                    pending.discard(k)     # (not waited for: never sent; dropped)
                elif msg is not None and msg[:1] == b"E":
                    raise MinicaffeError(f"{self._who(k)} failed: "
                                         f"{msg[1:].decode(errors='replace')}")
                else:
                    p.join(1.0)
                    raise MinicaffeError(f"{self._who(k)} died ({death_cause(p)}); "
                                         "training stops")

    # -- the end --------------------------------------------------------------------------
    def _unlink(self):
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def close(self, timeout=2.0):
        """Stop and reap every worker (no child process is left).  The main net keeps its
        parameters in the shared mapping, which lives while the net does."""
        if self.closed:
            return
        self.closed = True
        self._unlink()
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        stop_workers(self.procs, self.conns, _goodbye, timeout)

    def _who(self, k):
        return f"replica {k} (pid {self.procs[k].pid})"


def _goodbye(conn):
    conn.send_bytes(b"Q")


# -- the worker process -------------------------------------------------------------------
def _worker_main(conn, spec):
    for name in ("SIGINT", "SIGHUP", "SIGTERM"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    try:
        net, inputs, outputs, results, summing, update, cleared = _worker_net(spec)
        sumsq_at = spec["sum"]["sumsq"]
    except Exception as e:  # reported by the pool as one line
        conn.send_bytes(b"E" + f"{type(e).__name__}: {e}".encode())
        return
    conn.send_bytes(b"R")
    a, b = spec["slice"]
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the training process is gone
        if msg[:1] not in (b"S", b"A", b"G"):
            return
        try:
            if msg == b"A":
                weighted_sum(*summing)
            elif msg[:1] == b"G":
                _solver_pass(msg, summing, update, results, sumsq_at)
            else:
                for blob, shared in inputs:
                    blob.mutable_cpu_data()[...] = shared[a:b]
                _clear(net, cleared)
                results[0] = net.forward_backward()
                for blob, o in outputs:
                    results[o:o + blob.count()] = blob.cpu_data().reshape(-1)
        except Exception as e:
            try:
                conn.send_bytes(b"E" + f"{type(e).__name__}: {e}".encode())
            except (OSError, ValueError):
                pass
            return
        conn.send_bytes(b"K")


def _worker_net(spec):
    from ..core import context, threads
    from ..network.net import Net
    from ..proto import caffe_pb2
    threads.one_thread()
    context.set_mode_cpu()
    if spec["seed"] is not None:
        context.set_random_seed(spec["seed"])
    _, mm = map_shared_file(spec["size"], spec["path"])
    buf = np.frombuffer(mm, dtype=np.uint8)
    a, b = spec["slice"]
    p = caffe_pb2.NetParameter.FromString(spec["net"])
    for layer in p.layer:
        if layer.type == "Input":
            for shape in layer.input_param.shape:
                if shape.dim:
                    shape.dim[0] = b - a
    net = Net(p, config=spec["config"])
    fb = net.flat_params()
    if list(fb.counts) != list(spec["counts"]):
        raise MinicaffeError("the replica's parameters differ from the main net's")
    fb.data.set_cpu_data(_view(buf, spec["weights"], spec["total"]))
    fb.diff.set_cpu_data(_view(buf, spec["grads"], spec["total"]))
    inputs = [(net.blob_by_name(name), _view(buf, off, int(np.prod(shape))).reshape(shape))
              for name, shape, off in spec["inputs"]]
    outputs = [(net.blob_by_name(name), o) for name, o in spec["outputs"]]
    results = _view(buf, *spec["results"], np.float64)
    # this replica's share of the gradients' weighted sum: every replica's rows over
    # columns [lo, hi), into the same columns of ``summed``
    s = spec["sum"]
    (g_off, stride), n, (lo, hi) = s["grads"], s["n"], s["share"]
    rows = _view(buf, g_off, n * stride).reshape(n, stride)[:, lo:hi]
    weights = [np.float32(w) for w in _view(buf, s["weights"], n)]
    summed = _view(buf, s["summed"], spec["total"])
    summing = (weights, rows, summed[lo:hi], np.empty(hi - lo, np.float32))
    update, cleared = None, None
    if spec["update"] is not None:      # the solver's update of this share
        op, h_offs = spec["update"]
        apply, sumsq = op.bind(_view(buf, spec["weights"], spec["total"]), summed,
                               [_view(buf, off, spec["total"]) for off in h_offs], lo, hi)
        parts, cleared = _gather(net, spec, buf, weights[spec["index"]], rows, summed)
        update = (apply, sumsq, parts)
    return net, inputs, outputs, results, summing, update, cleared


def _clear(net, ranges):
    """The worker's parameter diffs zeroed before its pass: all of them, or only
    ``ranges`` (those not gathered: the gathered weights' diffs are never written)."""
    if ranges is None:
        net.clear_param_diffs()
        return
    diff = net.flat_params().diff.mutable_cpu_data()
    for lo, hi in ranges:
        diff[lo:hi] = 0


def _gather(net, spec, buf, w, rows, summed):
    """The gathered layers (``ReplicaPool._gathered``) in this worker: their weights'
    gradients no longer computed by the layer; an after-backward hook writing the
    slice's inputs and top diffs times ``w`` into the shared arrays.  Returns this
    share's work for the solver's sum message -- [("sum", rows, out, tmp, acc)] over
    the columns not gathered, [("gemm", dy, x, out, scratch, start)] over those of the
    gathered weights -- and the diff ranges a pass must clear (None: all)."""
    a, b = spec["slice"]
    lo, hi = spec["sum"]["share"]
    batch, total = spec["batch"], spec["total"]
    skip, work, hooks = [], [], {}
    for name, off, n, k, x_off, dy_off in spec["gathered"]:
        i = net.layer_names.index(name)
        net.layers[i].set_param_propagate_down(0, False)
        x = _view(buf, x_off, batch * k).reshape(batch, k)
        dy = _view(buf, dy_off, batch * n).reshape(batch, n)
        hooks[i] = (x[a:b], dy[a:b])
        skip.append((off, off + n * k))
        c0, c1 = max(lo, off), min(hi, off + n * k)
        if c0 < c1:     # the rows [r0, r1) of dW that hold this share's columns
            r0, r1 = (c0 - off) // k, -(-(c1 - off) // k)
            work.append(("gemm", dy[:, r0:r1], x, summed[c0:c1],
                         np.empty((r1 - r0, k), np.float32), c0 - off - r0 * k))

    def after_backward(i):
        if i in hooks:
            x, dy = hooks[i]
            x[...] = net.bottom_vecs[i][0].cpu_data().reshape(x.shape)
            np.multiply(net.top_vecs[i][0].cpu_diff().reshape(dy.shape), w, out=dy)
    if not hooks:
        return [("sum",) + _sum_part(rows, summed, lo, hi)], None
    net.add_hook("after_backward", after_backward)
    keep, start = [], 0       # [start, end) ranges of the flat buffer not gathered
    for s0, s1 in sorted(skip):
        if s0 > start:
            keep.append((start, s0))
        start = s1
    if start < total:
        keep.append((start, total))
    for k0, k1 in keep:
        c0, c1 = max(lo, k0), min(hi, k1)
        if c0 < c1:
            work.append(("sum",) + _sum_part(rows, summed, c0, c1, lo))
    return work, keep


def _sum_part(rows, summed, c0, c1, lo=None):
    """The reduce-scatter's work on columns [c0, c1) (``rows``: the share's columns of
    every replica's gradients, starting at ``lo``)."""
    lo = c0 if lo is None else lo
    return (rows[:, c0 - lo:c1 - lo], summed[c0:c1], np.empty(c1 - c0, np.float32),
            np.empty(c1 - c0, np.float32))


def _share_sum(work, weights, accumulate):
    """This share of the gradients' sum into the diffs (added to them where
    ``accumulate``): the weighted sum over the replicas' rows, and the gathered
    weights' rows of dW = DY^T X (one product over the whole batch)."""
    for item in work:
        if item[0] == "sum":
            _, rows, out, tmp, acc = item
            if accumulate:
                weighted_sum(weights, rows, acc, tmp)
                np.add(out, acc, out=out)
            else:
                weighted_sum(weights, rows, out, tmp)
        else:
            _, dy, x, out, scratch, start = item
            np.matmul(dy.T, x, out=scratch)
            part = scratch.reshape(-1)[start:start + out.size]
            if accumulate:
                np.add(out, part, out=out)
            else:
                out[...] = part


def _solver_pass(msg, summing, update, results, sumsq_at):
    """The message b"G": this share of sum_k w_k grads[k] into the diffs (or added to
    them), its sum of squares, the solver's update of the share (``_G``'s flags)."""
    flags, rate, scale, it = _G.unpack(msg[1:])
    apply, sumsq, work = update
    if flags & _SUM:
        _share_sum(work, summing[0], flags & _ACC)
    if flags & _SUMSQ:
        results[sumsq_at] = float(sumsq())
    if flags & _UPDATE:
        apply(rate, it, scale)
