"""SGD and its relatives: Caffe's ``sgd_solver.cpp`` and the five solvers built on it.

Each iteration's update (``apply_update``), for every learnable parameter, in
this order:

1. clip_gradients: if the global L2 norm of all diffs exceeds it, scale every
   diff by clip_gradients / norm (logged as Caffe logs it);
2. normalize: diff /= iter_size;
3. regularize: diff += weight_decay * decay_mult * (w for L2 | sign(w) for L1);
4. the type's rule with local_rate = lr * lr_mult (g = diff, h = history):

   - SGD:      h = momentum h + local_rate g;  g = h
   - Nesterov: h' = momentum h + local_rate g;  g = (1 + momentum) h' - momentum h
   - AdaGrad:  h += g^2;  g = local_rate g / (sqrt(h) + delta)
   - RMSProp:  h = rms_decay h + (1 - rms_decay) g^2;  g = local_rate g / (sqrt(h) + delta)
   - AdaDelta: h = momentum h + (1 - momentum) g^2;
               g *= sqrt((h2 + delta) / (h + delta));
               h2 = momentum h2 + (1 - momentum) g^2;  g *= local_rate
   - Adam:     m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;
               g = local_rate sqrt(1 - beta2^t) / (1 - beta1^t) m / (sqrt(v) + delta),
               t = iter + 1, beta1 = momentum, beta2 = momentum2

5. w -= g (``Net.update``).

AdaDelta and Adam keep a second set of history blobs after the first (Caffe's
layout, so their .solverstate files hold 2 x params blobs).

Each rule is written twice, side by side in its class and nowhere else: the array body
``compute_update_value(xp, i, rate)`` (one body for numpy and CuPy: the CPU, and a GPU
run layer by layer with debug_info), and ``fused_rule``, the same arithmetic in CUDA for
the GPU step's one-kernel update (solvers/fused.py builds the kernel from it), whose
scalars ``fused_scalars()`` gives.  Written in the same order of operations, compiled
without multiply-add contraction, the kernel rounds each element as the array body does.
"""
import math

import numpy as np

from ..core import context, log
from ..core.blob import Blob
from ..core.errors import ConfigError, MinicaffeError
from ..proto import caffe_pb2
from . import lr_policy, snapshot as snap
from .solver import Solver, _fmt

_SOLVERS = {}


def register_solver(name):
    def deco(cls):
        cls.type = name
        _SOLVERS[name] = cls
        return cls
    return deco


def solver_type_list():
    return sorted(_SOLVERS)


def solver_class(name, source="solver"):
    cls = _SOLVERS.get(name)
    if cls is None:
        raise ConfigError(f"{source}: unknown solver type '{name}' "
                          f"(known: {', '.join(solver_type_list())})")
    return cls


# the steps of the array-side update that the fused GPU kernel does all of
_FUSED_STEPS = ("apply_update", "clip_gradients", "normalize", "regularize",
                "compute_update_value", "_update_inputs", "_local_rate", "update_params")


