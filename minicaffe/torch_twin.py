"""A PyTorch twin of a minicaffe Net: the same layers, weights and training step in
PyTorch, for ``minicaffe bench --compare torch`` and as a PyTorch reference for Caffe's
semantics (convolution, pooling, LRN, BatchNorm...) in tests.

``TorchTwin(net, device)`` translates the Net's layers, after Caffe's filtering and
Split insertion, one by one into ``torch.nn.functional`` calls on a dict of tensors keyed
by blob name.  An in-place layer rebinds the name, so every later consumer sees what
Caffe's blob holds.  The parameters are copies of the Net's blobs: one torch Parameter
per learnable blob (blobs shared by ParamSpec name are one Parameter); blobs Caffe does
not back-propagate into (``lr_mult: 0``) do not require grad.  The loss is Caffe's: the
sum over tops with a loss weight of ``weight * sum(top)``, taken when the top is
produced.

What PyTorch users write, where it is the same computation:

- ``ReLU`` in place (Caffe's in-place ReLU) when the tensor comes from a layer whose
  backward does not need its output (convolution, inner product, BatchNorm, Scale,
  Eltwise SUM, pooling, LRN, Concat); out of place otherwise.
- ``BatchNorm`` followed by a ``Scale`` (with its bias) on the BatchNorm's top: one
  affine ``F.batch_norm`` (``nn.BatchNorm2d``), noted in ``twin.notes``.  The running
  statistics follow PyTorch's exponential average (momentum = 1 -
  moving_average_fraction), not Caffe's normalised sums: the training step's outputs and
  gradients do not depend on them; with ``use_global_stats`` the twin starts from
  Caffe's mean_sum / s and var_sum / s.
- ``Accuracy`` is skipped (it is no part of the step).

A layer or setting the twin cannot express raises :class:`UntranslatableError`, one line
naming the layer and its type.  The twin always runs at the shapes the Net was built
with.  :func:`make_optimizer` maps the SolverParameter onto ``torch.optim`` (SGD with
momentum and weight decay, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam; lr_mult and
decay_mult as parameter groups; the learning rate of iteration 0, held fixed).
"""
import functools
import inspect

import numpy as np
import torch
import torch.nn.functional as F

from .core.errors import MinicaffeError
from .proto import caffe_pb2

TRAIN = caffe_pb2.TRAIN
_Pool = caffe_pb2.PoolingParameter
_LRN = caffe_pb2.LRNParameter
_Elt = caffe_pb2.EltwiseParameter
_Norm = caffe_pb2.LossParameter

# layers whose backward does not read their output: an in-place ReLU after them is safe
_INPLACE_SAFE_PRODUCERS = {"Convolution", "InnerProduct", "BatchNorm", "Scale", "Eltwise SUM",
                           "Pooling", "LRN", "Concat"}
# consumers that read a bottom as class indices
_CLASS_LABEL_CONSUMERS = {"SoftmaxWithLoss", "Accuracy"}


class UntranslatableError(MinicaffeError):
    """A layer (or solver setting) the PyTorch twin cannot express."""


class _Op:
    """One translated layer: ``fn(*bottoms)`` gives its tops (a tensor or a tuple)."""

    def __init__(self, name, type_, fn, bottoms, tops, loss_terms=()):
        self.name, self.type, self.fn = name, type_, fn
        self.bottoms, self.tops = list(bottoms), list(tops)
        self.loss_terms = list(loss_terms)  # (top index, loss weight)


