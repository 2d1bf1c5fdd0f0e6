"""Loss layers and Accuracy (Caffe's ``*_loss_layer.cpp`` and ``accuracy_layer.cpp``).

Every loss layer writes a scalar top (shape ``()``); its loss weight lives in the
top's diff (see :class:`minicaffe.layers.layer.LossLayer`), so each backward scales its
gradient by ``top[0].diff`` and the normalizer.  One body serves numpy and cupy.

Normalization (``loss_param.normalization``) follows Caffe's ``get_normalizer``:
FULL = outer*inner, VALID = the number of non-ignored labels, BATCH_SIZE = outer,
NONE = 1, never below 1.  The legacy ``normalize`` flag (when ``normalization`` is
unset) means VALID if true, BATCH_SIZE if false.
"""
import numpy as np

from ..core import backend
from ..core.blob import Blob
from ..core.errors import MinicaffeError
from .layer import Layer, LossLayer
from ..proto import caffe_pb2
from ..core.protoio import read_binary
from .registry import register_layer
from .common import softmax

FLT_MIN = np.float32(np.finfo(np.float32).tiny)
LOG_THRESHOLD = 1e-20  # Caffe's kLOG_THRESHOLD
_Norm = caffe_pb2.LossParameter


def normalization_mode(layer_param, default=None):
    """The LossParameter normalization, honouring the legacy ``normalize`` flag.
    ``default`` replaces the proto default (VALID) when neither field is set
    (SigmoidCrossEntropyLoss uses BATCH_SIZE)."""
    lp = layer_param.loss_param
    if lp.HasField("normalization"):
        return lp.normalization
    if lp.HasField("normalize"):
        return _Norm.VALID if lp.normalize else _Norm.BATCH_SIZE
    return lp.normalization if default is None else default


def normalizer(mode, outer_num, inner_num, valid_count):
    if mode == _Norm.FULL:
        n = outer_num * inner_num
    elif mode == _Norm.VALID:
        n = outer_num * inner_num if valid_count == -1 else valid_count
    elif mode == _Norm.BATCH_SIZE:
        n = outer_num
    else:  # NONE
        n = 1
    return max(1.0, float(n))


def _loss_weight(xp, top):
    """The loss weight Caffe keeps in the scalar top's diff."""
    return top[0].diff_for(xp).reshape(-1)[0]


def _checked_labels(layer, xp, raw, num_classes, has_ignore=False, ignore_label=0):
    """Integer labels (Caffe's static_cast<int>), the mask of counted labels, and the
    labels with ignored entries replaced by 0 (safe to index with).  A label outside
    [0, num_classes) that is not the ignore_label raises a one-line LayerError."""
    with np.errstate(invalid="ignore"):  # a NaN label is reported below, as "nan"
        lab = raw.astype(np.int64)
    valid = (lab != ignore_label) if has_ignore else xp.ones(lab.shape, dtype=bool)
    bad = valid & ((lab < 0) | (lab >= num_classes))
    if bool(bad.any()):
        value = "%g" % float(raw[bad].ravel()[0])
        extra = f" and is not the ignore_label ({ignore_label})" if has_ignore else ""
        raise layer.error(f"label {value} is out of range [0, {num_classes}){extra}")
    return xp.where(valid, lab, 0), valid


def _onehot(xp, safe, num_classes, dtype):
    """(outer, C, inner) one-hot of labels (outer, inner)."""
    return (xp.arange(num_classes)[None, :, None] == safe[:, None, :]).astype(dtype)


def _no_label_backprop(layer, propagate_down, indices=(1,), what="label"):
    for i in indices:
        if i < len(propagate_down) and propagate_down[i]:
            raise layer.error(f"cannot backpropagate to {what} inputs (bottom {i})")


