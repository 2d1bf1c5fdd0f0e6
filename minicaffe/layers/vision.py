"""Vision layers: Convolution, Deconvolution, Pooling.

Convolution is Caffe's engine, im2col + GEMM, but over the whole batch (or a
bounded chunk of it) in one GEMM per group: col is (C*k, N*OH*OW), see
``kernels/im2col.py``.
"""
import numpy as np

from .. import log
from ..blob import Blob
from ..filler import fill
from .. import kernels as K
from ..layer import Layer
from ..proto import caffe_pb2
from ..registry import register_layer

# Largest im2col buffer one GEMM may use; larger batches are done in chunks.
COL_BUFFER_BYTES = {"cpu": 64 << 20, "gpu": 1 << 30}


def _per_axis(repeated, h_field, w_field, param, n_spatial, default, name, layer):
    """Caffe's kernel/stride/pad/dilation: either ``X_h``/``X_w`` (2-D only) or a
    repeated field with 0, 1 or n_spatial values."""
    fields = param.DESCRIPTOR.fields_by_name
    if h_field in fields and (param.HasField(h_field) or param.HasField(w_field)):
        if n_spatial != 2:
            raise layer.error(f"{name}_h & {name}_w can only be used for 2D convolution")
        if not (param.HasField(h_field) and param.HasField(w_field)):
            raise layer.error(f"both {name}_h and {name}_w are required")
        if len(repeated):
            raise layer.error(f"either {name}_size or {name}_h/w should be specified; not both")
        return [getattr(param, h_field), getattr(param, w_field)]
    vals = list(repeated)
    if len(vals) == 0:
        if default is None:
            raise layer.error(f"{name} size must be specified")
        return [default] * n_spatial
    if len(vals) not in (1, n_spatial):
        raise layer.error(f"{name} must be specified once, or once per spatial dimension "
                          f"({name} specified {len(vals)} times; {n_spatial} spatial dims)")
    return vals * n_spatial if len(vals) == 1 else vals


