"""Recurrent layers: RNN, LSTM and LSTMUnit (Caffe's recurrent_layer, rnn_layer,
lstm_layer and lstm_unit_layer).

Caffe builds an unrolled internal Net for RNN and LSTM; here the recurrences are
written out directly, with Caffe's parameter blobs (same shapes, same order, so
a Caffe ``.caffemodel`` loads), Caffe's gate order (i, f, o, g) and Caffe's
``cont`` semantics.

Bottoms: ``x`` (T, N, ...) -- T timesteps of N independent streams, features
flattened from axis 2; ``cont`` (T, N) -- 0 where a sequence begins (the state
coming from step t-1 is dropped there), usually 1 elsewhere; optional
``x_static`` (N, ...) added to every step; with ``expose_hidden`` the initial
state follows as more bottoms (RNN: h_0; LSTM: h_0, c_0), each (1, N, H).
Tops: the output (T, N, H), and with ``expose_hidden`` the final state
(RNN: h_T; LSTM: h_T, c_T), each (1, N, H).

Without ``expose_hidden`` the state carries over from one forward to the next, as
in Caffe (it starts at zero and is reset to zero when N changes; ``reset()``
zeroes it); ``cont = 0`` at t = 0 starts fresh sequences.

LSTM, per step (W_xc (4H, I), b_c (4H), W_xc_static (4H, S), W_hc (4H, H))::

    h~ = cont_t * h_{t-1}
    [i', f', o', g'] = W_xc x_t + b_c + W_xc_static x_static + W_hc h~
    i, f, o = sigmoid(i', f', o');  g = tanh(g')
    c_t = cont_t * f * c_{t-1} + i * g;   h_t = o * tanh(c_t)

RNN, per step (W_xh (H, I), b_h (H), W_xh_static (H, S), W_hh (H, H), W_ho (H, H), b_o (H))::

    h_t = tanh(W_xh x_t + b_h + W_xh_static x_static + W_hh (cont_t * h_{t-1}))
    o_t = tanh(W_ho h_t + b_o)

Blob order: LSTM [W_xc, b_c, (W_xc_static,) W_hc]; RNN [W_xh, b_h, (W_xh_static,)
W_hh, W_ho, b_o] -- the order of the owned parameters of Caffe's unrolled net.

Differences from Caffe, all supersets: the number of timesteps may change between
reshapes (Caffe refuses); with ``expose_hidden`` the gradient reaches the h_0/c_0
bottoms and the diffs of the h_T/c_T tops are back-propagated (Caffe drops both);
``propagate_down`` and ``param_propagate_down`` are honoured (Caffe's unrolled net
always computes every gradient).  The forget-gate gradient is the exact
``cont * f (1 - f)`` (Caffe writes ``f_eff (1 - f_eff)``; the same for binary cont).

On the GPU each LSTM step's gate arithmetic runs as one fused kernel.
"""
import numpy as np

from ..core import log
from ..core.blob import Blob
from ..core.filler import fill
from .layer import Layer
from .registry import register_layer


def _sigmoid(xp, x):
    # 0.5 tanh(x/2) + 0.5 == 1 / (1 + exp(-x)), without overflow for large |x|
    return 0.5 * xp.tanh(0.5 * x) + 0.5


# -- the LSTM unit: numpy/cupy bodies and fused CUDA kernels -------------------------------