_SOFTMAX_LOSS_SRC = r"""
// the loss of one label ``raw`` given its row's probabilities (pr, the classes ``stride``
// apart) into loss and valid; a label out of [0, C) that is not the ignore_label flags
// ``bad`` (the first bad label seen, kept; flag 2: NaN) and counts as ignored
__device__ __forceinline__ void mc_label_loss(const T raw, const T* pr, long long stride,
    int C, int has_ignore, int ignore_label, int* bad, T* loss, T* valid) {
  int lab = (int)raw;          // (int)NaN is 0 on the device: NaN is flagged on its own
  bool ok = !(has_ignore && lab == ignore_label) || raw != raw;
  if (ok && (raw != raw || lab < 0 || lab >= C)) {
    if (atomicCAS(bad, 0, raw != raw ? 2 : 1) == 0) bad[1] = lab;
    ok = false;
  }
  T p = ok ? pr[(long long)lab * stride] : (T)1;
  *loss = ok ? -log(p > (T)MC_FLT_MIN ? p : (T)MC_FLT_MIN) : (T)0;
  *valid = ok ? (T)1 : (T)0;
}

extern "C" __global__ void softmax_loss_fwd(const T* x, const T* label, T* prob, T* loss,
    T* valid, int* bad, long long n, int C, int inner, int has_ignore, int ignore_label) {
  CUDA_KERNEL_LOOP(idx, n) {
    long long o = idx / inner, i = idx % inner;
    const T* xr = x + o * C * inner + i;
    T* pr = prob + o * C * inner + i;
    T m = xr[0];
    for (int c = 1; c < C; ++c) { T v = xr[(long long)c * inner]; m = v > m ? v : m; }
    T s = 0;
    for (int c = 0; c < C; ++c) {
      T e = exp(xr[(long long)c * inner] - m);
      pr[(long long)c * inner] = e;
      s += e;
    }
    for (int c = 0; c < C; ++c) pr[(long long)c * inner] /= s;
    mc_label_loss(label[idx], pr, inner, C, has_ignore, ignore_label, bad, loss + idx,
                  valid + idx);
  }
}

// inner == 1 and a wide row (ImageNet's 1000 classes): one block of ROW_THREADS per row,
// its max and sum reduced in a fixed order (the one-thread-per-row kernel above ran the
// 1000 classes three times in series on 64 threads: 235 us of a ResNet-50 step on an H100)
extern "C" __global__ void softmax_loss_fwd_rows(const T* x, const T* label, T* prob, T* loss,
    T* valid, int* bad, long long n, int C, int has_ignore, int ignore_label) {
  __shared__ T red[256];
  const int t = threadIdx.x;
  for (long long o = blockIdx.x; o < n; o += gridDim.x) {
    const T* xr = x + o * C;
    T* pr = prob + o * C;
    T m = xr[0];                 // a NaN anywhere makes the row NaN, as in the kernel above
    for (int c = t; c < C; c += blockDim.x) { T v = xr[c]; m = (v > m || v != v) ? v : m; }
    red[t] = m;
    __syncthreads();
    for (int w = blockDim.x >> 1; w > 0; w >>= 1) {
      if (t < w) { T a = red[t], b = red[t + w]; red[t] = (b > a || b != b) ? b : a; }
      __syncthreads();
    }
    m = red[0];
    __syncthreads();
    T s = 0;
    for (int c = t; c < C; c += blockDim.x) { T e = exp(xr[c] - m); pr[c] = e; s += e; }
    red[t] = s;
    __syncthreads();
    for (int w = blockDim.x >> 1; w > 0; w >>= 1) {
      if (t < w) red[t] += red[t + w];
      __syncthreads();
    }
    s = red[0];
    for (int c = t; c < C; c += blockDim.x) pr[c] /= s;
    __syncthreads();
    if (t == 0)
      mc_label_loss(label[o], pr, 1, C, has_ignore, ignore_label, bad, loss + o, valid + o);
    __syncthreads();
  }
}

// one block: total loss and valid count in a fixed order; top = total / normaliser,
// inv_norm = 1 / normaliser (VALID: max(1, count); the other modes pass theirs)
extern "C" __global__ void softmax_loss_finish(const T* loss, const T* valid, long long n,
    int valid_mode, double fixed_norm, T* top, double* inv_norm) {
  __shared__ double sl[256], sv[256];
  double a = 0, b = 0;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) { a += (double)loss[i]; b += (double)valid[i]; }
  sl[threadIdx.x] = a; sv[threadIdx.x] = b;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (threadIdx.x < w) { sl[threadIdx.x] += sl[threadIdx.x + w]; sv[threadIdx.x] += sv[threadIdx.x + w]; }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double norm = valid_mode ? (sv[0] > 1.0 ? sv[0] : 1.0) : fixed_norm;
    inv_norm[0] = 1.0 / norm;
    top[0] = (T)(sl[0] * (1.0 / norm));
  }
}

extern "C" __global__ void softmax_loss_bwd(const T* prob, const T* label, const T* valid,
    const T* loss_weight, const double* inv_norm, T* dx, long long n, int C, int inner) {
  CUDA_KERNEL_LOOP(j, n) {
    long long i = j % inner, oc = j / inner, c = oc % C, o = oc / C;
    long long idx = o * inner + i;
    T d = prob[j] - ((int)label[idx] == c ? (T)1 : (T)0);
    dx[j] = d * valid[idx] * (loss_weight[0] * (T)inv_norm[0]);
  }
}
"""