def conv_forward(xp, x, w, group, kernel, pad, stride, dilation, out_spatial, budget):
    """y (N, Cout, *out) = conv(x (N, C, *in), w (Cout, C/g, *k)) in chunks of the batch."""
    N, C = x.shape[:2]
    Cout = w.shape[0]
    ksize = int(np.prod(kernel))
    osize = int(np.prod(out_spatial))
    w2 = w.reshape(group, Cout // group, (C // group) * ksize)
    y = xp.empty((N, Cout) + tuple(out_spatial), dtype=x.dtype)
    for n0, n1 in _chunks(N, C * ksize * osize * x.dtype.itemsize, budget):
        col = _im2col(x[n0:n1], kernel, pad, stride, dilation)
        col = col.reshape(group, (C // group) * ksize, (n1 - n0) * osize)
        y2 = xp.matmul(w2, col)  # (g, Cout/g, n*osize)
        y[n0:n1] = y2.reshape(Cout, n1 - n0, *out_spatial).swapaxes(0, 1)
    return y


def conv_backward(xp, x, w, dy, group, kernel, pad, stride, dilation, budget,
                  dw=None, dx=None):
    """Accumulate the weight gradient into ``dw`` and write the data gradient into ``dx``."""
    N, C = x.shape[:2]
    Cout = w.shape[0]
    out_spatial = dy.shape[2:]
    ksize = int(np.prod(kernel))
    osize = int(np.prod(out_spatial))
    w2 = w.reshape(group, Cout // group, (C // group) * ksize)
    dw2 = None if dw is None else dw.reshape(group, Cout // group, (C // group) * ksize)
    for n0, n1 in _chunks(N, C * ksize * osize * x.dtype.itemsize, budget):
        n = n1 - n0
        dy2 = dy[n0:n1].swapaxes(0, 1).reshape(group, Cout // group, n * osize)
        if dw2 is not None:
            col = _im2col(x[n0:n1], kernel, pad, stride, dilation)
            col = col.reshape(group, (C // group) * ksize, n * osize)
            dw2 += xp.matmul(dy2, col.swapaxes(1, 2))
        if dx is not None:
            dcol = xp.matmul(w2.swapaxes(1, 2), dy2).reshape(C * ksize, n * osize)
            dx[n0:n1] = _col2im(dcol, x[n0:n1].shape, kernel, pad, stride, dilation)


def _chunks(N, bytes_per_sample, budget):
    per = max(1, int(budget // max(bytes_per_sample, 1)))
    return [(n0, min(N, n0 + per)) for n0 in range(0, N, per)]


def _im2col(x, kernel, pad, stride, dilation):
    if len(kernel) == 2:
        return K.im2col(x, kernel, pad, stride, dilation)
    return K.im2col_nd(x, kernel, pad, stride, dilation)


def _col2im(col, shape, kernel, pad, stride, dilation):
    if len(kernel) == 2:
        return K.col2im(col, shape, kernel, pad, stride, dilation)
    return K.col2im_nd(col, shape, kernel, pad, stride, dilation)


class BaseConvolutionLayer(Layer):
    min_bottom_blobs = 1
    min_top_blobs = 1
    equal_num_bottom_top_blobs = True
    reverse_dimensions = False

    def layer_setup(self, bottom, top):
        p = self.layer_param.convolution_param
        if p.engine not in (caffe_pb2.ConvolutionParameter.DEFAULT, caffe_pb2.ConvolutionParameter.CAFFE):
            log.info("layer '%s': engine %s is not available; using minicaffe's im2col+GEMM engine",
                     self.name, caffe_pb2.ConvolutionParameter.Engine.Name(p.engine))
        self.channel_axis = bottom[0].canonical_axis_index(p.axis)
        ns = bottom[0].num_axes - self.channel_axis - 1
        if ns < 1:
            raise self.error(f"bottom {bottom[0].shape} has no spatial axes after axis {p.axis}")
        self.num_spatial = ns
        self.kernel = _per_axis(p.kernel_size, "kernel_h", "kernel_w", p, ns, None, "kernel", self)
        self.stride = _per_axis(p.stride, "stride_h", "stride_w", p, ns, 1, "stride", self)
        self.pad = _per_axis(p.pad, "pad_h", "pad_w", p, ns, 0, "pad", self)
        self.dilation = _per_axis(p.dilation, "dilation_h", "dilation_w", p, ns, 1, "dilation", self)
        if min(self.kernel) <= 0 or min(self.stride) <= 0 or min(self.dilation) <= 0:
            raise self.error("kernel, stride and dilation dimensions must be positive")
        self.channels = bottom[0].shape[self.channel_axis]
        self.num_output = p.num_output
        if self.num_output <= 0:
            raise self.error(f"num_output must be positive, got {self.num_output}")
        self.group = p.group
        if self.group <= 0 or self.channels % self.group or self.num_output % self.group:
            raise self.error(f"group ({self.group}) must divide both the input channels "
                             f"({self.channels}) and num_output ({self.num_output})")
        if self.reverse_dimensions:
            self.conv_out, self.conv_in = self.channels, self.num_output
        else:
            self.conv_out, self.conv_in = self.num_output, self.channels
        self.bias_term = p.bias_term
        wshape = (self.conv_out, self.conv_in // self.group) + tuple(self.kernel)
        if self.blobs:
            n = 1 + int(self.bias_term)
            if len(self.blobs) != n:
                raise self.error(f"incorrect number of weight blobs ({len(self.blobs)}, expected {n})")
            if self.blobs[0].shape != wshape:
                raise self.error(f"incorrect weight shape: expected {wshape}; instead, shape was "
                                 f"{self.blobs[0].shape}")
            if self.bias_term and self.blobs[1].shape != (self.num_output,):
                raise self.error(f"incorrect bias shape: expected ({self.num_output},); instead, "
                                 f"shape was {self.blobs[1].shape}")
        else:
            dtype = bottom[0].dtype
            self.blobs = [Blob(wshape, dtype)]
            fill(self.blobs[0], p.weight_filler)
            if self.bias_term:
                self.blobs.append(Blob((self.num_output,), dtype))
                fill(self.blobs[1], p.bias_filler)
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom, top):
        first = bottom[0].shape
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != first:
                raise self.error(f"all inputs must have the same shape: bottom 0 {first}, "
                                 f"bottom {i} {b.shape}")
        if first[self.channel_axis] != self.channels:
            raise self.error(f"input has {first[self.channel_axis]} channels, the layer was set "
                             f"up for {self.channels}")
        self.in_spatial = first[self.channel_axis + 1:]
        out = self.compute_output_shape()
        self.out_spatial = out
        for b, t in zip(bottom, top):
            t.reshape(first[:self.channel_axis] + (self.num_output,) + tuple(out))

    def _budget(self, xp):
        return COL_BUFFER_BYTES["cpu" if xp is np else "gpu"]

    def _nchw(self, xp, a, channels, spatial):
        return a.reshape((-1, channels) + tuple(spatial))


@register_layer("Convolution")
class ConvolutionLayer(BaseConvolutionLayer):
    """y = W * x + b over the spatial axes after ``axis``; groups, dilation, N-D.
    Output size (H + 2p - (d(k-1)+1)) / s + 1 (floor)."""

    def compute_output_shape(self):
        out = []
        for i, size in enumerate(self.in_spatial):
            ext = self.dilation[i] * (self.kernel[i] - 1) + 1
            if size + 2 * self.pad[i] < ext:
                raise self.error(f"kernel extent {ext} (kernel {self.kernel[i]}, dilation "
                                 f"{self.dilation[i]}) is larger than the padded input "
                                 f"{size} + 2*{self.pad[i]} on spatial axis {i}")
            out.append((size + 2 * self.pad[i] - ext) // self.stride[i] + 1)
        return out

    def forward_xp(self, xp, bottom, top):
        w = self.blobs[0].data_for(xp)
        for b, t in zip(bottom, top):
            x = self._nchw(xp, b.data_for(xp), self.channels, self.in_spatial)
            y = conv_forward(xp, x, w, self.group, self.kernel, self.pad, self.stride,
                             self.dilation, self.out_spatial, self._budget(xp))
            if self.bias_term:
                bias = self.blobs[1].data_for(xp)
                y += bias.reshape((1, -1) + (1,) * self.num_spatial)
            t.mutable_data_for(xp)[...] = y.reshape(t.shape)

    def backward_xp(self, xp, top, propagate_down, bottom):
        w = self.blobs[0].data_for(xp)
        dw = self.blobs[0].mutable_diff_for(xp) if self.get_param_propagate_down(0) else None
        for i, (b, t) in enumerate(zip(bottom, top)):
            dy = self._nchw(xp, t.diff_for(xp), self.num_output, self.out_spatial)
            if self.bias_term and self.get_param_propagate_down(1):
                axes = (0,) + tuple(range(2, 2 + self.num_spatial))
                self.blobs[1].mutable_diff_for(xp)[...] += dy.sum(axis=axes)
            dx = None
            if propagate_down[i]:
                dx = self._nchw(xp, b.mutable_diff_for(xp), self.channels, self.in_spatial)
            if dw is None and dx is None:
                continue
            x = self._nchw(xp, b.data_for(xp), self.channels, self.in_spatial)
            conv_backward(xp, x, w, dy, self.group, self.kernel, self.pad, self.stride,
                          self.dilation, self._budget(xp), dw=dw, dx=dx)


@register_layer("Deconvolution")
class DeconvolutionLayer(BaseConvolutionLayer):
    """The transpose of Convolution: forward is convolution's data gradient.
    Output size s(H - 1) + d(k-1) + 1 - 2p.  Weights (C_in, num_output/g, *k)."""
    reverse_dimensions = True

    def compute_output_shape(self):
        out = []
        for i, size in enumerate(self.in_spatial):
            ext = self.dilation[i] * (self.kernel[i] - 1) + 1
            o = self.stride[i] * (size - 1) + ext - 2 * self.pad[i]
            if o <= 0:
                raise self.error(f"output size {o} on spatial axis {i} is not positive "
                                 f"(input {size}, kernel {self.kernel[i]}, pad {self.pad[i]})")
            out.append(o)
        return out

    def forward_xp(self, xp, bottom, top):
        w = self.blobs[0].data_for(xp)
        for b, t in zip(bottom, top):
            x = self._nchw(xp, b.data_for(xp), self.channels, self.in_spatial)
            y = xp.zeros((x.shape[0], self.num_output) + tuple(self.out_spatial), dtype=x.dtype)
            conv_backward(xp, y, w, x, self.group, self.kernel, self.pad, self.stride,
                          self.dilation, self._budget(xp), dw=None, dx=y)
            if self.bias_term:
                y += self.blobs[1].data_for(xp).reshape((1, -1) + (1,) * self.num_spatial)
            t.mutable_data_for(xp)[...] = y.reshape(t.shape)

    def backward_xp(self, xp, top, propagate_down, bottom):
        w = self.blobs[0].data_for(xp)
        dw = self.blobs[0].mutable_diff_for(xp) if self.get_param_propagate_down(0) else None
        for i, (b, t) in enumerate(zip(bottom, top)):
            dy = self._nchw(xp, t.diff_for(xp), self.num_output, self.out_spatial)
            if self.bias_term and self.get_param_propagate_down(1):
                axes = (0,) + tuple(range(2, 2 + self.num_spatial))
                self.blobs[1].mutable_diff_for(xp)[...] += dy.sum(axis=axes)
            x = self._nchw(xp, b.data_for(xp), self.channels, self.in_spatial)
            if dw is not None:
                # as a convolution, the "input" is dy and the "output gradient" is x
                conv_backward(xp, dy, w, x, self.group, self.kernel, self.pad, self.stride,
                              self.dilation, self._budget(xp), dw=dw, dx=None)
            if propagate_down[i]:
                dx = conv_forward(xp, dy, w, self.group, self.kernel, self.pad, self.stride,
                                  self.dilation, self.in_spatial, self._budget(xp))
                b.mutable_diff_for(xp)[...] = dx.reshape(b.shape)


_Pool = caffe_pb2.PoolingParameter


@register_layer("Pooling")
class PoolingLayer(Layer):
    """MAX, AVE or STOCHASTIC pooling over (H, W), Caffe's CEIL output rounding and
    padding rules (see kernels/pooling.py); optional second top: the MAX argmax mask."""
    exact_num_bottom_blobs = 1
    min_top_blobs = 1
    max_top_blobs = 2

    def layer_setup(self, bottom, top):
        p = self.layer_param.pooling_param
        self.global_pooling = p.global_pooling
        if self.global_pooling:
            if p.HasField("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w"):
                raise self.error("with global_pooling: true filter size cannot be specified")
        else:
            if p.HasField("kernel_size") == (p.HasField("kernel_h") and p.HasField("kernel_w")):
                raise self.error("filter size is kernel_size OR kernel_h and kernel_w; not both")
            if not p.HasField("kernel_size") and not (p.HasField("kernel_h") and p.HasField("kernel_w")):
                raise self.error("for non-square filters both kernel_h and kernel_w are required")
        if p.HasField("pad") and (p.HasField("pad_h") or p.HasField("pad_w")):
            raise self.error("pad is pad OR pad_h and pad_w; not both")
        if p.HasField("stride") and (p.HasField("stride_h") or p.HasField("stride_w")):
            raise self.error("stride is stride OR stride_h and stride_w; not both")
        if p.HasField("kernel_size"):
            self.kernel = [p.kernel_size] * 2
        elif not self.global_pooling:
            self.kernel = [p.kernel_h, p.kernel_w]
        self.pad = [p.pad_h, p.pad_w] if p.HasField("pad_h") else [p.pad] * 2
        self.stride = [p.stride_h, p.stride_w] if p.HasField("stride_h") else [p.stride] * 2
        if self.global_pooling and (max(self.pad) != 0 or max(self.stride) != 1):
            raise self.error("with global pooling, pad must be 0 and stride 1")
        if max(self.pad) > 0 and p.pool not in (_Pool.AVE, _Pool.MAX):
            raise self.error("padding implemented only for average and max pooling")
        if not self.global_pooling:
            if min(self.kernel) <= 0:
                raise self.error("filter dimensions must be greater than zero")
            if self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]:
                raise self.error(f"pad {self.pad} must be smaller than the kernel {self.kernel}")
        if p.round_mode != _Pool.CEIL:
            raise self.error("round_mode FLOOR is not supported yet (CEIL, Caffe's default, is)")
        if len(top) > 1 and p.pool != _Pool.MAX:
            raise self.error("a mask top is only produced by MAX pooling")
        self.method = p.pool

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got "
                             f"{bottom[0].shape}")
        N, C, H, W = bottom[0].shape
        if self.global_pooling:
            self.kernel = [H, W]
        if self.kernel[0] > H + 2 * self.pad[0] or self.kernel[1] > W + 2 * self.pad[1]:
            raise self.error(f"kernel {self.kernel} is larger than the padded input "
                             f"{H}x{W} + 2*{self.pad}")
        PH, PW = K.pool_output_shape(H, W, self.kernel, self.stride, self.pad)
        for t in top:
            t.reshape((N, C, PH, PW))
        self.mask = None

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        geo = (self.kernel, self.stride, self.pad)
        if self.method == _Pool.MAX:
            y, self.mask = K.max_pool_forward(x, *geo)
            if len(top) > 1:
                top[1].mutable_data_for(xp)[...] = self.mask
        elif self.method == _Pool.AVE:
            y = K.ave_pool_forward(x, *geo)
        else:
            from .. import context
            if self.phase == caffe_pb2.TRAIN:
                u = (context.rng().uniform(0, 1, size=top[0].shape).astype(x.dtype) if xp is np
                     else context.gpu_rng().uniform(0, 1, size=top[0].shape, dtype=x.dtype))
                y, self.mask = K.stochastic_pool_forward_train(x, u, *geo)
            else:
                y = K.stochastic_pool_forward_test(x, *geo)
        top[0].mutable_data_for(xp)[...] = y

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff_for(xp)
        shape = bottom[0].shape
        geo = (self.kernel, self.stride, self.pad)
        if self.method == _Pool.MAX:
            mask = self.mask if self.mask is not None else top[1].data_for(xp).astype(np.int32)
            dx = K.max_pool_backward(dy, mask, shape, *geo)
        elif self.method == _Pool.AVE:
            dx = K.ave_pool_backward(dy, shape, *geo)
        else:
            dx = K.stochastic_pool_backward(dy, self.mask, shape, *geo)
        bottom[0].mutable_diff_for(xp)[...] = dx
