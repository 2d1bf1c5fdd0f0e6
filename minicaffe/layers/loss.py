"""Loss layers and Accuracy."""
import numpy as np

from ..blob import Blob
from ..layer import Layer, LossLayer
from ..proto import caffe_pb2
from ..registry import register_layer
from .common import softmax

FLT_MIN = np.float32(np.finfo(np.float32).tiny)
_Norm = caffe_pb2.LossParameter


def normalization_mode(layer_param):
    """The LossParameter normalization, honouring the legacy ``normalize`` flag."""
    lp = layer_param.loss_param
    if not lp.HasField("normalization") and lp.HasField("normalize"):
        return _Norm.VALID if lp.normalize else _Norm.BATCH_SIZE
    return lp.normalization


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


@register_layer("SoftmaxWithLoss")
class SoftmaxWithLossLayer(LossLayer):
    """Multinomial logistic loss of the softmax of bottom[0] over ``axis`` against
    integer labels bottom[1]; optional top[1] is the softmax.
    loss = -sum log(max(p[label], FLT_MIN)) / normalizer;  dx = (p - onehot) * w / normalizer."""
    min_top_blobs = 1
    max_top_blobs = 2
    exact_num_top_blobs = -1

    def layer_setup(self, bottom, top):
        self.has_ignore = self.layer_param.loss_param.HasField("ignore_label")
        self.ignore_label = self.layer_param.loss_param.ignore_label
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

    def _labels(self, xp, bottom):
        return bottom[1].data_for(xp).reshape(self.outer, self.inner).astype(np.int64)

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        p = self.prob.mutable_data_for(xp)
        p[...] = softmax(xp, x, self.axis)
        C = x.shape[self.axis]
        p3 = p.reshape(self.outer, C, self.inner)
        lab = self._labels(xp, bottom)
        valid = xp.ones(lab.shape, dtype=bool)
        if self.has_ignore:
            valid = lab != self.ignore_label
        safe = xp.where(valid, lab, 0)
        if bool(((safe < 0) | (safe >= C)).any()):
            bad = int(xp.asnumpy(safe).max()) if hasattr(xp, "asnumpy") else int(safe.max())
            raise self.error(f"label out of range [0, {C}) (saw {bad})")
        picked = xp.take_along_axis(p3, safe[:, None, :], axis=1)[:, 0, :]
        losses = -xp.log(xp.maximum(picked, FLT_MIN)) * valid
        count = int(valid.sum())
        top[0].mutable_data_for(xp)[...] = losses.sum() / normalizer(
            self.norm, self.outer, self.inner, count)
        if len(top) == 2:
            top[1].mutable_data_for(xp)[...] = p

    def backward_xp(self, xp, top, propagate_down, bottom):
        if len(propagate_down) > 1 and propagate_down[1]:
            raise self.error("cannot backpropagate to label inputs")
        if not propagate_down[0]:
            return
        p = self.prob.data_for(xp)
        C = p.shape[self.axis]
        dx = bottom[0].mutable_diff_for(xp)
        d3 = dx.reshape(self.outer, C, self.inner)
        d3[...] = p.reshape(self.outer, C, self.inner)
        lab = self._labels(xp, bottom)
        valid = xp.ones(lab.shape, dtype=bool) if not self.has_ignore else lab != self.ignore_label
        safe = xp.where(valid, lab, 0)
        sub = xp.take_along_axis(d3, safe[:, None, :], axis=1) - 1
        xp.put_along_axis(d3, safe[:, None, :], sub, axis=1)
        d3 *= valid[:, None, :]
        count = int(valid.sum())
        w = top[0].diff_for(xp).reshape(-1)[0] / normalizer(self.norm, self.outer, self.inner, count)
        d3 *= w


@register_layer("Accuracy")
class AccuracyLayer(Layer):
    """Top-k accuracy of predictions bottom[0] (class along ``axis``) against labels
    bottom[1]; optional top[1] holds the per-class accuracy.  A prediction counts as
    correct when fewer than k classes score >= the true class's score."""
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
        lab = bottom[1].data_for(xp).reshape(self.outer, self.inner).astype(np.int64)
        valid = xp.ones(lab.shape, dtype=bool) if not self.has_ignore else lab != self.ignore_label
        safe = xp.clip(xp.where(valid, lab, 0), 0, C - 1)
        true_p = xp.take_along_axis(x, safe[:, None, :], axis=1)
        better = (x >= true_p).sum(axis=1) - 1
        correct = (better < self.top_k) & valid
        count = int(valid.sum())
        top[0].mutable_data_for(xp)[...] = float(correct.sum()) / count if count else 0.0
        if len(top) > 1:
            per_class_n = xp.bincount(safe[valid].ravel(), minlength=C)
            per_class_ok = xp.bincount(safe[correct].ravel(), minlength=C)
            acc = xp.where(per_class_n > 0, per_class_ok / xp.maximum(per_class_n, 1), 0)
            top[1].mutable_data_for(xp)[...] = acc

    def backward_cpu(self, top, propagate_down, bottom):
        if any(propagate_down):
            raise self.error("Accuracy layer cannot backpropagate")

    backward_gpu = backward_cpu