# rows of at least ROW_CLASSES classes (inner 1) take one block of ROW_THREADS threads each
ROW_CLASSES, ROW_THREADS = 128, 256


def _softmax_loss_kernel(name, dtype):
    from ..kernels._backend import cuda_type, raw_kernel
    return raw_kernel(_SOFTMAX_LOSS_SRC, name, cuda_type(dtype))


@register_layer("SoftmaxWithLoss")
class SoftmaxWithLossLayer(LossLayer):
    """Multinomial logistic loss of the softmax of bottom[0] over ``softmax_param.axis``.

    bottom[0]: predictions (outer, C, inner...); bottom[1]: integer labels, outer*inner
    of them; top[0]: the loss; optional top[1]: the softmax probabilities.
    loss = -sum_valid log(max(p[label], FLT_MIN)) / normalizer
    dx   = (p - onehot(label)) * valid * loss_weight / normalizer."""
    min_top_blobs = 1
    max_top_blobs = 2
    exact_num_top_blobs = -1

    def layer_setup(self, bottom, top):
        lp = self.layer_param.loss_param
        self.has_ignore = lp.HasField("ignore_label")
        self.ignore_label = lp.ignore_label
        self.norm = normalization_mode(self.layer_param)
        self.prob = Blob(dtype=bottom[0].dtype)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.axis = bottom[0].canonical_axis_index(self.layer_param.softmax_param.axis)
        self.outer = bottom[0].count(0, self.axis)
        self.inner = bottom[0].count(self.axis + 1)
        if self.outer * self.inner != bottom[1].count():
            raise self.error(f"number of labels must match number of predictions; e.g., if "
                             f"softmax axis == 1 and prediction shape is (N, C, H, W), label count "
                             f"(number of labels) must be N*H*W, with integer values in "
                             f"{{0, 1, ..., C-1}} (predictions {bottom[0].shape}, labels {bottom[1].shape})")
        self.prob.reshape(bottom[0].shape)
        if len(top) >= 2:
            top[1].reshape(bottom[0].shape)

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        C = x.shape[self.axis]
        p = self.prob.mutable_data_for(xp)
        p[...] = softmax(xp, x, self.axis)
        p3 = p.reshape(self.outer, C, self.inner)
        raw = bottom[1].data_for(xp).reshape(self.outer, self.inner)
        safe, valid = _checked_labels(self, xp, raw, C, self.has_ignore, self.ignore_label)
        picked = xp.take_along_axis(p3, safe[:, None, :], axis=1)[:, 0, :]
        losses = -xp.log(xp.maximum(picked, FLT_MIN)) * valid
        self._safe, self._valid = safe, valid
        self._count = int(valid.sum())
        top[0].mutable_data_for(xp)[...] = losses.sum() / normalizer(
            self.norm, self.outer, self.inner, self._count)
        if len(top) == 2:
            top[1].mutable_data_for(xp)[...] = p

    def backward_xp(self, xp, top, propagate_down, bottom):
        _no_label_backprop(self, propagate_down)
        if not propagate_down[0]:
            return
        p = self.prob.data_for(xp)
        C = p.shape[self.axis]
        d3 = bottom[0].mutable_diff_for(xp).reshape(self.outer, C, self.inner)
        d3[...] = p.reshape(self.outer, C, self.inner) - _onehot(xp, self._safe, C, p.dtype)
        d3 *= self._valid[:, None, :]
        d3 *= _loss_weight(xp, top) / normalizer(self.norm, self.outer, self.inner, self._count)

    # GPU: the same math in two fused kernels and a few reductions, all on the device (no
    # read back, so the step can be captured in a CUDA graph).  A label out of range sets
    # a device flag with the first bad value; check_deferred raises it once the host has
    # waited for the work (at once in Layer.forward, at the next log point in a GPU step).
    capturable = True

    def forward_gpu(self, bottom, top):
        from ..kernels._backend import launch
        cp = backend.gpu_module()
        x = bottom[0].gpu_data()
        C = x.shape[self.axis]
        n = self.outer * self.inner
        label = bottom[1].gpu_data()
        p = self.prob.mutable_gpu_data()
        if getattr(self, "_bad", None) is None:
            self._bad = cp.zeros(2, dtype=np.int32)
        if getattr(self, "_loss_buf", None) is None or self._loss_buf.size != n or \
                self._loss_buf.dtype != x.dtype:
            self._loss_buf = cp.empty(n, dtype=x.dtype)
            self._valid = cp.empty(n, dtype=x.dtype)
        loss, valid = self._loss_buf, self._valid
        if self.inner == 1 and C >= ROW_CLASSES:
            _softmax_loss_kernel("softmax_loss_fwd_rows", x.dtype)(
                (min(n, 65535),), (ROW_THREADS,),
                (x, label, p, loss, valid, self._bad, np.int64(n), np.int32(C),
                 np.int32(self.has_ignore), np.int32(self.ignore_label)))
        else:
            launch(_softmax_loss_kernel("softmax_loss_fwd", x.dtype), n,
                   (x, label, p, loss, valid, self._bad, np.int64(n), np.int32(C),
                    np.int32(self.inner), np.int32(self.has_ignore),
                    np.int32(self.ignore_label)))
        if getattr(self, "_inv_norm", None) is None:
            self._inv_norm = cp.zeros((), np.float64)
        fixed = normalizer(self.norm, self.outer, self.inner, -1)
        _softmax_loss_kernel("softmax_loss_finish", x.dtype)(
            (1,), (256,), (loss, valid, np.int64(n), np.int32(self.norm == _Norm.VALID),
                           np.float64(fixed), top[0].mutable_gpu_data(), self._inv_norm))
        if len(top) == 2:
            top[1].mutable_gpu_data()[...] = p

    retain_inputs, retain_outputs = (1,), ()      # the labels; the probabilities are its own

    def state_bytes(self, bottom, top):
        return bottom[0].count() * bottom[0].dtype.itemsize + 2 * bottom[1].count() * 4

    def check_deferred(self):
        bad = getattr(self, "_bad", None)
        if bad is None:
            return
        flag, value = (int(v) for v in bad.get())
        if flag:
            bad.fill(0)
            extra = f" and is not the ignore_label ({self.ignore_label})" if self.has_ignore else ""
            value = "nan" if flag == 2 else value
            raise self.error(f"label {value} is out of range [0, "
                             f"{self.prob.shape[self.axis]}){extra}")

    def backward_gpu(self, top, propagate_down, bottom):
        from ..kernels._backend import launch
        _no_label_backprop(self, propagate_down)
        if not propagate_down[0]:
            return
        p = self.prob.gpu_data()
        C = p.shape[self.axis]
        launch(_softmax_loss_kernel("softmax_loss_bwd", p.dtype), p.size,
               (p, bottom[1].gpu_data(), self._valid, top[0].gpu_diff(), self._inv_norm,
                bottom[0].mutable_gpu_diff(), np.int64(p.size), np.int32(C), np.int32(self.inner)))