class SGDSolver(Solver):
    """Stochastic gradient descent with momentum (Caffe's SGDSolver)."""

    n_history_sets = 1
    # (the kernel's extra scalar parameters, history sets, CUDA body) of the fused GPU
    # update (solvers/fused.py): g is the regularised gradient, lr the local rate, h/h2
    # the histories, sc[1] the per-iteration extra scalar; the body sets u (the update)
    fused_rule = ("float momentum", 1,
                  "T hi = momentum * h[i] + lr * g; h[i] = hi; u = hi;")

    def fused_scalars(self):
        """The rule's constant scalars in ``fused_rule``'s order (float32, as the array
        body's)."""
        return (np.float32(self.param.momentum),)

    def __init_subclass__(cls, **kwargs):
        """A subclass that writes its own update (any step of it the fused kernel does:
        ``_FUSED_STEPS``) without its own ``fused_rule`` has none, rather than the
        parent's kernel computing another rule: the GPU then runs its array body layer by
        layer (``Solver.uses_gpu_step`` is False)."""
        super().__init_subclass__(**kwargs)
        if "fused_rule" not in vars(cls) and any(k in vars(cls) for k in _FUSED_STEPS):
            cls.fused_rule = None

    def pre_solve(self):
        # the parameters, their diffs and each history set live in flat buffers of one
        # layout: the GPU update is one kernel over them, multi-GPU reduces slices of them
        flat = self.net.flat_params()
        self.history = []
        self.history_flat = []
        for _ in range(self.n_history_sets):
            hist = [Blob(b.shape, b.dtype) for b in self.net.learnable_params]
            self.history_flat.append(flat.like(hist))
            self.history.extend(hist)
        self._temp = {}

    def fused_update(self):
        """The update op the engine's GPU step runs (engine/step.py): this solver's rule
        as one kernel over the flat buffers (solvers/fused.py).  The solver hands it to
        the engine, which imports nothing of the solvers."""
        from .fused import FusedUpdate
        return FusedUpdate(self)

    # -- helpers ------------------------------------------------------------------------
    def _tmp(self, xp, i, shape, dtype, k=0):
        """A scratch array per (param, slot, array module), reused every iteration."""
        key = (i, k, xp is np)
        a = self._temp.get(key)
        if a is None or a.shape != shape or a.dtype != dtype:
            a = self._temp[key] = xp.empty(shape, dtype)
        return a

    def get_learning_rate(self):
        rate, self.current_step = lr_policy.learning_rate(self.param, self.iter,
                                                          self.current_step,
                                                          log_steps=self.root)
        return rate

    # -- the update ---------------------------------------------------------------------
    def apply_update(self):
        rate = self.get_learning_rate()
        self.log_rate(rate)
        self.clip_gradients()
        self.update_params(context.xp(), rate)

    def log_rate(self, rate):
        """Caffe's "Iteration N, lr = ..." line, at the display iterations."""
        p = self.param
        if self.root and p.display and self.iter % p.display == 0:
            log.info("Iteration %d, lr = %s", self.iter, _fmt(rate))

    def update_params(self, xp, rate):
        """After the clipping: each learnable parameter's normalisation, regularisation and
        rule, then ``w -= update``."""
        for i in range(len(self.net.learnable_params)):
            self.normalize(xp, i)
            self.regularize(xp, i)
            self.compute_update_value(xp, i, rate)
        self.net.update()

    def clip_gradients(self):
        if np.float32(self.param.clip_gradients) < 0:
            return
        params = self.net.learnable_params
        scale = self.clip_scale(sumsq_diffs(params))
        if scale is not None:
            for b in params:
                b.scale_diff(scale)

    def clip_scale(self, sumsq):
        """The factor clip_gradients scales every diff by, given the diffs' sum of squares
        (float32), logged as Caffe logs it; None when the norm is within the clip."""
        clip = np.float32(self.param.clip_gradients)
        l2norm = np.float32(math.sqrt(sumsq))
        if not l2norm > clip:
            return None
        scale = np.float32(clip / l2norm)
        if self.root:
            log.info("Gradient clipping: scaling down gradients (L2 norm %s > %s) by scale "
                     "factor %s", _fmt(l2norm), _fmt(clip), _fmt(scale))
        return scale

    def share_update(self):
        """This solver's update for the CPU replicas' workers, each on its share of the
        flat buffers (solvers/shares.py; engine/replicas.py runs it), or None where only
        this process can run it: a solver class of the user's own (a worker could not
        import it), or loss scaling."""
        if type(self) is not _SOLVERS.get(self.type) or \
                type(self).__module__ != __name__ or self.loss_scaler is not None:
            return None
        from .shares import ShareUpdate
        return ShareUpdate(self)

    def normalize(self, xp, i):
        if self.param.iter_size == 1:
            return
        b = self.net.learnable_params[i]
        g = b.mutable_diff_for(xp)
        dt = g.dtype.type
        g *= dt(1) / dt(self.param.iter_size)

    def regularize(self, xp, i):
        b = self.net.learnable_params[i]
        dt = b.dtype.type
        local_decay = dt(np.float32(self.param.weight_decay) *
                         np.float32(self.net.params_weight_decay[i]))
        if not local_decay:
            return
        w = b.data_for(xp)
        g = b.mutable_diff_for(xp)
        t = self._tmp(xp, i, g.shape, g.dtype, 9)
        if self.param.regularization_type == "L2":
            xp.multiply(w, local_decay, out=t)
        else:  # L1
            xp.sign(w, out=t)
            t *= local_decay
        g += t

    def _update_inputs(self, xp, i, rate):
        """Param i's dtype scalar type, its rate (lr x lr_mult), its gradient (which the
        update rule overwrites with the update) and its first history blob."""
        b = self.net.learnable_params[i]
        dt = b.dtype.type
        return dt, self._local_rate(i, rate, dt), b.mutable_diff_for(xp), \
            self.history[i].mutable_data_for(xp)

    def _local_rate(self, i, rate, dt):
        return dt(np.float32(rate) * np.float32(self.net.params_lr[i]))

    def compute_update_value(self, xp, i, rate):
        dt, local_rate, g, h = self._update_inputs(xp, i, rate)
        momentum = dt(self.param.momentum)
        t = self._tmp(xp, i, g.shape, g.dtype)
        h *= momentum
        xp.multiply(g, local_rate, out=t)
        h += t
        g[...] = h

    # -- solver state ---------------------------------------------------------------------
    def _state(self, model_filename):
        return snap.SolverStateData(self.iter, model_filename, self.current_step,
                                    [(h.shape, h.cpu_data()) for h in self.history],
                                    self.resume_state())

    def snapshot_solver_state(self, model_filename):
        state = self._state(model_filename)
        if self.param.snapshot_format == caffe_pb2.SolverParameter.HDF5:
            filename = self.snapshot_filename(".solverstate.h5")
            log.info("Snapshotting solver state to HDF5 file %s", filename)
            snap.write_hdf5_state(filename, state)
        else:
            filename = self.snapshot_filename(".solverstate")
            log.info("Snapshotting solver state to binary proto file %s", filename)
            snap.write_binary_state(filename, state)
        return filename

    def restore_solver_state(self, state_file):
        state = snap.read_state(state_file)
        self._check_history(state, state_file)
        if state.learned_net:
            weights = snap.resolve_learned_net(state.learned_net, state_file)
            if weights is None:
                raise MinicaffeError(f"{state_file}: the weights it names, "
                                     f"'{state.learned_net}', were not found (looked relative "
                                     "to the working directory and to the state file)")
            self.net.copy_from(weights)
        self.iter = state.iter
        self.current_step = state.current_step
        log.info("%s: restoring history", type(self).__name__)
        for h, (shape, arr) in zip(self.history, state.history):
            h.mutable_cpu_data()[...] = np.asarray(arr, dtype=h.dtype).reshape(h.shape)
        self.restore_resume_state(state.resume, state_file)

    def _check_history(self, state, state_file):
        params = self.net.learnable_params
        n = len(self.history)
        if len(state.history) != n:
            raise MinicaffeError(
                f"{state_file} does not match the net: it holds {len(state.history)} history "
                f"blobs, a {self.type} solver for this net needs {n} "
                f"({len(params)} learnable params x {self.n_history_sets})")
        names = self._param_names()
        for k, (shape, arr) in enumerate(state.history):
            want = self.history[k].shape
            if np.asarray(arr).size != self.history[k].count() or \
                    not snap.shapes_compatible(shape, want):
                raise MinicaffeError(
                    f"{state_file} does not match the net: history blob {k} has shape "
                    f"{tuple(shape)}, param {names[k % len(params)]} has shape {want}")

    def _param_names(self):
        net = self.net
        out = []
        for pid in range(len(net.params_)):
            if net.param_owners[pid] == -1:
                lid, j = net.param_layer_indices[pid]
                out.append(f"'{net.layer_names[lid]}' #{j}")
        return out