_UNIT_SRC = r"""
__device__ __forceinline__ T mc_sigmoid(T x) { return (T)0.5 * tanh((T)0.5 * x) + (T)0.5; }

extern "C" __global__ void mc_lstm_unit_fwd(
    const long long nthreads, const int H, const T* __restrict__ X,
    const T* __restrict__ C_prev, const T* __restrict__ cont,
    T* __restrict__ acts, T* __restrict__ C, T* __restrict__ Hout) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    const long long n = index / H;
    const long long d = index % H;
    const T* x = X + 4 * H * n;
    T* a = acts + 4 * H * n;
    const T i = mc_sigmoid(x[d]);
    const T f = mc_sigmoid(x[H + d]);
    const T o = mc_sigmoid(x[2 * H + d]);
    const T g = tanh(x[3 * H + d]);
    const T c = cont[n] * f * C_prev[index] + i * g;
    C[index] = c;
    Hout[index] = o * tanh(c);
    a[d] = i;
    a[H + d] = f;
    a[2 * H + d] = o;
    a[3 * H + d] = g;
  }
}

extern "C" __global__ void mc_lstm_unit_bwd(
    const long long nthreads, const int H, const T* __restrict__ acts,
    const T* __restrict__ C_prev, const T* __restrict__ C, const T* __restrict__ cont,
    const T* __restrict__ dH, const T* __restrict__ dC,
    T* __restrict__ dX, T* __restrict__ dC_prev) {
  CUDA_KERNEL_LOOP(index, nthreads) {
    const long long n = index / H;
    const long long d = index % H;
    const T* a = acts + 4 * H * n;
    T* dx = dX + 4 * H * n;
    const T i = a[d];
    const T f = a[H + d];
    const T o = a[2 * H + d];
    const T g = a[3 * H + d];
    const T cn = cont[n];
    const T tanh_c = tanh(C[index]);
    const T dh = dH[index];
    const T c_term = dC[index] + dh * o * ((T)1 - tanh_c * tanh_c);
    dC_prev[index] = c_term * cn * f;
    dx[d] = c_term * g * i * ((T)1 - i);
    dx[H + d] = c_term * C_prev[index] * cn * f * ((T)1 - f);
    dx[2 * H + d] = dh * tanh_c * o * ((T)1 - o);
    dx[3 * H + d] = c_term * i * ((T)1 - g * g);
  }
}
"""


def _kernel(name, dtype):
    from ..kernels._backend import cuda_type, raw_kernel
    return raw_kernel(_UNIT_SRC, name, cuda_type(dtype))


def lstm_unit_forward(xp, gates, c_prev, cont, acts=None, c=None, h=None):
    """One LSTM step's gate arithmetic.

    gates: (N, 4H) pre-activations [i', f', o', g']; c_prev: (N, H); cont: (N,).
    Returns (acts, c, h): acts (N, 4H) holds [i, f, o, g] after their
    nonlinearities (the backward needs them).  Output arrays may be passed in."""
    N, H = c_prev.shape
    acts = xp.empty_like(gates) if acts is None else acts
    c = xp.empty_like(c_prev) if c is None else c
    h = xp.empty_like(c_prev) if h is None else h
    if xp is np:
        acts[:, :3 * H] = _sigmoid(np, gates[:, :3 * H])
        acts[:, 3 * H:] = np.tanh(gates[:, 3 * H:])
        i, f, o, g = (acts[:, k * H:(k + 1) * H] for k in range(4))
        c[...] = cont[:, None] * f * c_prev + i * g
        h[...] = o * np.tanh(c)
    else:
        from ..kernels._backend import launch
        dt = gates.dtype
        k = _kernel("mc_lstm_unit_fwd", dt)
        c_ = xp.ascontiguousarray
        launch(k, N * H, (np.int64(N * H), np.int32(H), c_(gates), c_(c_prev, dtype=dt),
                          c_(cont, dtype=dt), acts, c, h))
    return acts, c, h


def lstm_unit_backward(xp, acts, c_prev, c, cont, dh, dc, dgates=None, dc_prev=None):
    """Gradients of one LSTM step: from dh, dc (N, H) -- the total gradients of h_t and
    c_t -- to the gate pre-activations (N, 4H) and to c_{t-1} (N, H)."""
    N, H = c_prev.shape
    dgates = xp.empty_like(acts) if dgates is None else dgates
    dc_prev = xp.empty_like(c_prev) if dc_prev is None else dc_prev
    if xp is np:
        i, f, o, g = (acts[:, k * H:(k + 1) * H] for k in range(4))
        cn = cont[:, None]
        tanh_c = np.tanh(c)
        c_term = dc + dh * o * (1 - tanh_c * tanh_c)
        dc_prev[...] = c_term * cn * f
        dgates[:, :H] = c_term * g * i * (1 - i)
        dgates[:, H:2 * H] = c_term * c_prev * cn * f * (1 - f)
        dgates[:, 2 * H:3 * H] = dh * tanh_c * o * (1 - o)
        dgates[:, 3 * H:] = c_term * i * (1 - g * g)
    else:
        from ..kernels._backend import launch
        dt = acts.dtype
        k = _kernel("mc_lstm_unit_bwd", dt)

        def c_(a):
            return xp.ascontiguousarray(a, dtype=dt)
        launch(k, N * H, (np.int64(N * H), np.int32(H), c_(acts), c_(c_prev), c_(c), c_(cont),
                          c_(dh), c_(dc), dgates, dc_prev))
    return dgates, dc_prev