@register_layer("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLossLayer(LossLayer):
    """Cross-entropy of sigmoid(bottom[0]) against targets bottom[1] in [0, 1] (same count).

    loss = -sum_valid [x (t - [x >= 0]) - log(1 + exp(x - 2 x [x >= 0]))] / normalizer
    (Caffe's overflow-free form), dx = (sigmoid(x) - t) * valid * loss_weight / normalizer.
    Normalization defaults to BATCH_SIZE (outer = shape[0], inner = count(1)); a target
    equal to ``loss_param.ignore_label`` (after int conversion) is skipped."""

    def layer_setup(self, bottom, top):
        lp = self.layer_param.loss_param
        self.has_ignore = lp.HasField("ignore_label")
        self.ignore_label = lp.ignore_label
        self.norm = normalization_mode(self.layer_param, default=_Norm.BATCH_SIZE)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count() != bottom[1].count():
            raise self.error(f"inputs must have the same count (predictions {bottom[0].shape}, "
                             f"targets {bottom[1].shape})")
        self.outer = bottom[0].shape[0]
        self.inner = bottom[0].count(1)

    def _valid(self, xp, t):
        if self.has_ignore:
            return t.astype(np.int64) != self.ignore_label
        return None

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp).reshape(-1)
        t = bottom[1].data_for(xp).reshape(-1)
        pos = (x >= 0).astype(x.dtype)
        losses = -(x * (t - pos) - xp.log1p(xp.exp(x - 2 * x * pos)))
        valid = self._valid(xp, t)
        if valid is not None:
            losses = losses * valid
            count = int(valid.sum())
        else:
            count = x.size
        self._normalizer = normalizer(self.norm, self.outer, self.inner, count)
        top[0].mutable_data_for(xp)[...] = losses.sum() / self._normalizer

    def backward_xp(self, xp, top, propagate_down, bottom):
        _no_label_backprop(self, propagate_down)
        if not propagate_down[0]:
            return
        x = bottom[0].data_for(xp)
        t = bottom[1].data_for(xp).reshape(x.shape)
        dx = bottom[0].mutable_diff_for(xp)
        dx[...] = 0.5 * (1 + xp.tanh(0.5 * x)) - t   # sigmoid, without overflow
        valid = self._valid(xp, t)
        if valid is not None:
            dx *= valid
        dx *= _loss_weight(xp, top) / self._normalizer


