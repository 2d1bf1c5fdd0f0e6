"""Normalization layers: BatchNorm and MVN (Caffe's batch_norm_layer and mvn_layer).

One body serves numpy and CuPy (``forward_xp``/``backward_xp``): the math is a
handful of reductions and broadcasts.
"""
import numpy as np

from ..core import log
from ..core.blob import Blob
from .layer import Layer
from ..proto import caffe_pb2
from .registry import register_layer


def _channels_view(a, channels):
    """(N, C, S) view of a blob array: N the first axis, C the second, S the rest."""
    return a.reshape(a.shape[0] if a.ndim else 1, channels, -1)


@register_layer("BatchNorm")
class BatchNormLayer(Layer):
    """Normalizes each channel (axis 1) of the bottom over the batch and the
    spatial axes: y = (x - mean) / sqrt(var + eps).  Bottom (N, C, ...) -> top of
    the same shape; may run in place.

    Three blobs, as Caffe's: the running sum of means (C,), of variances (C,)
    and of the weights (1,).  Training (``use_global_stats`` false, the default
    in TRAIN) uses the batch statistics and updates
    ``s = maf * s + 1``, ``mean_sum = maf * mean_sum + mean``,
    ``var_sum = maf * var_sum + m/(m-1) * var`` (m = N * spatial size, maf the
    ``moving_average_fraction``).  With global statistics (the default in TEST)
    mean = mean_sum / s and var = var_sum / s.

    The blobs are statistics, not parameters: layer setup appends a ParamSpec
    with ``lr_mult: 0`` for each (and refuses a non-zero one), so the Net never
    back-propagates into them and the solver never changes them.

    Backward: with batch statistics
    dx = (dy - mean(dy) - y * mean(dy * y)) / sqrt(var + eps) (means per
    channel); with global statistics dx = dy / sqrt(var + eps).
    """
    capturable = True
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.batch_norm_param
        self.moving_average_fraction = p.moving_average_fraction
        self.use_global_stats = self.phase == caffe_pb2.TEST
        if p.HasField("use_global_stats"):
            self.use_global_stats = p.use_global_stats
        self.channels = 1 if bottom[0].num_axes == 1 else bottom[0].shape[1]
        self.eps = p.eps
        if self.blobs:
            log.info("Skipping parameter initialization")
            expect = [(self.channels,), (self.channels,), (1,)]
            got = [b.shape for b in self.blobs]
            if got != expect:
                raise self.error(f"incorrect blob shapes {got}; expected {expect} for "
                                 f"{self.channels} channels (bottom shape {bottom[0].shape})")
        else:
            dtype = bottom[0].dtype
            self.blobs = [Blob((self.channels,), dtype), Blob((self.channels,), dtype),
                          Blob((1,), dtype)]
            for b in self.blobs:
                b.mutable_cpu_data()[...] = 0
        # Mask the statistics from optimization: local learning rates of zero.
        specs = self.layer_param.param
        for i in range(len(self.blobs)):
            if len(specs) == i:
                specs.add().lr_mult = 0.0
            elif specs[i].lr_mult != 0:
                raise self.error(f"Cannot configure batch normalization statistics as layer "
                                 f"parameters (param {i} has lr_mult {specs[i].lr_mult:g}; "
                                 f"it must be 0)")
        self.param_propagate_down = [False] * len(self.blobs)
        self.x_norm = self.std = None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) > 1 and shape[1] != self.channels:
            raise self.error(f"bottom has {shape[1]} channels (shape {shape}), the layer was "
                             f"set up for {self.channels}")
        if len(shape) == 0 or shape[0] == 0:
            raise self.error(f"bottom shape {shape} has no batch axis")
        top[0].reshape(shape)

    retain_inputs, retain_outputs = (), ()      # it keeps x_norm and std

    def state_bytes(self, bottom, top):
        return bottom[0].count() * bottom[0].dtype.itemsize

    def forward_xp(self, xp, bottom, top):
        x = _channels_view(bottom[0].data_for(xp), self.channels)
        dt = x.dtype.type
        if self.use_global_stats:
            s = self.blobs[2].data_for(xp)[0]
            factor = xp.where(s == 0, dt(0), dt(1) / xp.where(s == 0, dt(1), s))
            mean = factor * self.blobs[0].data_for(xp)
            var = factor * self.blobs[1].data_for(xp)
        else:
            mean = x.mean(axis=2).mean(axis=0)
        xc = x - mean[None, :, None]
        if not self.use_global_stats:
            var = (xc * xc).mean(axis=2).mean(axis=0)
            maf = dt(self.moving_average_fraction)
            stats = [b.mutable_data_for(xp) for b in self.blobs]
            stats[2] *= maf
            stats[2] += dt(1)
            stats[0][...] = mean + maf * stats[0]
            m = x.size // self.channels
            correction = dt(m / (m - 1)) if m > 1 else dt(1)
            stats[1][...] = correction * var + maf * stats[1]
        self.std = xp.sqrt(var + dt(self.eps))
        y = xc / self.std[None, :, None]
        self.x_norm = y  # kept: a later in-place layer may change the top
        top[0].mutable_data_for(xp)[...] = y.reshape(top[0].shape)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = _channels_view(top[0].diff_for(xp), self.channels)
        std = self.std[None, :, None]
        if self.use_global_stats:
            dx = dy / std
        else:
            y = self.x_norm
            mean_dy = dy.mean(axis=2).mean(axis=0)[None, :, None]
            mean_dyy = (dy * y).mean(axis=2).mean(axis=0)[None, :, None]
            dx = (dy - mean_dy - y * mean_dyy) / std
        bottom[0].mutable_diff_for(xp)[...] = dx.reshape(bottom[0].shape)


@register_layer("MVN")
class MVNLayer(Layer):
    """Mean-variance normalization: per (sample, channel) -- or per sample with
    ``across_channels`` -- subtract the mean and, with ``normalize_variance``
    (default), divide by (std + eps), std the biased standard deviation.
    Bottom (N, C, ...) -> top of the same shape.

    Backward is Caffe's: dx = (dy - mean(dy) - y * mean(dy * y)) / (std + eps)
    (exact when eps is negligible against std, the default eps being 1e-9),
    or dx = dy - mean(dy) without variance normalization.
    """
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.mvn_param
        self.normalize_variance = p.normalize_variance
        self.across_channels = p.across_channels
        self.eps = p.eps
        self.std = None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) == 0 or bottom[0].count() == 0:
            raise self.error(f"bottom shape {shape} is empty")
        top[0].reshape(shape)

    def _rows(self, a):
        num = a.shape[0] if self.across_channels or a.ndim < 2 else a.shape[0] * a.shape[1]
        return a.reshape(num, -1)

    def forward_xp(self, xp, bottom, top):
        x = self._rows(bottom[0].data_for(xp))
        y = x - x.mean(axis=1, keepdims=True)
        if self.normalize_variance:
            dt = x.dtype.type
            self.std = xp.sqrt((y * y).mean(axis=1, keepdims=True)) + dt(self.eps)
            y = y / self.std
        top[0].mutable_data_for(xp)[...] = y.reshape(top[0].shape)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = self._rows(top[0].diff_for(xp))
        if self.normalize_variance:
            y = self._rows(top[0].data_for(xp))
            dx = (dy - dy.mean(axis=1, keepdims=True)
                  - y * (dy * y).mean(axis=1, keepdims=True)) / self.std
        else:
            dx = dy - dy.mean(axis=1, keepdims=True)
        bottom[0].mutable_diff_for(xp)[...] = dx.reshape(bottom[0].shape)