@register_layer("LSTMUnit")
class LSTMUnitLayer(Layer):
    """One LSTM step (Caffe's LSTMUnit).  Bottoms: c_{t-1} (1, N, H), gate inputs
    (1, N, 4H) in the order [i, f, o, g], cont_t (1, N).  Tops: c_t, h_t (1, N, H).
    c_t = cont_t * sigmoid(f') * c_{t-1} + sigmoid(i') * tanh(g');
    h_t = sigmoid(o') * tanh(c_t).  No gradient to cont."""
    exact_num_bottom_blobs = 3
    exact_num_top_blobs = 2

    def layer_setup(self, bottom, top):
        self.acts = Blob(dtype=bottom[0].dtype)

    def reshape(self, bottom, top):
        n = bottom[0].shape[1] if bottom[0].num_axes >= 2 else -1
        for i, b in enumerate(bottom):
            want = 2 if i == 2 else 3
            if b.num_axes != want or b.shape[0] != 1 or b.shape[1] != n:
                raise self.error(f"bottom {i} must have shape (1, {n}{', ...' if want == 3 else ''})"
                                 f" with {want} axes, got {b.shape}")
        self.H = bottom[0].shape[2]
        if bottom[1].shape[2] != 4 * self.H:
            raise self.error(f"the gate input must have 4 * {self.H} = {4 * self.H} channels, "
                             f"got {bottom[1].shape}")
        self.N = n
        top[0].reshape(bottom[0].shape)
        top[1].reshape(bottom[0].shape)
        self.acts.reshape(bottom[1].shape)

    def forward_xp(self, xp, bottom, top):
        N, H = self.N, self.H
        lstm_unit_forward(xp, bottom[1].data_for(xp).reshape(N, 4 * H),
                          bottom[0].data_for(xp).reshape(N, H), bottom[2].data_for(xp).reshape(N),
                          acts=self.acts.mutable_data_for(xp).reshape(N, 4 * H),
                          c=top[0].mutable_data_for(xp).reshape(N, H),
                          h=top[1].mutable_data_for(xp).reshape(N, H))

    def backward_xp(self, xp, top, propagate_down, bottom):
        if propagate_down[2]:
            raise self.error("cannot backpropagate to sequence indicators (bottom 2)")
        if not (propagate_down[0] or propagate_down[1]):
            return
        N, H = self.N, self.H
        dgates, dc_prev = lstm_unit_backward(
            xp, self.acts.data_for(xp).reshape(N, 4 * H), bottom[0].data_for(xp).reshape(N, H),
            top[0].data_for(xp).reshape(N, H), bottom[2].data_for(xp).reshape(N),
            top[1].diff_for(xp).reshape(N, H), top[0].diff_for(xp).reshape(N, H))
        if propagate_down[0]:
            bottom[0].mutable_diff_for(xp)[...] = dc_prev.reshape(bottom[0].shape)
        if propagate_down[1]:
            bottom[1].mutable_diff_for(xp)[...] = dgates.reshape(bottom[1].shape)

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2