@register_layer("EuclideanLoss")
class EuclideanLossLayer(LossLayer):
    """loss = sum (a - b)^2 / (2 N) over bottoms a, b of the same count(1) per item;
    da = (a - b) * loss_weight / N, db = -da.  Both bottoms may receive gradients."""
    capturable = True

    def layer_setup(self, bottom, top):
        self.diff = Blob(dtype=bottom[0].dtype)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count(1) != bottom[1].count(1):
            raise self.error(f"inputs must have the same dimension ({bottom[0].shape} vs "
                             f"{bottom[1].shape})")
        self.diff.reshape(bottom[0].shape)

    retain_inputs, retain_outputs = (), ()

    def state_bytes(self, bottom, top):
        return bottom[0].count() * bottom[0].dtype.itemsize

    def forward_xp(self, xp, bottom, top):
        d = self.diff.mutable_data_for(xp)
        d[...] = bottom[0].data_for(xp) - bottom[1].data_for(xp).reshape(d.shape)
        top[0].mutable_data_for(xp)[...] = (d * d).sum() / bottom[0].shape[0] / 2

    def backward_xp(self, xp, top, propagate_down, bottom):
        d = self.diff.data_for(xp)
        for i in (0, 1):
            if propagate_down[i]:
                alpha = (1 if i == 0 else -1) * _loss_weight(xp, top) / bottom[i].shape[0]
                bottom[i].mutable_diff_for(xp)[...] = (alpha * d).reshape(bottom[i].shape)

    def allow_force_backward(self, bottom_index):
        return True


class _OneLabelPerItemLoss(LossLayer):
    """Predictions (N, dim...) flattened to (N, dim) against one integer label per item."""

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.num = bottom[0].shape[0]
        self.dim = bottom[0].count() // max(self.num, 1)
        if bottom[1].count() != self.num:
            raise self.error(f"needs one label per item: {self.num} items, "
                             f"{bottom[1].count()} labels ({bottom[1].shape})")


