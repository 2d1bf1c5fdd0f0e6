"""pycaffe's Python-side Net helpers, Timer and NCCL (python/caffe/pycaffe.py, _caffe.cpp).

As pycaffe does, the helpers are attached to :class:`minicaffe.network.net.Net` here, so a Net
made anywhere (by a solver, a test, the CLI) has the whole pycaffe surface:

- ``_layer_names``, ``_blob_names``, ``_inputs``, ``_outputs``, ``_top_ids(i)``,
  ``_bottom_ids(i)``, ``_forward(start, end)``, ``_backward(start, end)``: the private
  names pycaffe scripts sometimes reach for;
- ``forward_all`` / ``forward_backward_all``: run many samples through a fixed-batch net,
  padding the last batch with zeros and dropping the padding from the results;
- ``set_input_arrays(data, labels)``: feed a MemoryData first layer, with pycaffe's checks;
- ``before_forward`` / ``after_forward`` / ``before_backward`` / ``after_backward``:
  register ``fn(layer_index)`` hooks.

``Net.forward``/``backward``/``blobs``/``params``/``blob_loss_weights``... live in net.py.
"""
import collections
import itertools
import time

import numpy as np

from ..core import backend, context
from ..core.errors import MinicaffeError
from ..network.net import Net


# -- private pycaffe names ---------------------------------------------------------------
def _layer_names(self):
    return list(self.layer_names)


def _blob_names(self):
    return list(self.blob_names)


def _inputs(self):
    return list(self.input_blob_indices)


def _outputs(self):
    return list(self.output_blob_indices)


def _top_ids(self, i):
    return list(self.top_id_vecs[i])


def _bottom_ids(self, i):
    return list(self.bottom_id_vecs[i])


def _forward(self, start, end):
    """Caffe's ForwardFromTo(start, end) by layer index; returns the loss."""
    return self.forward_from_to(start, end)


def _backward(self, start, end):
    """Caffe's BackwardFromTo(start, end) by layer index."""
    self.backward_from_to(start, end)


