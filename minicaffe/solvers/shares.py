"""The solver's update run by the CPU replicas' workers, each on its share of the flat
buffers (engine/replicas.py; ``SGDSolver.share_update``).

The main process's update of LeNet's 431,080 floats took 2.2 ms a step on the 16-core
Xeon, serial while 16 workers waited.  Here each worker, right after summing its share
of the gradients into the (shared) diffs, applies the same update to the same columns of
the weights, the diffs and the history, which live in the pool's shared file: no pass
over the whole buffers in the main process.

The arithmetic is the solver class's own array body: the worker builds an instance of
the class (never initialised: no net, no data) whose ``net.learnable_params`` and
``history`` are the pieces of its share, one per parameter it overlaps, and calls its
``update_params`` (normalise, regularise, the rule, ``w -= update``) with the rate and
iteration the main process sends.  Elementwise numpy on a piece rounds each element as
on the whole blob, so the workers give the bits of the main process's update of the same
diffs.  clip_gradients needs the norm of every diff: each worker adds its share's sum of
squares (``sumsq``), the main process adds the shares' in order and sends the scale
(``SGDSolver.clip_scale``), which the worker applies before the update; the norm is then
rounded in another order than one process's.
"""
import numpy as np

from ..proto import caffe_pb2


class _Piece:
    """One parameter's columns of a share, as the update rules see a Blob: its data and,
    for a parameter, its diff (numpy views into the shared file)."""

    def __init__(self, data, diff=None):
        self.data_, self.diff_ = data, diff
        self.dtype, self.shape = data.dtype, data.shape

    def data_for(self, xp):
        return self.data_

    def diff_for(self, xp):
        return self.diff_

    mutable_data_for, mutable_diff_for = data_for, diff_for

    def sumsq_diff(self):
        return float((self.diff_ * self.diff_).sum())

    def scale_diff(self, factor):
        self.diff_ *= factor

    def update(self):
        self.data_ -= self.diff_


class _PieceNet:
    """What the update rules read of a Net, for a share's pieces."""

    def __init__(self, pieces, lr, decay):
        self.learnable_params, self.params_lr, self.params_weight_decay = pieces, lr, decay

    def update(self):
        for p in self.learnable_params:
            p.update()


class ShareUpdate:
    """What a worker needs to update its share (picklable: the solver class by name, its
    parameters, each parameter's lr_mult, decay_mult, offset and count in the flat
    layout)."""

    def __init__(self, solver):
        fb = solver.net.flat_params()
        self.cls = type(solver)
        p = caffe_pb2.SolverParameter()
        p.CopyFrom(solver.param)
        for f in ("net_param", "train_net_param"):     # the nets are not needed
            p.ClearField(f)
        del p.test_net_param[:]
        self.param = p.SerializeToString()
        self.lr = [float(x) for x in solver.net.params_lr]
        self.decay = [float(x) for x in solver.net.params_weight_decay]
        self.offsets, self.counts = list(fb.offsets), list(fb.counts)
        self.clips = solver.param.clip_gradients >= 0

    def bind(self, weights, diff, history, lo, hi):
        """The update of columns [lo, hi) of the flat ``weights``, ``diff`` and each
        history set (``history``: the solver's ``n_history_sets`` flat arrays): a function
        ``(rate, iteration, scale)`` (``scale``: clip_gradients' factor, 1 for none) and a
        function giving the share's sum of squared diffs."""
        pieces, hist, lr, decay = [], [[] for _ in history], [], []
        for i, (off, count) in enumerate(zip(self.offsets, self.counts)):
            a, b = max(lo, off), min(hi, off + count)
            if a >= b:
                continue     # another share's parameter, or the gap after one (zeros)
            pieces.append(_Piece(weights[a:b], diff[a:b]))
            lr.append(self.lr[i])
            decay.append(self.decay[i])
            for h, arr in zip(hist, history):
                h.append(_Piece(arr[a:b]))
        solver = self.cls.__new__(self.cls)
        solver.param = caffe_pb2.SolverParameter.FromString(self.param)
        solver.net = _PieceNet(pieces, lr, decay)
        solver.history = [h for group in hist for h in group]
        solver._temp = {}
        solver.iter = 0

        def update(rate, iteration, scale):
            if scale != 1:
                for p in pieces:
                    p.scale_diff(np.float32(scale))
            solver.iter = iteration
            solver.update_params(np, rate)

        def sumsq():
            from .sgd_solvers import sumsq_diffs
            return sumsq_diffs(pieces)
        return update, sumsq