@register_layer("HingeLoss")
class HingeLossLayer(_OneLabelPerItemLoss):
    """One-vs-all hinge loss of scores bottom[0] (N, dim...) against labels bottom[1] (N).

    With t = -1 for the true class and +1 otherwise, m = max(0, 1 + t x):
    L1: loss = sum m / N,   dx = sign(t m) * loss_weight / N;
    L2: loss = sum m^2 / N, dx = 2 t m * loss_weight / N."""

    def _sign_margin(self, xp, bottom):
        x = bottom[0].data_for(xp).reshape(self.num, self.dim)
        raw = bottom[1].data_for(xp).reshape(self.num, 1)
        lab, _ = _checked_labels(self, xp, raw, self.dim)
        t = 1 - 2 * _onehot(xp, lab, self.dim, x.dtype)[:, :, 0]   # -1 true class, +1 others
        return t, xp.maximum(0, 1 + t * x)

    def forward_xp(self, xp, bottom, top):
        t, m = self._sign_margin(xp, bottom)
        if self.layer_param.hinge_loss_param.norm == caffe_pb2.HingeLossParameter.L2:
            loss = (m * m).sum()
        else:
            loss = m.sum()
        top[0].mutable_data_for(xp)[...] = loss / self.num

    def backward_xp(self, xp, top, propagate_down, bottom):
        _no_label_backprop(self, propagate_down)
        if not propagate_down[0]:
            return
        t, m = self._sign_margin(xp, bottom)
        scale = _loss_weight(xp, top) / self.num
        if self.layer_param.hinge_loss_param.norm == caffe_pb2.HingeLossParameter.L2:
            g = 2 * t * m
        else:
            g = xp.sign(t * m)
        bottom[0].mutable_diff_for(xp)[...] = (g * scale).reshape(bottom[0].shape)


@register_layer("InfogainLoss")
class InfogainLossLayer(LossLayer):
    """Softmax of bottom[0] over ``infogain_loss_param.axis`` weighted by an infogain
    matrix H (C x C): loss = -sum_valid sum_l H[label, l] log(max(p_l, 1e-20)) / normalizer,
    dx_l = (p_l * sum_k H[label, k] - H[label, l]) * valid * loss_weight / normalizer.

    H comes from bottom[2] or from the binaryproto ``infogain_loss_param.source``;
    optional top[1] is the softmax.  ``loss_param.ignore_label`` and ``normalization``
    apply (the legacy ``normalize`` flag is refused, as in Caffe).  With H = I this is
    SoftmaxWithLoss (up to the log clamp)."""
    exact_num_bottom_blobs = -1
    min_bottom_blobs = 2
    max_bottom_blobs = 3
    exact_num_top_blobs = -1
    min_top_blobs = 1
    max_top_blobs = 2

    def layer_setup(self, bottom, top):
        lp = self.layer_param.loss_param
        if lp.HasField("normalize"):
            raise self.error('loss_param.normalize is deprecated; use "normalization"')
        self.has_ignore = lp.HasField("ignore_label")
        self.ignore_label = lp.ignore_label
        self.norm = lp.normalization
        self.prob = Blob(dtype=bottom[0].dtype)
        self.infogain = None
        if len(bottom) < 3:
            ip = self.layer_param.infogain_loss_param
            if not ip.HasField("source"):
                raise self.error("infogain matrix source must be specified "
                                 "(infogain_loss_param.source) when there is no third bottom")
            try:
                proto = read_binary(ip.source, caffe_pb2.BlobProto())
            except MinicaffeError as e:
                raise self.error(f"cannot read the infogain matrix: {e}") from None
            self.infogain = Blob(dtype=bottom[0].dtype)
            self.infogain.from_proto(proto)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.axis = bottom[0].canonical_axis_index(self.layer_param.infogain_loss_param.axis)
        self.outer = bottom[0].count(0, self.axis)
        self.inner = bottom[0].count(self.axis + 1)
        self.C = bottom[0].shape[self.axis]
        if self.outer * self.inner != bottom[1].count():
            raise self.error(f"number of labels must match number of predictions; e.g., if "
                             f"infogain axis == 1 and prediction shape is (N, C, H, W), label "
                             f"count must be N*H*W (predictions {bottom[0].shape}, labels "
                             f"{bottom[1].shape})")
        H = self.infogain if len(bottom) < 3 else bottom[2]
        if H.count() != self.C * self.C:
            raise self.error(f"the infogain matrix must be {self.C}x{self.C} "
                             f"(it has shape {H.shape})")
        self.prob.reshape(bottom[0].shape)
        if len(top) >= 2:
            top[1].reshape(bottom[0].shape)

    def _H(self, xp, bottom):
        H = self.infogain if len(bottom) < 3 else bottom[2]
        return H.data_for(xp).reshape(self.C, self.C)

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        p = self.prob.mutable_data_for(xp)
        p[...] = softmax(xp, x, self.axis)
        p3 = p.reshape(self.outer, self.C, self.inner)
        raw = bottom[1].data_for(xp).reshape(self.outer, self.inner)
        safe, valid = _checked_labels(self, xp, raw, self.C, self.has_ignore, self.ignore_label)
        rows = self._H(xp, bottom)[safe]                      # (outer, inner, C)
        logp = xp.log(xp.maximum(p3, LOG_THRESHOLD)).transpose(0, 2, 1)
        loss = -((rows * logp).sum(axis=2) * valid).sum()
        self._safe, self._valid = safe, valid
        self._count = int(valid.sum())
        top[0].mutable_data_for(xp)[...] = loss / normalizer(
            self.norm, self.outer, self.inner, self._count)
        if len(top) == 2:
            top[1].mutable_data_for(xp)[...] = p

    def backward_xp(self, xp, top, propagate_down, bottom):
        _no_label_backprop(self, propagate_down)
        _no_label_backprop(self, propagate_down, (2,), "infogain")
        if not propagate_down[0]:
            return
        H = self._H(xp, bottom)
        rows = H[self._safe].transpose(0, 2, 1)               # (outer, C, inner)
        row_sums = H.sum(axis=1)[self._safe][:, None, :]      # (outer, 1, inner)
        p3 = self.prob.data_for(xp).reshape(self.outer, self.C, self.inner)
        d3 = bottom[0].mutable_diff_for(xp).reshape(self.outer, self.C, self.inner)
        d3[...] = (p3 * row_sums - rows) * self._valid[:, None, :]
        d3 *= _loss_weight(xp, top) / normalizer(self.norm, self.outer, self.inner, self._count)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0