class TorchTwin(torch.nn.Module):
    """The Net ``net`` as a PyTorch module on ``device``.  ``blobs`` (optional) gives the
    initial value of every layer's blobs (a list per layer of arrays, e.g. taken right
    after the Net was built); by default the Net's current blobs are copied.
    ``twin.loss(inputs)`` is the Caffe loss of one forward, ``twin(inputs)`` the dict of
    all tops, ``twin.notes`` what was mapped onto a PyTorch idiom."""

    def __init__(self, net, device="cpu", blobs=None):
        super().__init__()
        self.device = torch.device(device)
        self.name = net.name
        self.notes = []
        self.weights = torch.nn.ParameterList()
        self.blob_params = {}  # (layer name, blob index) -> its Parameter
        self.lr_mults, self.decay_mults = [], []
        self._by_learnable_id = {}
        self._net, self._blobs = net, blobs
        self.input_names = list(net.inputs)
        self._producer = {name: "Input" for name in self.input_names}
        self.ops = []
        fused = set()
        for i, layer in enumerate(net.layers):
            if i in fused or layer.type == "Input":
                continue
            translate = _TRANSLATORS.get(layer.type)
            if translate is None:
                raise UntranslatableError(f"layer '{layer.name}' of type {layer.type}: no "
                                          "PyTorch translation")
            out = translate(self, i)
            if out is None:  # skipped (Accuracy)
                continue
            fn, last = out if isinstance(out, tuple) else (out, i)
            fused.update(range(i + 1, last + 1))
            bottoms = [net.blob_names[b] for b in net.bottom_id_vecs[i]]
            tops = [net.blob_names[t] for t in net.top_id_vecs[last]]
            weights = net._blob_loss_weights
            terms = [(k, weights[t]) for k, t in enumerate(net.top_id_vecs[last]) if weights[t]]
            self.ops.append(_Op(layer.name, layer.type, fn, bottoms, tops, terms))
            kind = layer.type
            if kind == "Eltwise":
                kind += " " + _Elt.EltwiseOp.Name(layer.layer_param.eltwise_param.operation)
            for t in tops:
                self._producer[t] = kind
        del self._net, self._blobs

    # -- parameters ----------------------------------------------------------------------
    def _initial(self, i, j):
        if self._blobs is not None:
            return np.asarray(self._blobs[i][j])
        return np.asarray(self._net.layers[i].blobs[j].cpu_data())

    def _tensor(self, a):
        return torch.from_numpy(np.array(a, copy=True)).to(self.device)

    def param(self, i, j):
        """The torch Parameter of blob j of layer i (shared blobs give one Parameter)."""
        net = self._net
        pid = net.param_id_vecs[i][j]
        lid = net.learnable_param_ids[pid]
        p = self._by_learnable_id.get(lid)
        if p is None:
            owner = net.param_owners[pid]
            oi, oj = net.param_layer_indices[owner] if owner >= 0 else (i, j)
            p = torch.nn.Parameter(self._tensor(self._initial(oi, oj)),
                                   requires_grad=bool(net.layers[i].get_param_propagate_down(j)))
            self._by_learnable_id[lid] = p
            self.weights.append(p)
            self.lr_mults.append(float(net.params_lr[lid]))
            self.decay_mults.append(float(net.params_weight_decay[lid]))
        self.blob_params[(net.layer_names[i], j)] = p
        return p

    # -- running -------------------------------------------------------------------------
    def forward(self, inputs):
        """All tops of one forward pass, by blob name (the inputs included)."""
        return self._run(inputs)[0]

    def loss(self, inputs):
        """Caffe's loss of one forward pass: sum of weight * sum(top) over loss tops."""
        return self._run(inputs)[1]

    # PyTorch's mixed precision, as its users train today (minicaffe bench --precision
    # bf16/fp16 --compare torch): the ops under torch.autocast in this dtype (None: off)
    autocast = None

    def to_channels_last(self):
        """Convolution weights in channels_last memory (with ``autocast``: PyTorch's
        recipe for tensor cores)."""
        for p in self.weights:
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)

    def _run(self, inputs):
        if self.autocast is not None:
            with torch.autocast(device_type=self.device.type, dtype=self.autocast):
                return self._run_ops(inputs)
        return self._run_ops(inputs)

    def _run_ops(self, inputs):
        env = dict(inputs)
        total = None
        for op in self.ops:
            out = op.fn(*[env[b] for b in op.bottoms])
            if isinstance(out, torch.Tensor):
                out = (out,)
            for name, t in zip(op.tops, out):
                env[name] = t
            for k, w in op.loss_terms:
                t = out[k] if out[k].dim() == 0 else out[k].sum()
                term = t if w == 1 else t * w
                total = term if total is None else total + term
        return env, total

    def inputs_from(self, net):
        """The Net's input blobs as tensors on this device: class labels (blobs read only
        by SoftmaxWithLoss/Accuracy as their second bottom) as int64, as PyTorch wants."""
        out = {}
        for name in self.input_names:
            a = np.asarray(net.blob_by_name(name).cpu_data())
            t = self._tensor(a)
            if _is_class_label(net, name):
                t = t.long()
            out[name] = t
        return out

    def train_step(self, inputs, optimizer, iter_size=1, clip_gradients=-1.0):
        """One training iteration as PyTorch users write it: zero_grad(set_to_none),
        forward and loss, backward (``iter_size`` times, Caffe's gradient accumulation),
        optional gradient clipping, optimizer step.  Returns the loss tensor."""
        optimizer.zero_grad(set_to_none=True)
        for _ in range(iter_size):
            loss = self.loss(inputs)
            (loss if iter_size == 1 else loss / iter_size).backward()
        if clip_gradients >= 0:
            torch.nn.utils.clip_grad_norm_([p for p in self.weights if p.requires_grad],
                                           clip_gradients)
        optimizer.step()
        return loss