class RecurrentLayer(Layer):
    """Shared set-up for RNN and LSTM (Caffe's RecurrentLayer): bottoms, tops,
    parameter blobs, the carried state and the x/x_static projections."""
    min_bottom_blobs = 2
    min_top_blobs = 1
    state_names = ()     # recurrent state, e.g. ("h", "c")
    gate_mult = 1        # rows of the input projection per hidden unit (4 for LSTM)

    # -- set-up ---------------------------------------------------------------------------
    def param_names(self):
        raise NotImplementedError

    def param_shapes(self, I, S):
        raise NotImplementedError

    def layer_setup(self, bottom, top):
        rp = self.layer_param.recurrent_param
        self.H = int(rp.num_output)
        if self.H <= 0:
            raise self.error("recurrent_param.num_output must be positive")
        self._check_x_cont(bottom)
        T, N = bottom[0].shape[:2]
        log.info("Initializing recurrent layer: assuming input batch contains %d timesteps of "
                 "%d independent streams.", T, N)
        self.expose_hidden = bool(rp.expose_hidden)
        n_state = len(self.state_names)
        n_exposed = n_state if self.expose_hidden else 0
        self.static_input = len(bottom) > 2 + n_exposed
        want_bottom = 2 + int(self.static_input) + n_exposed
        if len(bottom) != want_bottom:
            names = ", ".join(f"{s}_0" for s in self.state_names)
            raise self.error(f"takes x, cont, an optional x_static"
                             f"{', then ' + names if self.expose_hidden else ''}: "
                             f"{len(bottom)} bottoms do not fit")
        if len(top) != 1 + n_exposed:
            raise self.error(f"produces {1 + n_exposed} top blob(s) "
                             f"({'with' if self.expose_hidden else 'without'} expose_hidden), "
                             f"got {len(top)}")
        if self.static_input:
            xs = bottom[2]
            if xs.num_axes < 1 or xs.shape[0] != N:
                raise self.error(f"the static input (bottom 2) must be ({N}, ...), got {xs.shape}")
        self.I = bottom[0].count(2)
        self.S = bottom[2].count(1) if self.static_input else 0
        dtype = bottom[0].dtype
        shapes = self.param_shapes(self.I, self.S)
        names = self.param_names()
        if self.blobs:
            if len(self.blobs) != len(shapes):
                raise self.error(f"expected {len(shapes)} parameter blobs "
                                 f"({', '.join(names)}), got {len(self.blobs)}")
            for name, b, s in zip(names, self.blobs, shapes):
                if tuple(b.shape) != s:
                    raise self.error(f"parameter {name} has shape {b.shape}, expected {s}")
        else:
            self.blobs = []
            for j, (name, s) in enumerate(zip(names, shapes)):
                b = Blob(s, dtype)
                filler = rp.bias_filler if name.startswith("b_") else rp.weight_filler
                fill(b, filler)
                self.blobs.append(b)
                log.info("Adding parameter %d: %s", j, name)
        self.param_propagate_down = [True] * len(self.blobs)
        self.state = [None] * n_state        # carried between forwards (no expose_hidden)

    def _check_x_cont(self, bottom):
        x, cont = bottom[0], bottom[1]
        if x.num_axes < 2:
            raise self.error(f"bottom 0 must have at least 2 axes -- (#timesteps, #streams, ...), "
                             f"got {x.shape}")
        if cont.num_axes != 2 or tuple(cont.shape) != tuple(x.shape[:2]):
            raise self.error(f"bottom 1 (cont) must have exactly 2 axes -- (#timesteps, #streams) "
                             f"= {tuple(x.shape[:2])}, got {cont.shape}")

    def reshape(self, bottom, top):
        self._check_x_cont(bottom)
        self.T, self.N = bottom[0].shape[:2]
        if bottom[0].count(2) != self.I:
            raise self.error(f"input size changed: bottom 0 {bottom[0].shape} gives "
                             f"{bottom[0].count(2)} features per step, the weights expect {self.I}")
        if self.static_input:
            xs = bottom[2]
            if xs.shape[0] != self.N or xs.count(1) != self.S:
                raise self.error(f"the static input (bottom 2) must be ({self.N}, {self.S} "
                                 f"features), got {xs.shape}")
        sshape = (1, self.N, self.H)
        if self.expose_hidden:
            off = 2 + int(self.static_input)
            for j, name in enumerate(self.state_names):
                b = bottom[off + j]
                if tuple(b.shape) != sshape:
                    raise self.error(f"bottom {off + j} ({name}_0) shape must match hidden state "
                                     f"input shape: {' '.join(map(str, sshape))}, got {b.shape}")
        top[0].reshape((self.T, self.N, self.H))
        for t in top[1:]:
            t.reshape(sshape)
        for j, s in enumerate(self.state):
            if s is not None and tuple(s.shape) != (self.N, self.H):
                self.state[j] = None

    def reset(self):
        """Zero the state carried from one forward to the next (Caffe's Reset)."""
        self.state = [None] * len(self.state_names)

    # -- helpers -----------------------------------------------------------------------------
    def _initial_state(self, xp, bottom):
        N, H = self.N, self.H
        dtype = bottom[0].dtype
        if self.expose_hidden:
            off = 2 + int(self.static_input)
            return [bottom[off + j].data_for(xp).reshape(N, H) for j in range(len(self.state_names))]
        out = []
        for s in self.state:
            if s is None:
                out.append(xp.zeros((N, H), dtype=dtype))
            elif xp is np:   # the state may come from a forward in the other mode
                out.append(s if isinstance(s, np.ndarray) else s.get())
            else:
                out.append(xp.asarray(s))
        return out

    def _keep_state(self, xp, top, finals):
        if self.expose_hidden:
            for j, v in enumerate(finals):
                top[1 + j].mutable_data_for(xp)[...] = v.reshape(1, self.N, self.H)
        else:
            self.state = [v.copy() for v in finals]

    def _project_inputs(self, xp, bottom, W_x, b, W_s):
        """W_x x_t + b (+ W_s x_static) for every t: (T, N, rows)."""
        x = bottom[0].data_for(xp).reshape(self.T * self.N, self.I)
        z = (x @ W_x.T).reshape(self.T, self.N, -1)
        z += b
        if W_s is not None:
            z += bottom[2].data_for(xp).reshape(self.N, self.S) @ W_s.T
        return z

    def _input_grads(self, xp, bottom, propagate_down, dz, W_x, i_W_x, i_b, W_s, i_W_s):
        """Accumulate the gradients of the input projection; write dx, dx_static."""
        TN = self.T * self.N
        dz2 = dz.reshape(TN, -1)
        x = bottom[0].data_for(xp).reshape(TN, self.I)
        if self.get_param_propagate_down(i_W_x):
            self.blobs[i_W_x].mutable_diff_for(xp)[...] += dz2.T @ x
        if self.get_param_propagate_down(i_b):
            self.blobs[i_b].mutable_diff_for(xp)[...] += dz2.sum(axis=0)
        if propagate_down[0]:
            bottom[0].mutable_diff_for(xp)[...] = (dz2 @ W_x).reshape(bottom[0].shape)
        if W_s is not None:
            dzs = dz.sum(axis=0)                          # (N, rows)
            xs = bottom[2].data_for(xp).reshape(self.N, self.S)
            if self.get_param_propagate_down(i_W_s):
                self.blobs[i_W_s].mutable_diff_for(xp)[...] += dzs.T @ xs
            if propagate_down[2]:
                bottom[2].mutable_diff_for(xp)[...] = (dzs @ W_s).reshape(bottom[2].shape)

    def _state_top_diffs(self, xp, top):
        if not self.expose_hidden:
            return [None] * len(self.state_names)
        return [top[1 + j].diff_for(xp).reshape(self.N, self.H)
                for j in range(len(self.state_names))]

    def _state_bottom_diffs(self, xp, bottom, propagate_down, grads):
        if not self.expose_hidden:
            return
        off = 2 + int(self.static_input)
        for j, g in enumerate(grads):
            if propagate_down[off + j]:
                bottom[off + j].mutable_diff_for(xp)[...] = g.reshape(1, self.N, self.H)

    def _debug(self, kind, what, values):
        if not self.layer_param.recurrent_param.debug_info:
            return
        for t, (layer, blob, v) in enumerate(values):
            mean = float(abs(v).sum()) / max(v.size, 1)
            log.info("    [%s] Layer %s_%s, %s blob %s %s: %g", kind, self.name, layer,
                     "top" if kind == "Forward" else "bottom", blob, what, mean)

    def _no_cont_backprop(self, propagate_down):
        if propagate_down[1]:
            raise self.error("cannot backpropagate to sequence indicators (bottom 1)")

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1