@register_layer("MultinomialLogisticLoss")
class MultinomialLogisticLossLayer(_OneLabelPerItemLoss):
    """loss = -sum_n log(max(p[n, label_n], 1e-20)) / N for probabilities bottom[0]
    (N, dim...) and labels bottom[1] (N); dp[n, label_n] = -loss_weight / N / max(p, 1e-20),
    zero elsewhere."""

    def _picked(self, xp, bottom):
        p = bottom[0].data_for(xp).reshape(self.num, self.dim)
        raw = bottom[1].data_for(xp).reshape(self.num, 1)
        lab, _ = _checked_labels(self, xp, raw, self.dim)
        return lab, xp.maximum(xp.take_along_axis(p, lab, axis=1), LOG_THRESHOLD)

    def forward_xp(self, xp, bottom, top):
        _, picked = self._picked(xp, bottom)
        top[0].mutable_data_for(xp)[...] = -xp.log(picked).sum() / self.num

    def backward_xp(self, xp, top, propagate_down, bottom):
        _no_label_backprop(self, propagate_down)
        if not propagate_down[0]:
            return
        lab, picked = self._picked(xp, bottom)
        onehot = _onehot(xp, lab, self.dim, picked.dtype)[:, :, 0]
        scale = _loss_weight(xp, top) / self.num
        bottom[0].mutable_diff_for(xp)[...] = (-scale * onehot / picked).reshape(bottom[0].shape)


