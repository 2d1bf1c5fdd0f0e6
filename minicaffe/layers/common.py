"""Common layers: InnerProduct, Split, Softmax."""
import numpy as np

from ..blob import Blob
from ..filler import fill
from ..layer import Layer
from ..registry import register_layer


@register_layer("InnerProduct")
class InnerProductLayer(Layer):
    """Fully connected: bottom (M, K) flattened from ``axis`` -> top (M, N).
    y = x W^T + b  (W is (N, K), or (K, N) with ``transpose``).
    dW += dy^T x, db += sum_m dy, dx = dy W."""
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.inner_product_param
        self.N = p.num_output
        if self.N <= 0:
            raise self.error(f"num_output must be positive, got {self.N}")
        self.bias_term = p.bias_term
        self.transpose = p.transpose
        axis = bottom[0].canonical_axis_index(p.axis)
        self.K = bottom[0].count(axis)
        wshape = (self.K, self.N) if self.transpose else (self.N, self.K)
        dtype = bottom[0].dtype
        if self.blobs:
            want = [wshape] + ([(self.N,)] if self.bias_term else [])
            if len(self.blobs) != len(want):
                raise self.error(f"expected {len(want)} parameter blobs, got {len(self.blobs)}")
            if self.blobs[0].shape != wshape:
                raise self.error(f"weight shape {self.blobs[0].shape} does not match {wshape}")
            return
        self.blobs = [Blob(wshape, dtype)]
        fill(self.blobs[0], p.weight_filler)
        if self.bias_term:
            self.blobs.append(Blob((self.N,), dtype))
            fill(self.blobs[1], p.bias_filler)
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom, top):
        p = self.layer_param.inner_product_param
        axis = bottom[0].canonical_axis_index(p.axis)
        k = bottom[0].count(axis)
        if k != self.K:
            raise self.error(f"input size incompatible with inner product parameters: bottom "
                             f"{bottom[0].shape} gives {k} inputs per row, weights expect {self.K}")
        self.M = bottom[0].count(0, axis)
        top[0].reshape(bottom[0].shape[:axis] + (self.N,))

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp).reshape(self.M, self.K)
        w = self.blobs[0].data_for(xp)
        y = top[0].mutable_data_for(xp).reshape(self.M, self.N)
        xp.matmul(x, w if self.transpose else w.T, out=y)
        if self.bias_term:
            y += self.blobs[1].data_for(xp)

    def backward_xp(self, xp, top, propagate_down, bottom):
        dy = top[0].diff_for(xp).reshape(self.M, self.N)
        x = bottom[0].data_for(xp).reshape(self.M, self.K)
        if self.get_param_propagate_down(0):
            dw = self.blobs[0].mutable_diff_for(xp)
            dw += (x.T @ dy) if self.transpose else (dy.T @ x)
        if self.bias_term and self.get_param_propagate_down(1):
            self.blobs[1].mutable_diff_for(xp)[...] += dy.sum(axis=0)
        if propagate_down[0]:
            w = self.blobs[0].data_for(xp)
            dx = bottom[0].mutable_diff_for(xp).reshape(self.M, self.K)
            xp.matmul(dy, w.T if self.transpose else w, out=dx)


@register_layer("Split")
class SplitLayer(Layer):
    """Copies one bottom to several tops (sharing its data); the bottom's diff is
    the sum of the tops' diffs."""
    exact_num_bottom_blobs = 1
    min_top_blobs = 1

    def reshape(self, bottom, top):
        for i, t in enumerate(top):
            if t is bottom[0]:
                raise self.error(f"top {i} cannot be computed in place")
            t.reshape(bottom[0].shape)
            t.share_data(bottom[0])

    def forward_xp(self, xp, bottom, top):
        pass

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].mutable_diff_for(xp)
        dx[...] = top[0].diff_for(xp)
        for t in top[1:]:
            dx += t.diff_for(xp)


def softmax(xp, x, axis):
    m = x.max(axis=axis, keepdims=True)
    e = xp.exp(x - m)
    e /= e.sum(axis=axis, keepdims=True)
    return e


@register_layer("Softmax")
class SoftmaxLayer(Layer):
    """Softmax over ``axis`` (default 1).  dx = y * (dy - sum(dy * y, axis))."""
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def reshape(self, bottom, top):
        self.axis = bottom[0].canonical_axis_index(self.layer_param.softmax_param.axis)
        top[0].reshape(bottom[0].shape)

    def forward_xp(self, xp, bottom, top):
        top[0].mutable_data_for(xp)[...] = softmax(xp, bottom[0].data_for(xp), self.axis)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data_for(xp)
        dy = top[0].diff_for(xp)
        dot = (dy * y).sum(axis=self.axis, keepdims=True)
        bottom[0].mutable_diff_for(xp)[...] = (dy - dot) * y