@register_solver("Nesterov")
class NesterovSolver(SGDSolver):
    """Nesterov's accelerated gradient (Caffe's NesterovSolver)."""

    fused_rule = ("float momentum", 1,
                  "T hp = h[i]; T hn = momentum * hp + lr * g; h[i] = hn;"
                  " u = ((T)1 + momentum) * hn - momentum * hp;")

    def fused_scalars(self):
        return (np.float32(self.param.momentum),)

    def compute_update_value(self, xp, i, rate):
        dt, local_rate, g, h = self._update_inputs(xp, i, rate)
        momentum = dt(self.param.momentum)
        u = self._tmp(xp, i, g.shape, g.dtype)
        t = self._tmp(xp, i, g.shape, g.dtype, 1)
        u[...] = h
        h *= momentum
        xp.multiply(g, local_rate, out=t)
        h += t
        xp.multiply(h, dt(1) + momentum, out=g)
        u *= momentum
        g -= u


@register_solver("AdaGrad")
class AdaGradSolver(SGDSolver):
    """AdaGrad (Caffe's AdaGradSolver); momentum must be 0."""

    def check_params(self):
        if self.param.momentum != 0:
            raise ConfigError(f"{self.source}: momentum cannot be used with AdaGrad")

    fused_rule = ("float delta", 1,
                  "T hi = h[i] + g * g; h[i] = hi; u = lr * (g / (sqrt(hi) + delta));")

    def fused_scalars(self):
        return (np.float32(self.param.delta),)

    def compute_update_value(self, xp, i, rate):
        dt, local_rate, g, h = self._update_inputs(xp, i, rate)
        delta = dt(self.param.delta)
        u = self._tmp(xp, i, g.shape, g.dtype)
        xp.multiply(g, g, out=u)
        h += u
        xp.sqrt(h, out=u)
        u += delta
        xp.divide(g, u, out=u)
        xp.multiply(u, local_rate, out=g)