@register_layer("ContrastiveLoss")
class ContrastiveLossLayer(LossLayer):
    """Contrastive loss of feature pairs a, b (N, C) with similarity labels y (N):
    d = ||a - b||;  loss = sum_n [y d^2 + (1 - y) max(margin - d, 0)^2] / (2N)
    (``legacy_version``: max(margin - d^2, 0) for dissimilar pairs).
    Gradients as Caffe computes them, including its 1e-4 guard in d for dissimilar
    pairs; bottom 2 (the labels) gets none."""
    exact_num_bottom_blobs = 3

    def layer_setup(self, bottom, top):
        self.diff = Blob(dtype=bottom[0].dtype)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.num = bottom[0].shape[0]
        self.C = bottom[0].count(1)
        if bottom[1].count(1) != self.C or bottom[1].shape[0] != self.num:
            raise self.error(f"the two feature bottoms must have the same shape "
                             f"({bottom[0].shape} vs {bottom[1].shape})")
        if bottom[2].count() != self.num:
            raise self.error(f"needs one similarity label per pair: {self.num} pairs, "
                             f"{bottom[2].count()} labels ({bottom[2].shape})")
        self.diff.reshape((self.num, self.C))

    def forward_xp(self, xp, bottom, top):
        p = self.layer_param.contrastive_loss_param
        d = self.diff.mutable_data_for(xp)
        d[...] = (bottom[0].data_for(xp).reshape(self.num, self.C)
                  - bottom[1].data_for(xp).reshape(self.num, self.C))
        self.dist_sq = (d * d).sum(axis=1)
        similar = bottom[2].data_for(xp).reshape(-1).astype(np.int64) != 0
        if p.legacy_version:
            dissim = xp.maximum(p.margin - self.dist_sq, 0)
        else:
            dissim = xp.maximum(p.margin - xp.sqrt(self.dist_sq), 0) ** 2
        loss = xp.where(similar, self.dist_sq, dissim).sum()
        top[0].mutable_data_for(xp)[...] = loss / self.num / 2

    def backward_xp(self, xp, top, propagate_down, bottom):
        _no_label_backprop(self, propagate_down, (2,))
        p = self.layer_param.contrastive_loss_param
        d = self.diff.data_for(xp)
        similar = (bottom[2].data_for(xp).reshape(-1).astype(np.int64) != 0)[:, None]
        for i in (0, 1):
            if not propagate_down[i]:
                continue
            alpha = (1 if i == 0 else -1) * _loss_weight(xp, top) / self.num
            if p.legacy_version:
                mdist = p.margin - self.dist_sq
                beta = -alpha * xp.ones_like(mdist)
            else:
                dist = xp.sqrt(self.dist_sq)
                mdist = p.margin - dist
                beta = -alpha * mdist / (dist + 1e-4)
            dissim = xp.where((mdist > 0)[:, None], beta[:, None] * d, 0)
            g = xp.where(similar, alpha * d, dissim)
            bottom[i].mutable_diff_for(xp)[...] = g.reshape(bottom[i].shape)

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2


@register_layer("Accuracy")
class AccuracyLayer(Layer):
    """Top-k accuracy of predictions bottom[0] (class along ``axis``) against labels
    bottom[1]; optional top[1] holds the per-class accuracy.  A prediction counts as
    correct when fewer than k classes score >= the true class's score (Caffe's rule,
    ties count against).  Labels equal to ``ignore_label`` are skipped."""
    exact_num_bottom_blobs = 2
    min_top_blobs = 1
    max_top_blobs = 2

    def layer_setup(self, bottom, top):
        p = self.layer_param.accuracy_param
        self.top_k = p.top_k
        self.has_ignore = p.HasField("ignore_label")
        self.ignore_label = p.ignore_label

    def reshape(self, bottom, top):
        p = self.layer_param.accuracy_param
        self.axis = bottom[0].canonical_axis_index(p.axis)
        self.outer = bottom[0].count(0, self.axis)
        self.inner = bottom[0].count(self.axis + 1)
        C = bottom[0].shape[self.axis]
        if self.top_k > C:
            raise self.error(f"top_k ({self.top_k}) must be less than or equal to the number of "
                             f"classes ({C})")
        if self.outer * self.inner != bottom[1].count():
            raise self.error(f"number of labels must match number of predictions "
                             f"(predictions {bottom[0].shape}, labels {bottom[1].shape})")
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape((C,))

    def forward_xp(self, xp, bottom, top):
        C = bottom[0].shape[self.axis]
        x = bottom[0].data_for(xp).reshape(self.outer, C, self.inner)
        raw = bottom[1].data_for(xp).reshape(self.outer, self.inner)
        safe, valid = _checked_labels(self, xp, raw, C, self.has_ignore, self.ignore_label)
        true_p = xp.take_along_axis(x, safe[:, None, :], axis=1)
        better = (x >= true_p).sum(axis=1) - 1
        correct = (better < self.top_k) & valid
        count = int(valid.sum())
        top[0].mutable_data_for(xp)[...] = float(correct.sum()) / count if count else 0.0
        if len(top) > 1:
            per_class_n = xp.bincount(safe[valid].ravel(), minlength=C)[:C]
            per_class_ok = xp.bincount(safe[correct].ravel(), minlength=C)[:C]
            acc = xp.where(per_class_n > 0, per_class_ok / xp.maximum(per_class_n, 1), 0)
            top[1].mutable_data_for(xp)[...] = acc

    def backward_cpu(self, top, propagate_down, bottom):
        if any(propagate_down):
            raise self.error("Accuracy layer cannot backpropagate")

    backward_gpu = backward_cpu