@register_layer("LSTM")
class LSTMLayer(RecurrentLayer):
    """Long short-term memory over T steps (see the module docstring for the maths)."""
    max_bottom_blobs = 5
    max_top_blobs = 3
    state_names = ("h", "c")

    def param_names(self):
        return ["W_xc", "b_c"] + (["W_xc_static"] if self.static_input else []) + ["W_hc"]

    def param_shapes(self, I, S):
        G = 4 * self.H
        return [(G, I), (G,)] + ([(G, S)] if self.static_input else []) + [(G, self.H)]

    def _weights(self, xp):
        W = [b.data_for(xp) for b in self.blobs]
        if self.static_input:
            return W[0], W[1], W[2], W[3]
        return W[0], W[1], None, W[2]

    def forward_xp(self, xp, bottom, top):
        T, N, H = self.T, self.N, self.H
        W_xc, b_c, W_s, W_hc = self._weights(xp)
        z = self._project_inputs(xp, bottom, W_xc, b_c, W_s)       # (T, N, 4H)
        cont = bottom[1].data_for(xp).reshape(T, N)
        h0, c0 = self._initial_state(xp, bottom)
        dtype = z.dtype
        acts = xp.empty((T, N, 4 * H), dtype=dtype)
        C = xp.empty((T + 1, N, H), dtype=dtype)
        hc = xp.empty((T, N, H), dtype=dtype)                     # cont_t * h_{t-1}
        out = top[0].mutable_data_for(xp).reshape(T, N, H)
        C[0] = c0
        h_prev = h0
        for t in range(T):
            xp.multiply(h_prev, cont[t][:, None], out=hc[t])
            gates = z[t]
            gates += hc[t] @ W_hc.T
            lstm_unit_forward(xp, gates, C[t], cont[t], acts=acts[t], c=C[t + 1], h=out[t])
            h_prev = out[t]
        self._cache = (acts, C, hc, cont)
        self._keep_state(xp, top, [out[T - 1], C[T]])
        self._debug("Forward", "data", [(f"unit_{t + 1}", f"c_{t + 1}", C[t + 1]) for t in range(T)]
                    + [(f"unit_{t + 1}", f"h_{t + 1}", out[t]) for t in range(T)])

    def backward_xp(self, xp, top, propagate_down, bottom):
        self._no_cont_backprop(propagate_down)
        T, N, H = self.T, self.N, self.H
        W_xc, b_c, W_s, W_hc = self._weights(xp)
        acts, C, hc, cont = self._cache
        dout = top[0].diff_for(xp).reshape(T, N, H)
        dhT, dcT = self._state_top_diffs(xp, top)
        dz = xp.empty((T, N, 4 * H), dtype=acts.dtype)
        dh_next = xp.zeros((N, H), dtype=acts.dtype) if dhT is None else dhT.copy()
        dc = xp.zeros((N, H), dtype=acts.dtype) if dcT is None else dcT.copy()
        for t in range(T - 1, -1, -1):
            dh = dout[t] + dh_next
            _, dc = lstm_unit_backward(xp, acts[t], C[t], C[t + 1], cont[t], dh, dc, dgates=dz[t])
            dh_next = (dz[t] @ W_hc) * cont[t][:, None]
        i_hc = 3 if self.static_input else 2
        if self.get_param_propagate_down(i_hc):
            self.blobs[i_hc].mutable_diff_for(xp)[...] += \
                dz.reshape(T * N, 4 * H).T @ hc.reshape(T * N, H)
        self._input_grads(xp, bottom, propagate_down, dz, W_xc, 0, 1, W_s, 2)
        self._state_bottom_diffs(xp, bottom, propagate_down, [dh_next, dc])
        self._debug("Backward", "diff", [(f"unit_{t + 1}", f"gate_input_{t + 1}", dz[t])
                                         for t in range(T)])