# -- batching ----------------------------------------------------------------------------------
def _batch(self, blobs):
    """Yield {name: batch} dicts of the net's batch size; the last batch is padded with
    zeros (pycaffe's Net._batch)."""
    num = len(next(iter(blobs.values())))
    batch_size = next(iter(self.blobs.values())).shape[0]
    remainder = num % batch_size
    for b in range(num // batch_size):
        i = b * batch_size
        yield {name: blobs[name][i:i + batch_size] for name in blobs}
    if remainder > 0:
        padded = {}
        for name in blobs:
            arr = np.asarray(blobs[name])
            padding = np.zeros((batch_size - remainder,) + arr.shape[1:], dtype=arr.dtype)
            padded[name] = np.concatenate([arr[-remainder:], padding])
        yield padded


def forward_all(self, blobs=None, **kwargs):
    """Run the net forward over all samples in ``kwargs`` (input name -> array of any
    length), batch by batch; return {output (and ``blobs``) name: array of all samples}."""
    if not kwargs:  # nothing to batch: one forward from the data layers
        return {k: v.copy() for k, v in self.forward(blobs=blobs).items()}
    all_outs = {out: [] for out in set(self.outputs + list(blobs or []))}
    for batch in self._batch(kwargs):
        outs = self.forward(blobs=blobs, **batch)
        for out, out_blob in outs.items():
            all_outs[out].extend(out_blob.copy())
    for out in all_outs:
        all_outs[out] = np.asarray(all_outs[out])
    if all_outs and kwargs:
        pad = len(next(iter(all_outs.values()))) - len(next(iter(kwargs.values())))
        if pad:
            for out in all_outs:
                all_outs[out] = all_outs[out][:-pad]
    return all_outs


def forward_backward_all(self, blobs=None, diffs=None, **kwargs):
    """Forward and backward in batches.  ``kwargs`` holds inputs (for forward) and output
    diffs (for backward); returns ({blob name: data}, {blob name: diff})."""
    all_outs = {out: [] for out in set(self.outputs + list(blobs or []))}
    all_diffs = {diff: [] for diff in set(self.inputs + list(diffs or []))}
    forward_batches = self._batch({k: kwargs[k] for k in self.inputs if k in kwargs}) \
        if any(k in kwargs for k in self.inputs) else iter(())
    backward_batches = self._batch({k: kwargs[k] for k in self.outputs if k in kwargs}) \
        if any(k in kwargs for k in self.outputs) else iter(())
    for fb, bb in itertools.zip_longest(forward_batches, backward_batches, fillvalue={}):
        batch_blobs = self.forward(blobs=blobs, **fb)
        batch_diffs = self.backward(diffs=diffs, **bb)
        for out, arr in batch_blobs.items():
            all_outs[out].extend(arr.copy())
        for diff, arr in batch_diffs.items():
            all_diffs[diff].extend(arr.copy())
    for out in all_outs:
        all_outs[out] = np.asarray(all_outs[out])
    for diff in all_diffs:
        all_diffs[diff] = np.asarray(all_diffs[diff])
    if all_outs and kwargs:
        pad = len(next(iter(all_outs.values()))) - len(next(iter(kwargs.values())))
        if pad:
            for out in all_outs:
                all_outs[out] = all_outs[out][:-pad]
            for diff in all_diffs:
                all_diffs[diff] = all_diffs[diff][:-pad]
    return all_outs, all_diffs


# -- MemoryData input ---------------------------------------------------------------------------
def _check_array(arr, name, channels, height, width):
    if not isinstance(arr, np.ndarray):
        raise MinicaffeError(f"set_input_arrays: {name} must be a numpy array")
    if not arr.flags["C_CONTIGUOUS"]:
        raise MinicaffeError(f"set_input_arrays: {name} must be C contiguous")
    if arr.ndim != 4:
        raise MinicaffeError(f"set_input_arrays: {name} must be 4-d, got shape {arr.shape}")
    if arr.dtype != np.float32:
        raise MinicaffeError(f"set_input_arrays: {name} must be float32, got {arr.dtype}")
    if arr.shape[1] != channels:
        raise MinicaffeError(f"set_input_arrays: {name} has wrong number of channels "
                             f"({arr.shape[1]}, the layer wants {channels})")
    if arr.shape[2] != height:
        raise MinicaffeError(f"set_input_arrays: {name} has wrong height "
                             f"({arr.shape[2]}, the layer wants {height})")
    if arr.shape[3] != width:
        raise MinicaffeError(f"set_input_arrays: {name} has wrong width "
                             f"({arr.shape[3]}, the layer wants {width})")


def set_input_arrays(self, data, labels):
    """Give the MemoryData first layer its arrays: ``data`` float32 C-contiguous
    (N, C, H, W), ``labels`` float32 (N,) or (N, 1, 1, 1); N a multiple of the batch size.
    The layer keeps the arrays (no copy), as Caffe does."""
    if not self.layers or self.layers[0].type != "MemoryData":
        raise MinicaffeError("set_input_arrays may only be called if the first layer is a "
                             "MemoryDataLayer")
    if isinstance(labels, np.ndarray) and labels.ndim == 1:
        labels = np.ascontiguousarray(labels[:, np.newaxis, np.newaxis, np.newaxis])
    md = self.layers[0]
    c, h, w = md.shape
    _check_array(data, "data array", c, h, w)
    _check_array(labels, "labels array", 1, 1, 1)
    if data.shape[0] != labels.shape[0]:
        raise MinicaffeError("set_input_arrays: data and labels must have the same first "
                             f"dimension ({data.shape[0]} vs {labels.shape[0]})")
    if data.shape[0] % md.batch_size != 0:
        raise MinicaffeError("set_input_arrays: first dimensions of input arrays must be a "
                             f"multiple of batch size ({data.shape[0]} vs {md.batch_size})")
    md.reset(data, labels)


# -- hooks ----------------------------------------------------------------------------------------
def before_forward(self, fn):
    """Call ``fn(layer_index)`` before each layer's forward."""
    self.add_hook("before_forward", fn)


def after_forward(self, fn):
    """Call ``fn(layer_index)`` after each layer's forward."""
    self.add_hook("after_forward", fn)


def before_backward(self, fn):
    """Call ``fn(layer_index)`` before each layer's backward."""
    self.add_hook("before_backward", fn)


def after_backward(self, fn):
    """Call ``fn(layer_index)`` after each layer's backward (an NCCL object works too)."""
    self.add_hook("after_backward", fn)


_ATTACH = {
    "_layer_names": property(_layer_names),
    "_blob_names": property(_blob_names),
    "_inputs": property(_inputs),
    "_outputs": property(_outputs),
    "_top_ids": _top_ids,
    "_bottom_ids": _bottom_ids,
    "_forward": _forward,
    "_backward": _backward,
    "_batch": _batch,
    "forward_all": forward_all,
    "forward_backward_all": forward_backward_all,
    "set_input_arrays": set_input_arrays,
    "before_forward": before_forward,
    "after_forward": after_forward,
    "before_backward": before_backward,
    "after_backward": after_backward,
}

for _name, _fn in _ATTACH.items():
    # net.py may grow its own version of a helper: keep that one.
    if not hasattr(Net, _name):
        setattr(Net, _name, _fn)


# -- Timer ------------------------------------------------------------------------------------------
class Timer:
    """Caffe's Timer: ``start()``, ``stop()``, ``ms``/``seconds``/``us``.

    In GPU mode (at ``start``) it records CUDA events on the current stream, so it measures
    GPU time; otherwise the wall clock.  Reading ``ms`` of a running timer stops it first,
    as Caffe's does."""

    def __init__(self):
        self.running = False
        self.has_run_at_least_once = False
        self._gpu = False
        self._t0 = self._t1 = 0.0
        self._ev0 = self._ev1 = None
        self._elapsed_ms = 0.0

    @property
    def uses_events(self):
        """True when the last ``start`` was in GPU mode: the timer measures GPU time with
        CUDA events rather than the wall clock."""
        return self._gpu

    def start(self):
        if self.running:
            return
        self._gpu = context.is_gpu()
        if self._gpu:
            if self._ev0 is None:
                self._ev0, self._ev1 = backend.new_event(), backend.new_event()
            self._ev0.record()
        else:
            self._t0 = time.perf_counter()
        self.running = True
        self.has_run_at_least_once = True

    def stop(self):
        if not self.running:
            return
        if self._gpu:
            self._ev1.record()
            self._ev1.synchronize()
            self._elapsed_ms = float(backend.elapsed_ms(self._ev0, self._ev1))
        else:
            self._t1 = time.perf_counter()
            self._elapsed_ms = (self._t1 - self._t0) * 1e3
        self.running = False

    def milliseconds(self):
        if not self.has_run_at_least_once:
            return 0.0
        if self.running:
            self.stop()
        return self._elapsed_ms

    def microseconds(self):
        return self.milliseconds() * 1e3

    def seconds_(self):
        return self.milliseconds() / 1e3

    ms = property(milliseconds)
    us = property(microseconds)
    seconds = property(seconds_)


# -- NCCL -------------------------------------------------------------------------------------------
def _nccl_module():
    from ..multigpu.comm import nccl_module
    return nccl_module()


def has_nccl():
    """True when CuPy with NCCL is usable (pycaffe: built with USE_NCCL)."""
    return _nccl_module() is not None and backend.gpu_count() > 0


class NCCL:
    """pycaffe's NCCL: ``NCCL(solver, uid)``, ``NCCL.new_uid()``, ``bcast()``, and as
    callbacks ``solver.add_callback(nccl)`` (gradients summed over the ranks and scaled by
    1/solver_count) and ``net.after_backward(nccl)`` (the same, layer by layer, when the
    solver's ``layer_wise_reduce`` is set).  One rank per process or per thread; each sets
    its device, ``set_solver_count`` and ``set_solver_rank`` first, as pycaffe's train.py.
    Built on :class:`minicaffe.multigpu.comm.NcclComm`; ``minicaffe train --gpu 0,1`` (P2PManager,
    ``minicaffe.multigpu.parallel``) is the bucketed, overlapped version of the same thing.

    Without CuPy's NCCL (``has_nccl()`` False) making one raises a clear error."""

    def __init__(self, solver, uid):
        if _nccl_module() is None or backend.gpu_count() == 0:
            raise MinicaffeError("multi-GPU NCCL is not available: it needs CuPy with NCCL "
                                 "(cupy.cuda.nccl) and a CUDA GPU; "
                                 f"{backend.why_no_gpu() if backend.gpu_count() == 0 else 'NCCL missing'}")
        from ..multigpu.comm import NcclComm
        self.solver = solver
        self.count = context.solver_count()
        self.rank = context.solver_rank()
        self.comm = NcclComm(self.count, uid, self.rank)
        self.params = list(solver.net.learnable_params)
        net = solver.net
        self._layer_params = [
            [net.learnable_params[net.learnable_param_ids[pid]] for pid in net.param_id_vecs[lid]
             if net.param_owners[pid] < 0]
            for lid in range(len(net.layers))]

    @staticmethod
    def new_uid():
        if _nccl_module() is None:
            raise MinicaffeError("multi-GPU NCCL is not available: it needs CuPy with NCCL "
                                 "(cupy.cuda.nccl)")
        from ..multigpu.comm import NcclComm
        return NcclComm.new_uid()

    def _layer_wise(self):
        return getattr(self.solver.param, "layer_wise_reduce", True)

    def bcast(self):
        """Broadcast the root's parameters to every rank."""
        stream = backend.current_stream()
        for b in self.params:
            self.comm.bcast(b.mutable_gpu_data(), 0, stream)
        stream.synchronize()

    def _allreduce(self, blobs):
        stream = backend.current_stream()
        for b in blobs:
            d = b.mutable_gpu_diff()
            self.comm.allreduce(d, stream)
            if self.count > 1:
                d *= 1.0 / self.count

    # net callback (after_backward)
    def __call__(self, layer_index):
        if self._layer_wise():
            self._allreduce(self._layer_params[layer_index])

    run = __call__

    # solver callback
    def on_start(self):
        pass

    def on_gradients_ready(self):
        if self._layer_wise():
            backend.current_stream().synchronize()
        else:
            self._allreduce(self.params)