@register_solver("RMSProp")
class RMSPropSolver(SGDSolver):
    """RMSProp (Caffe's RMSPropSolver); momentum must be 0, 0 <= rms_decay <= 1."""

    def check_params(self):
        if self.param.momentum != 0:
            raise ConfigError(f"{self.source}: momentum cannot be used with RMSProp")
        if not 0 <= self.param.rms_decay <= 1:
            raise ConfigError(f"{self.source}: rms_decay should lie between 0 and 1")

    fused_rule = ("float rms_decay, float delta", 1,
                  "T hi = rms_decay * h[i] + ((T)1 - rms_decay) * (g * g); h[i] = hi;"
                  " u = lr * (g / (sqrt(hi) + delta));")

    def fused_scalars(self):
        return (np.float32(self.param.rms_decay), np.float32(self.param.delta))

    def compute_update_value(self, xp, i, rate):
        dt, local_rate, g, h = self._update_inputs(xp, i, rate)
        delta = dt(self.param.delta)
        rms_decay = dt(self.param.rms_decay)
        u = self._tmp(xp, i, g.shape, g.dtype)
        xp.multiply(g, g, out=u)
        u *= dt(1) - rms_decay
        h *= rms_decay
        h += u
        xp.sqrt(h, out=u)
        u += delta
        xp.divide(g, u, out=u)
        xp.multiply(u, local_rate, out=g)