@register_layer("RNN")
class RNNLayer(RecurrentLayer):
    """Elman recurrent net over T steps with a tanh output layer (see the module
    docstring for the maths)."""
    max_bottom_blobs = 4
    max_top_blobs = 2
    state_names = ("h",)

    def param_names(self):
        return ["W_xh", "b_h"] + (["W_xh_static"] if self.static_input else []) + \
            ["W_hh", "W_ho", "b_o"]

    def param_shapes(self, I, S):
        H = self.H
        return [(H, I), (H,)] + ([(H, S)] if self.static_input else []) + \
            [(H, H), (H, H), (H,)]

    def _weights(self, xp):
        W = [b.data_for(xp) for b in self.blobs]
        if self.static_input:
            return W[0], W[1], W[2], W[3], W[4], W[5]
        return W[0], W[1], None, W[2], W[3], W[4]

    def forward_xp(self, xp, bottom, top):
        T, N, H = self.T, self.N, self.H
        W_xh, b_h, W_s, W_hh, W_ho, b_o = self._weights(xp)
        z = self._project_inputs(xp, bottom, W_xh, b_h, W_s)        # (T, N, H)
        cont = bottom[1].data_for(xp).reshape(T, N)
        (h0,) = self._initial_state(xp, bottom)
        hs = xp.empty((T, N, H), dtype=z.dtype)
        hc = xp.empty((T, N, H), dtype=z.dtype)
        h_prev = h0
        for t in range(T):
            xp.multiply(h_prev, cont[t][:, None], out=hc[t])
            a = z[t]
            a += hc[t] @ W_hh.T
            xp.tanh(a, out=hs[t])
            h_prev = hs[t]
        o = xp.tanh(hs.reshape(T * N, H) @ W_ho.T + b_o).reshape(T, N, H)
        top[0].mutable_data_for(xp)[...] = o.reshape(top[0].shape)
        self._cache = (hs, hc, cont, o)   # o kept apart: a later in-place layer may change top
        self._keep_state(xp, top, [hs[T - 1]])
        self._debug("Forward", "data", [(f"h_neuron_{t + 1}", f"h_{t + 1}", hs[t]) for t in range(T)]
                    + [(f"o_neuron_{t + 1}", f"o_{t + 1}", o[t]) for t in range(T)])

    def backward_xp(self, xp, top, propagate_down, bottom):
        self._no_cont_backprop(propagate_down)
        T, N, H = self.T, self.N, self.H
        W_xh, b_h, W_s, W_hh, W_ho, b_o = self._weights(xp)
        hs, hc, cont, o = self._cache
        k = 1 if self.static_input else 0
        i_hh, i_ho, i_bo = 2 + k, 3 + k, 4 + k
        o = o.reshape(T * N, H)
        do = top[0].diff_for(xp).reshape(T * N, H) * (1 - o * o)
        if self.get_param_propagate_down(i_ho):
            self.blobs[i_ho].mutable_diff_for(xp)[...] += do.T @ hs.reshape(T * N, H)
        if self.get_param_propagate_down(i_bo):
            self.blobs[i_bo].mutable_diff_for(xp)[...] += do.sum(axis=0)
        dh_out = (do @ W_ho).reshape(T, N, H)
        (dhT,) = self._state_top_diffs(xp, top)
        dz = xp.empty((T, N, H), dtype=hs.dtype)
        dh_next = xp.zeros((N, H), dtype=hs.dtype) if dhT is None else dhT.copy()
        for t in range(T - 1, -1, -1):
            dh = dh_out[t] + dh_next
            xp.multiply(dh, 1 - hs[t] * hs[t], out=dz[t])
            dh_next = (dz[t] @ W_hh) * cont[t][:, None]
        if self.get_param_propagate_down(i_hh):
            self.blobs[i_hh].mutable_diff_for(xp)[...] += \
                dz.reshape(T * N, H).T @ hc.reshape(T * N, H)
        self._input_grads(xp, bottom, propagate_down, dz, W_xh, 0, 1, W_s, 2)
        self._state_bottom_diffs(xp, bottom, propagate_down, [dh_next])
        self._debug("Backward", "diff", [(f"h_neuron_{t + 1}", f"h_neuron_input_{t + 1}", dz[t])
                                         for t in range(T)])