def _is_class_label(net, name):
    used = False
    for i, layer in enumerate(net.layers):
        names = [net.blob_names[b] for b in net.bottom_id_vecs[i]]
        for k, b in enumerate(names):
            if b != name:
                continue
            if layer.type == "Split":
                for t in net.top_id_vecs[i]:
                    if not _is_class_label(net, net.blob_names[t]):
                        return False
                used = True
            elif layer.type in _CLASS_LABEL_CONSUMERS and k == 1:
                used = True
            else:
                return False
    return used


# -- translations: one function per Caffe layer type ------------------------------------
# Each takes the twin and the layer index and returns fn(*bottoms) -> top(s), or
# (fn, last layer index) when it absorbs the layers after it, or None to skip.
def _layer(tw, i):
    return tw._net.layers[i]


def _bottom_shape(tw, i, k=0):
    return tw._net.bottom_vecs[i][k].shape


def _top_shape(tw, i, k=0):
    return tw._net.top_vecs[i][k].shape


def _untranslatable(layer, why):
    return UntranslatableError(f"layer '{layer.name}' of type {layer.type}: {why}")


def _hw(values, h, w, has_h, default):
    """(h, w) from a repeated field (0, 1 or 2 values) or its _h/_w pair."""
    if has_h:
        return (h, w)
    if len(values) == 0:
        return (default, default)
    if len(values) == 1:
        return (values[0], values[0])
    return tuple(values)


def _convolution(tw, i):
    layer = _layer(tw, i)
    p = layer.layer_param.convolution_param
    shape = _bottom_shape(tw, i)
    if len(shape) != 4 or p.axis not in (1, -3):
        raise _untranslatable(layer, f"only 2-D convolution over (N, C, H, W) is translated "
                                     f"(bottom shape {shape})")
    pad = _hw(p.pad, p.pad_h, p.pad_w, p.HasField("pad_h"), 0)
    stride = _hw(p.stride, p.stride_h, p.stride_w, p.HasField("stride_h"), 1)
    dilation = _hw(p.dilation, 0, 0, False, 1)
    groups = p.group
    w = tw.param(i, 0)
    b = tw.param(i, 1) if p.bias_term else None
    return lambda x: F.conv2d(x, w, b, stride, pad, dilation, groups)