@register_solver("AdaDelta")
class AdaDeltaSolver(SGDSolver):
    """AdaDelta (Caffe's AdaDeltaSolver): history of squared gradients, then a second
    history of squared updates."""

    n_history_sets = 2

    fused_rule = ("float momentum, float delta", 2,
                  "T om = (T)1 - momentum; T hi = momentum * h[i] + om * (g * g); h[i] = hi;"
                  " T gg = g * sqrt((h2[i] + delta) / (hi + delta));"
                  " h2[i] = momentum * h2[i] + om * (gg * gg); u = gg * lr;")

    def fused_scalars(self):
        return (np.float32(self.param.momentum), np.float32(self.param.delta))

    def compute_update_value(self, xp, i, rate):
        dt, local_rate, g, h = self._update_inputs(xp, i, rate)
        delta = dt(self.param.delta)
        momentum = dt(self.param.momentum)
        n = len(self.net.learnable_params)
        h2 = self.history[n + i].mutable_data_for(xp)
        u = self._tmp(xp, i, g.shape, g.dtype)
        t = self._tmp(xp, i, g.shape, g.dtype, 1)
        one_minus = dt(1) - momentum
        xp.multiply(g, g, out=u)
        u *= one_minus
        h *= momentum
        h += u
        xp.add(h2, delta, out=u)
        xp.add(h, delta, out=t)
        u /= t
        xp.sqrt(u, out=u)
        g *= u
        xp.multiply(g, g, out=u)
        u *= one_minus
        h2 *= momentum
        h2 += u
        g *= local_rate


@register_solver("Adam")
class AdamSolver(SGDSolver):
    """Adam (Caffe's AdamSolver): beta1 = momentum, beta2 = momentum2, eps = delta."""

    n_history_sets = 2

    def fused_extra(self):
        return self._correction(np.float32)

    def _correction(self, dt):
        # Caffe: sqrt(Dtype(1) - pow(beta2, t)) / (Dtype(1) - pow(beta1, t)), in double
        t_ = self.iter + 1
        beta1, beta2 = dt(self.param.momentum), dt(self.param.momentum2)
        return dt(math.sqrt(1.0 - float(beta2) ** t_) / (1.0 - float(beta1) ** t_))

    fused_rule = ("float beta1, float beta2, float eps_hat", 2,
                  "T mi = beta1 * h[i] + ((T)1 - beta1) * g;"
                  " T vi = beta2 * h2[i] + ((T)1 - beta2) * (g * g);"
                  " h[i] = mi; h2[i] = vi; u = (lr * sc[1]) * (mi / (sqrt(vi) + eps_hat));")

    def fused_scalars(self):
        return (np.float32(self.param.momentum), np.float32(self.param.momentum2),
                np.float32(self.param.delta))

    def compute_update_value(self, xp, i, rate):
        dt, local_rate, g, m = self._update_inputs(xp, i, rate)
        beta1 = dt(self.param.momentum)
        beta2 = dt(self.param.momentum2)
        eps_hat = dt(self.param.delta)
        correction = self._correction(dt)
        n = len(self.net.learnable_params)
        v = self.history[n + i].mutable_data_for(xp)
        u = self._tmp(xp, i, g.shape, g.dtype)
        m *= beta1
        xp.multiply(g, dt(1) - beta1, out=u)
        m += u
        xp.multiply(g, g, out=u)
        u *= dt(1) - beta2
        v *= beta2
        v += u
        xp.sqrt(v, out=u)
        u += eps_hat
        xp.divide(m, u, out=u)
        xp.multiply(u, dt(local_rate * correction), out=g)


register_solver("SGD")(SGDSolver)


def sumsq_diffs(blobs):
    """The diffs' sum of squares as clip_gradients adds it: each blob's, in order, in
    float32."""
    sumsq = np.float32(0)
    for b in blobs:
        sumsq = np.float32(sumsq + np.float32(b.sumsq_diff()))
    return sumsq


def get_solver(source, **kwargs):
    """A solver of the type its SolverParameter names (pycaffe's ``get_solver``):
    ``source`` is a path (.prototxt/.yaml), prototxt text or a SolverParameter."""
    from .param import read_solver_param
    param, path = read_solver_param(source)
    cls = solver_class(param.type, path or "solver")
    return cls(param, source=path, **kwargs)