def _torch_pooled(size, k, s, pad, ceil):
    """PyTorch's pooled size (aten's pooling_output_shape, dilation 1)."""
    out = (size + 2 * pad - k + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + pad:
        out -= 1
    return out


def _pooling(tw, i):
    layer = _layer(tw, i)
    p = layer.layer_param.pooling_param
    shape = _bottom_shape(tw, i)
    if len(layer.layer_param.top) > 1:
        raise _untranslatable(layer, "the argmax (mask) top is not translated")
    if p.global_pooling:
        kernel, stride, pad = tuple(shape[2:]), (1, 1), (0, 0)
    else:
        kernel = (p.kernel_h, p.kernel_w) if p.HasField("kernel_h") else (p.kernel_size,) * 2
        stride = (p.stride_h, p.stride_w) if p.HasField("stride_h") else (p.stride,) * 2
        pad = (p.pad_h, p.pad_w) if p.HasField("pad_h") else (p.pad,) * 2
    ceil = p.round_mode == _Pool.CEIL
    if any(2 * q > k for q, k in zip(pad, kernel)):
        raise _untranslatable(layer, f"pad {pad} is more than half the kernel {kernel} "
                                     "(PyTorch refuses it)")
    theirs = tuple(_torch_pooled(n, k, s, q, ceil) for n, k, s, q in
                   zip(shape[2:], kernel, stride, pad))
    if theirs != tuple(_top_shape(tw, i)[2:]):
        raise _untranslatable(layer, f"PyTorch pools to {theirs}, Caffe to "
                                     f"{_top_shape(tw, i)[2:]}")
    if p.pool == _Pool.MAX:
        return lambda x: F.max_pool2d(x, kernel, stride, pad, ceil_mode=ceil)
    if p.pool == _Pool.AVE:
        # Caffe divides by the window clipped to the padded input: count_include_pad
        return lambda x: F.avg_pool2d(x, kernel, stride, pad, ceil_mode=ceil,
                                      count_include_pad=True)
    raise _untranslatable(layer, "STOCHASTIC pooling is not translated")


def _lrn(tw, i):
    layer = _layer(tw, i)
    p = layer.layer_param.lrn_param
    if len(_bottom_shape(tw, i)) != 4:
        raise _untranslatable(layer, "LRN needs a (N, C, H, W) bottom")
    n, alpha, beta, k = p.local_size, p.alpha, p.beta, p.k
    if p.norm_region == _LRN.ACROSS_CHANNELS:
        # x / (k + alpha/n sum_window x^2)^beta
        return lambda x: F.local_response_norm(x, n, alpha, beta, k)
    pad = (n - 1) // 2

    def within_channel(x):  # x (1 + alpha * mean_{n x n window} x^2)^-beta
        return x * (1 + alpha * F.avg_pool2d(x * x, n, 1, pad, ceil_mode=True,
                                             count_include_pad=True)).pow(-beta)
    return within_channel


def _relu(tw, i):
    layer = _layer(tw, i)
    slope = layer.layer_param.relu_param.negative_slope
    net = tw._net
    in_place = net.top_id_vecs[i][0] == net.bottom_id_vecs[i][0] and \
        tw._producer.get(net.blob_names[net.bottom_id_vecs[i][0]]) in _INPLACE_SAFE_PRODUCERS
    if slope:
        return lambda x: F.leaky_relu(x, slope, inplace=in_place)
    return lambda x: F.relu(x, inplace=in_place)


def _sigmoid(tw, i):
    return torch.sigmoid


def _tanh(tw, i):
    return torch.tanh


def _inner_product(tw, i):
    layer = _layer(tw, i)
    p = layer.layer_param.inner_product_param
    axis = p.axis % len(_bottom_shape(tw, i))
    w = tw.param(i, 0)
    b = tw.param(i, 1) if p.bias_term else None
    if p.transpose:  # W stored (K, N)
        return lambda x: F.linear(x.flatten(axis), w.t(), b)
    return lambda x: F.linear(x.flatten(axis), w, b)


def _in_train(layer):
    """The layer's own phase (Caffe's: the Net sets it unless the layer names one)."""
    return layer.layer_param.phase == TRAIN


def _dropout(tw, i):
    p = _layer(tw, i).layer_param.dropout_param
    ratio = float(p.dropout_ratio)
    if ratio == 0:
        return lambda x: x
    if not _in_train(_layer(tw, i)):
        return (lambda x: x) if p.scale_train else (lambda x: x * (1 - ratio))
    if p.scale_train:
        return lambda x: F.dropout(x, ratio, training=True)
    return lambda x: F.dropout(x, ratio, training=True) * (1 - ratio)


def _batch_norm(tw, i):
    layer = _layer(tw, i)
    net = tw._net
    p = layer.layer_param.batch_norm_param
    global_stats = p.use_global_stats if p.HasField("use_global_stats") else \
        not _in_train(layer)
    mean_sum, var_sum, s = (tw._initial(i, j) for j in range(3))
    factor = 0.0 if float(s[0]) == 0 else 1.0 / float(s[0])
    if factor or global_stats:
        mean, var = mean_sum * factor, var_sum * factor
    else:  # no statistics yet: PyTorch's initial running values
        mean, var = np.zeros_like(mean_sum), np.ones_like(var_sum)
    rm, rv = tw._tensor(mean), tw._tensor(var)
    tw.register_buffer(f"bn{i}_running_mean", rm)
    tw.register_buffer(f"bn{i}_running_var", rv)
    momentum = 1.0 - p.moving_average_fraction
    eps = p.eps
    weight = bias = None
    last = i
    nxt = net.layers[i + 1] if i + 1 < len(net.layers) else None
    if nxt is not None and nxt.type == "Scale" and len(net.bottom_id_vecs[i + 1]) == 1 and \
            net.bottom_id_vecs[i + 1][0] == net.top_id_vecs[i][0] and \
            _scale_is_per_channel(nxt, _bottom_shape(tw, i)):
        weight = tw.param(i + 1, 0)
        bias = tw.param(i + 1, 1) if nxt.layer_param.scale_param.bias_term else None
        last = i + 1
        tw.notes.append(f"BatchNorm '{layer.name}' + Scale '{nxt.name}' -> one affine "
                        "F.batch_norm (nn.BatchNorm2d)")

    def batch_norm(x):
        return F.batch_norm(x, rm, rv, weight, bias, training=not global_stats,
                            momentum=momentum, eps=eps)
    return batch_norm, last


def _scale_is_per_channel(layer, shape):
    p = layer.layer_param.scale_param
    return len(shape) >= 2 and p.axis % len(shape) == 1 and p.num_axes == 1


def _broadcast(s, x_ndim, axis):
    axis = 0 if s.dim() == 0 else axis % x_ndim
    return s.reshape((1,) * axis + tuple(s.shape) + (1,) * (x_ndim - axis - s.dim()))


def _scale(tw, i):
    layer = _layer(tw, i)
    p = layer.layer_param.scale_param
    ndim = len(_bottom_shape(tw, i))
    two = len(layer.layer_param.bottom) == 2
    s = None if two else tw.param(i, 0)
    b = tw.param(i, len(layer.blobs) - 1) if p.bias_term else None
    axis = p.axis

    def scale(x, *scale_bottom):
        sc = scale_bottom[0] if two else s
        y = x * _broadcast(sc, ndim, axis)
        return y + _broadcast(b, ndim, axis) if b is not None else y
    return scale


def _eltwise(tw, i):
    layer = _layer(tw, i)
    p = layer.layer_param.eltwise_param
    coeffs = list(p.coeff)
    if p.operation == _Elt.SUM:
        if not coeffs or all(c == 1 for c in coeffs):
            return lambda *xs: functools.reduce(torch.add, xs)
        return lambda *xs: functools.reduce(torch.add, [c * x for c, x in zip(coeffs, xs)])
    if p.operation == _Elt.PROD:
        return lambda *xs: functools.reduce(torch.mul, xs)

    def eltwise_max(*xs):  # Caffe routes the gradient to the first maximum
        m = xs[0]
        for x in xs[1:]:
            m = torch.where(x > m, x, m)
        return m
    return eltwise_max


def _concat(tw, i):
    p = _layer(tw, i).layer_param.concat_param
    axis = p.concat_dim if p.HasField("concat_dim") else p.axis
    return lambda *xs: torch.cat(xs, axis)


def _split(tw, i):
    n = len(tw._net.top_id_vecs[i])
    return lambda x: (x,) * n


def _reshape(tw, i):  # Reshape and Flatten: the top shape the Net worked out
    shape = tuple(_top_shape(tw, i))
    return lambda x: x.reshape(shape)


def _softmax(tw, i):
    axis = _layer(tw, i).layer_param.softmax_param.axis
    return lambda x: F.softmax(x, axis)


def _softmax_with_loss(tw, i):
    layer = _layer(tw, i)
    lp = layer.layer_param
    axis = lp.softmax_param.axis % len(_bottom_shape(tw, i))
    ignore = lp.loss_param.ignore_label if lp.loss_param.HasField("ignore_label") else None
    if lp.loss_param.HasField("normalization"):
        mode = lp.loss_param.normalization
    elif lp.loss_param.HasField("normalize"):
        mode = _Norm.VALID if lp.loss_param.normalize else _Norm.BATCH_SIZE
    else:
        mode = _Norm.VALID
    shape = _bottom_shape(tw, i)
    outer = int(np.prod(shape[:axis]))
    count = outer * int(np.prod(shape[axis + 1:]))
    want_prob = len(lp.top) > 1
    reduction = "mean" if mode == _Norm.VALID else "sum"
    divide = {_Norm.FULL: count, _Norm.BATCH_SIZE: outer}.get(mode, 1)

    def softmax_loss(x, label):
        z = x if axis == 1 else x.movedim(axis, 1)
        lab = label.reshape(z.shape[:1] + z.shape[2:])
        if lab.dtype != torch.long:
            lab = lab.long()
        loss = F.cross_entropy(z, lab, ignore_index=-100 if ignore is None else ignore,
                               reduction=reduction)
        if divide != 1:
            loss = loss / divide
        return (loss, F.softmax(x, axis)) if want_prob else loss
    return softmax_loss


def _euclidean_loss(tw, i):
    def euclidean(a, b):  # sum (a - b)^2 / 2N
        d = a - b
        return (d * d).sum() / (2 * a.shape[0])
    return euclidean


def _skip(tw, i):
    return None


def _silence(tw, i):
    return lambda *xs: ()


_TRANSLATORS = {
    "Convolution": _convolution, "Pooling": _pooling, "LRN": _lrn, "ReLU": _relu,
    "Sigmoid": _sigmoid, "TanH": _tanh, "InnerProduct": _inner_product,
    "Dropout": _dropout, "BatchNorm": _batch_norm, "Scale": _scale, "Eltwise": _eltwise,
    "Concat": _concat, "Split": _split, "Flatten": _reshape, "Reshape": _reshape,
    "Softmax": _softmax, "SoftmaxWithLoss": _softmax_with_loss,
    "EuclideanLoss": _euclidean_loss, "Accuracy": _skip, "Silence": _silence,
}


def translatable_types():
    """The Caffe layer types the twin translates (Input included)."""
    return sorted(set(_TRANSLATORS) | {"Input"})


# -- the solver --------------------------------------------------------------------------
def make_optimizer(twin, solver_param, capturable=False):
    """A torch.optim optimizer doing the SolverParameter's update with the learning rate
    of iteration 0: one parameter group per (lr_mult, decay_mult).  ``capturable`` asks
    for an optimizer that can be captured in a CUDA graph (where the type has the
    switch; SGD needs none)."""
    from .solvers.lr_policy import learning_rate
    p = solver_param
    if p.regularization_type != "L2":
        raise UntranslatableError(f"solver: regularization_type {p.regularization_type}: "
                                  "torch.optim has only L2 weight decay")
    base_lr = float(learning_rate(p, 0, 0, log_steps=False)[0])
    groups = {}
    for w, lr_mult, decay_mult in zip(twin.weights, twin.lr_mults, twin.decay_mults):
        if w.requires_grad:
            groups.setdefault((lr_mult, decay_mult), []).append(w)
    param_groups = [{"params": ws, "lr": base_lr * lr_mult,
                     "weight_decay": float(p.weight_decay) * decay_mult}
                    for (lr_mult, decay_mult), ws in groups.items()]
    kind = p.type or "SGD"
    if kind == "SGD":
        cls, kw = torch.optim.SGD, dict(momentum=p.momentum)
    elif kind == "Nesterov":
        cls, kw = torch.optim.SGD, dict(momentum=p.momentum, nesterov=True)
    elif kind == "AdaGrad":
        cls, kw = torch.optim.Adagrad, dict(eps=p.delta)
    elif kind == "RMSProp":
        cls, kw = torch.optim.RMSprop, dict(alpha=p.rms_decay, eps=p.delta)
    elif kind == "AdaDelta":
        cls, kw = torch.optim.Adadelta, dict(rho=p.momentum, eps=p.delta)
    elif kind == "Adam":
        cls, kw = torch.optim.Adam, dict(betas=(p.momentum, p.momentum2), eps=p.delta)
    else:
        raise UntranslatableError(f"solver: type {kind} has no torch.optim counterpart")
    if capturable and "capturable" in inspect.signature(cls).parameters:
        kw["capturable"] = True
    return cls(param_groups, lr=base_lr, **kw)
