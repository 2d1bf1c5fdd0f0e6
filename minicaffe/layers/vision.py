"""Vision layers: Convolution, Deconvolution, Im2col, Pooling, LRN, SPP, Crop.

Convolution is Caffe's engine, im2col + GEMM, run over a bounded chunk of the
batch at a time with one GEMM per group (``ConvEngine``, in kernels/conv.py beside
kernels/im2col.py: the one im2col engine of the package):

* numpy, 2-D: per-layer workspaces (padded input, column matrix, GEMM output)
  are allocated once and reused, so no call pays for fresh pages.  The column
  matrix is built channel-last, one row per output pixel, by a single strided
  copy, and the GEMMs put that long axis first (faster in OpenBLAS than the
  transposed formulation for these channel counts).  With stride 1 the data
  gradient is computed as a full convolution of dy with the flipped kernel (an
  im2col copy instead of col2im's accumulation per kernel offset).  Layers with
  few input channels use Caffe's channel-major columns instead; a 1x1 kernel
  with stride 1 and no padding skips im2col (the input is the column matrix).
* CuPy, or N-D: the kernels package's whole-chunk ``im2col``/``col2im``
  (CUDA kernels on the GPU, strided slicing for N-D) and ``xp.matmul``.

docs/vision.md has the measured figures.

Shapes (Caffe's): convolution output ``(H + 2p - (d(k-1)+1)) // s + 1``;
deconvolution output ``s(H - 1) + d(k-1) + 1 - 2p``; pooling output
``ceil((H + 2p - k) / s) + 1`` (CEIL, Caffe's default; FLOOR when
``round_mode: FLOOR``), one less when the last window would start in the
padding.
"""
import math

import numpy as np

from ..core import context
from .. import kernels as K
from ..kernels.conv import COL_BUFFER_BYTES, ConvEngine, conv_budget  # noqa: F401
from ..core.blob import Blob
from ..core.filler import fill
from .layer import Layer
from ..proto import caffe_pb2
from .registry import engine_name, register_layer



def _per_axis(repeated, h_field, w_field, param, n_spatial, default, name, layer):
    """Caffe's kernel/stride/pad/dilation: either ``X_h``/``X_w`` (2-D only) or a
    repeated field with 0, 1 or n_spatial values."""
    fields = param.DESCRIPTOR.fields_by_name
    if h_field in fields and (param.HasField(h_field) or param.HasField(w_field)):
        if n_spatial != 2:
            raise layer.error(f"{name}_h & {name}_w can only be used for 2D convolution "
                              f"({n_spatial} spatial axes)")
        if not (param.HasField(h_field) and param.HasField(w_field)):
            raise layer.error(f"both {name}_h and {name}_w are required")
        if len(repeated):
            raise layer.error(f"either {name}_size or {name}_h/w should be specified; not both")
        return [getattr(param, h_field), getattr(param, w_field)]
    vals = list(repeated)
    if len(vals) == 0:
        if default is None:
            raise layer.error(f"{name}_size must be specified")
        return [default] * n_spatial
    if len(vals) not in (1, n_spatial):
        raise layer.error(f"{name} must be specified once, or once per spatial dimension "
                          f"({name} specified {len(vals)} times; {n_spatial} spatial dims)")
    return vals * n_spatial if len(vals) == 1 else vals


# ---------------------------------------------------------------------------
# the convolution engine
# ---------------------------------------------------------------------------
# ---------------------------------------------------------------------------
# Convolution, Deconvolution, Im2col
# ---------------------------------------------------------------------------
class _ConvGeometry(Layer):
    """Reads ConvolutionParameter's geometry (kernel, stride, pad, dilation,
    axis) as Caffe's BaseConvolutionLayer does."""
    allow_in_place = False

    def read_geometry(self, bottom):
        p = self.layer_param.convolution_param
        try:
            self.channel_axis = bottom[0].canonical_axis_index(p.axis)
        except IndexError:
            raise self.error(f"axis {p.axis} is out of range for bottom shape "
                             f"{bottom[0].shape}: no spatial axes") from None
        ns = bottom[0].num_axes - self.channel_axis - 1
        if ns < 1:
            raise self.error(f"bottom shape {bottom[0].shape} has no spatial axes after "
                             f"axis {p.axis}")
        self.num_spatial = ns
        self.kernel = _per_axis(p.kernel_size, "kernel_h", "kernel_w", p, ns, None, "kernel", self)
        self.stride = _per_axis(p.stride, "stride_h", "stride_w", p, ns, 1, "stride", self)
        self.pad = _per_axis(p.pad, "pad_h", "pad_w", p, ns, 0, "pad", self)
        self.dilation = _per_axis(p.dilation, "dilation_h", "dilation_w", p, ns, 1,
                                  "dilation", self)
        for name, vals in (("kernel", self.kernel), ("stride", self.stride),
                           ("dilation", self.dilation)):
            if min(vals) <= 0:
                raise self.error(f"{name} dimensions must be positive, got {vals}")
        self.channels = bottom[0].shape[self.channel_axis]

    def conv_out_spatial(self, in_spatial):
        """Convolution output size per spatial axis; one-line error when the
        (dilated) kernel does not fit the padded input."""
        out = []
        for i, size in enumerate(in_spatial):
            ext = self.dilation[i] * (self.kernel[i] - 1) + 1
            if size + 2 * self.pad[i] < ext:
                raise self.error(f"kernel extent {ext} (kernel_size {self.kernel[i]}, dilation "
                                 f"{self.dilation[i]}) is larger than the padded input "
                                 f"{size} + 2*pad {self.pad[i]} on spatial axis {i} "
                                 f"(bottom spatial shape {tuple(in_spatial)})")
            out.append((size + 2 * self.pad[i] - ext) // self.stride[i] + 1)
        return out

    def _nd(self, a, channels, spatial):
        """View of a blob array as (num, channels, *spatial), leading axes merged."""
        return a.reshape((-1, channels) + tuple(spatial))


class BaseConvolutionLayer(_ConvGeometry):
    capturable = True
    min_bottom_blobs = 1
    min_top_blobs = 1
    equal_num_bottom_top_blobs = True
    reverse_dimensions = False

    def layer_setup(self, bottom, top):
        p = self.layer_param.convolution_param
        self.read_geometry(bottom)
        self.num_output = p.num_output
        if self.num_output <= 0:
            raise self.error(f"num_output must be positive, got {self.num_output}")
        self.group = p.group
        if self.group <= 0 or self.channels % self.group or self.num_output % self.group:
            raise self.error(f"group ({self.group}) must divide both the input channels "
                             f"({self.channels}, bottom shape {bottom[0].shape}) and "
                             f"num_output ({self.num_output})")
        if self.reverse_dimensions:
            self.conv_out, self.conv_in = self.channels, self.num_output
        else:
            self.conv_out, self.conv_in = self.num_output, self.channels
        self.bias_term = p.bias_term
        wshape = (self.conv_out, self.conv_in // self.group) + tuple(self.kernel)
        if self.blobs:
            n = 1 + int(self.bias_term)
            if len(self.blobs) != n:
                raise self.error(f"incorrect number of weight blobs ({len(self.blobs)}, "
                                 f"expected {n})")
            if self.blobs[0].shape != wshape:
                raise self.error(f"incorrect weight shape: expected {wshape}; instead, shape "
                                 f"was {self.blobs[0].shape}")
            if self.bias_term and self.blobs[1].shape != (self.num_output,):
                raise self.error(f"incorrect bias shape: expected ({self.num_output},); "
                                 f"instead, shape was {self.blobs[1].shape}")
        else:
            dtype = bottom[0].dtype
            self.blobs = [Blob(wshape, dtype)]
            fill(self.blobs[0], p.weight_filler)
            if self.bias_term:
                self.blobs.append(Blob((self.num_output,), dtype))
                fill(self.blobs[1], p.bias_filler)
        self.param_propagate_down = [True] * len(self.blobs)
        self.engine = None

    def reshape(self, bottom, top):
        first = bottom[0].shape
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != first:
                raise self.error(f"all inputs must have the same shape: bottom 0 {first}, "
                                 f"bottom {i} {b.shape}")
        if len(first) != self.channel_axis + 1 + self.num_spatial:
            raise self.error(f"bottom shape {first} does not have the {self.num_spatial} "
                             f"spatial axes the layer was set up for")
        if first[self.channel_axis] != self.channels:
            raise self.error(f"input has {first[self.channel_axis]} channels (bottom shape "
                             f"{first}), the layer was set up for {self.channels}")
        self.in_spatial = first[self.channel_axis + 1:]
        self.out_spatial = self.compute_output_shape()
        for t in top:
            t.reshape(first[:self.channel_axis] + (self.num_output,) + tuple(self.out_spatial))
        # the engine sees a convolution: input (conv_in, in) -> output (conv_out, out)
        if self.reverse_dimensions:
            geo = (self.num_output, self.channels, self.out_spatial, self.in_spatial)
        else:
            geo = (self.channels, self.num_output, self.in_spatial, self.out_spatial)
        cin, cout, sin, sout = geo
        e = self.engine
        if (e is None or (e.C, e.O, e.in_spatial, e.out_spatial)
                != (cin, cout, tuple(sin), tuple(sout))):
            # engine DEFAULT: 5x5 stride-1 convolutions through Winograd on the CPU
            # (kernels/winograd.py); engine CAFFE: Caffe's im2col + GEMM everywhere
            self.engine = ConvEngine(cin, cout, self.group, self.kernel, self.pad, self.stride,
                                     self.dilation, sin, sout,
                                     winograd=engine_name(self.layer_param) != "CAFFE")
        self.engine.tf32 = self.config.tf32

    retain_inputs, retain_outputs = None, ()

    def _add_bias(self, xp, y):
        y += self.blobs[1].data_for(xp).reshape((1, -1) + (1,) * self.num_spatial)

    def _bias_grad(self, xp, dy):
        if self.bias_term and self.get_param_propagate_down(1):
            s = dy.reshape(dy.shape[0], self.num_output, -1).sum(axis=2).sum(axis=0)
            self.blobs[1].mutable_diff_for(xp)[...] += s


@register_layer("Convolution")
class ConvolutionLayer(BaseConvolutionLayer):
    """y = W * x + b over the spatial axes after ``axis`` (groups, stride, pad,
    dilation, N-D).  Bottoms (num, C, *S) -> tops (num, num_output, *S');
    weights (num_output, C/group, *kernel), bias (num_output,).  Backward:
    dW += dy (x) x, db += sum dy, dx = W^T (x) dy (col2im)."""

    def compute_output_shape(self):
        return self.conv_out_spatial(self.in_spatial)

    def takes_relu(self):
        return True

    def forward_xp(self, xp, bottom, top):
        w = self.blobs[0].data_for(xp)
        for b, t in zip(bottom, top):
            x = self._nd(b.data_for(xp), self.channels, self.in_spatial)
            y = self._nd(t.mutable_data_for(xp), self.num_output, self.out_spatial)
            bias = self.blobs[1].data_for(xp) if self.bias_term else None
            # TRAIN, one bottom: the weight gradient may reuse what the forward made of x
            self.engine.forward(xp, x, w, y, conv_budget(xp), bias=bias,
                                keep=self.phase == caffe_pb2.TRAIN and len(bottom) == 1,
                                **({"relu": True} if self.relu_after else {}))

    def backward_xp(self, xp, top, propagate_down, bottom):
        w = self.blobs[0].data_for(xp)
        dw = self.blobs[0].mutable_diff_for(xp) if self.get_param_propagate_down(0) else None
        db = (self.blobs[1].mutable_diff_for(xp)
              if self.bias_term and self.get_param_propagate_down(1) else None)
        for i, (b, t) in enumerate(zip(bottom, top)):
            dy = self._nd(t.diff_for(xp), self.num_output, self.out_spatial)
            dx = None
            if propagate_down[i]:
                dx = self._nd(b.mutable_diff_for(xp), self.channels, self.in_spatial)
            x = self._nd(b.data_for(xp), self.channels, self.in_spatial)
            relu = ({"relu_y": self._nd(t.data_for(xp), self.num_output, self.out_spatial)}
                    if self.relu_after else {})
            self.engine.backward(xp, x, w, dy, conv_budget(xp), dw=dw, dx=dx, db=db, **relu)


@register_layer("Deconvolution")
class DeconvolutionLayer(BaseConvolutionLayer):
    """The transpose of Convolution: forward is convolution's data gradient.
    Output size s(H - 1) + d(k-1) + 1 - 2p.  Weights (C, num_output/group, *k)."""
    reverse_dimensions = True

    def compute_output_shape(self):
        out = []
        for i, size in enumerate(self.in_spatial):
            ext = self.dilation[i] * (self.kernel[i] - 1) + 1
            o = self.stride[i] * (size - 1) + ext - 2 * self.pad[i]
            if o <= 0:
                raise self.error(f"output size {o} on spatial axis {i} is not positive "
                                 f"(input {size}, kernel_size {self.kernel[i]}, stride "
                                 f"{self.stride[i]}, pad {self.pad[i]})")
            out.append(o)
        return out

    def forward_xp(self, xp, bottom, top):
        w = self.blobs[0].data_for(xp)
        for b, t in zip(bottom, top):
            x = self._nd(b.data_for(xp), self.channels, self.in_spatial)
            y = self._nd(t.mutable_data_for(xp), self.num_output, self.out_spatial)
            self.engine.backward(xp, None, w, x, conv_budget(xp), dx=y)
            if self.bias_term:
                self._add_bias(xp, y)

    def backward_xp(self, xp, top, propagate_down, bottom):
        w = self.blobs[0].data_for(xp)
        dw = self.blobs[0].mutable_diff_for(xp) if self.get_param_propagate_down(0) else None
        for i, (b, t) in enumerate(zip(bottom, top)):
            dy = self._nd(t.diff_for(xp), self.num_output, self.out_spatial)
            self._bias_grad(xp, dy)
            x = self._nd(b.data_for(xp), self.channels, self.in_spatial)
            if dw is not None:
                # as a convolution the "input" is dy and the "output gradient" is x
                self.engine.backward(xp, dy, w, x, conv_budget(xp), dw=dw)
            if propagate_down[i]:
                dx = self._nd(b.mutable_diff_for(xp), self.channels, self.in_spatial)
                self.engine.forward(xp, dy, w, dx, conv_budget(xp))


@register_layer("Im2col")
class Im2colLayer(_ConvGeometry):
    """Caffe's Im2col layer: bottom (num, C, *S) -> top (num, C*prod(kernel), *S'),
    each output position holding its receptive field (rows channel-major, then
    kernel offsets).  Backward is col2im (overlaps summed)."""
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        self.read_geometry(bottom)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != self.channel_axis + 1 + self.num_spatial:
            raise self.error(f"bottom shape {shape} does not have the {self.num_spatial} "
                             f"spatial axes the layer was set up for")
        if shape[self.channel_axis] != self.channels:
            raise self.error(f"input has {shape[self.channel_axis]} channels (bottom shape "
                             f"{shape}), the layer was set up for {self.channels}")
        self.in_spatial = shape[self.channel_axis + 1:]
        self.out_spatial = self.conv_out_spatial(self.in_spatial)
        self.ksize = math.prod(self.kernel)
        top[0].reshape(shape[:self.channel_axis] + (self.channels * self.ksize,)
                       + tuple(self.out_spatial))

    def _geo(self):
        return (self.kernel, self.pad, self.stride, self.dilation)

    def forward_xp(self, xp, bottom, top):
        x = self._nd(bottom[0].data_for(xp), self.channels, self.in_spatial)
        N, CK, P = x.shape[0], self.channels * self.ksize, math.prod(self.out_spatial)
        col = (K.im2col(x, *self._geo()) if self.num_spatial == 2
               else K.im2col_nd(x, *self._geo()))
        y = top[0].mutable_data_for(xp).reshape(N, CK, P)
        y[...] = col.reshape(CK, N, P).swapaxes(0, 1)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        N = bottom[0].count() // bottom[0].count(self.channel_axis)
        CK, P = self.channels * self.ksize, math.prod(self.out_spatial)
        dy = top[0].diff_for(xp).reshape(N, CK, P)
        col = xp.ascontiguousarray(dy.swapaxes(0, 1)).reshape(CK, N * P)
        shape = (N, self.channels) + tuple(self.in_spatial)
        dx = (K.col2im(col, shape, *self._geo()) if self.num_spatial == 2
              else K.col2im_nd(col, shape, *self._geo()))
        bottom[0].mutable_diff_for(xp)[...] = dx.reshape(bottom[0].shape)


# ---------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------
_Pool = caffe_pb2.PoolingParameter


def pooled_size(size, kernel, stride, pad, round_mode=_Pool.CEIL):
    """Caffe's pooled output size on one axis (CEIL or FLOOR, then the padding
    correction: the last window must start inside the image or left padding)."""
    r = math.ceil if round_mode == _Pool.CEIL else math.floor
    out = int(r((size + 2 * pad - kernel) / stride)) + 1
    if pad > 0 and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@register_layer("Pooling")
class PoolingLayer(Layer):
    """MAX, AVE or STOCHASTIC pooling over (H, W) of a (N, C, H, W) bottom.
    Caffe's CEIL output rounding (or FLOOR) and padding rules (see
    kernels/pooling.py: AVE divides by the window clipped to the padded
    input); optional second top: the MAX argmax mask (flat h*W+w, as float).
    Backward routes dy to the argmax (MAX), the sampled element (STOCHASTIC)
    or spreads dy/pool_size over the window (AVE)."""
    allow_in_place = False

    @property
    def capturable(self):
        """STOCHASTIC pooling in TRAIN draws from CuPy's generator (cuRAND): not capturable."""
        return not (self.method == _Pool.STOCHASTIC and self.phase == caffe_pb2.TRAIN)

    exact_num_bottom_blobs = 1
    min_top_blobs = 1
    max_top_blobs = 2

    def layer_setup(self, bottom, top):
        p = self.layer_param.pooling_param
        self.global_pooling = p.global_pooling
        has_kh = p.HasField("kernel_h") or p.HasField("kernel_w")
        if self.global_pooling:
            if p.HasField("kernel_size") or has_kh:
                raise self.error("with global_pooling: true filter size cannot be specified")
        else:
            if p.HasField("kernel_size") and has_kh:
                raise self.error("filter size is kernel_size OR kernel_h and kernel_w; not both")
            if not p.HasField("kernel_size") and not (p.HasField("kernel_h")
                                                       and p.HasField("kernel_w")):
                raise self.error("for non-square filters both kernel_h and kernel_w are required"
                                 if has_kh else "kernel_size (or kernel_h and kernel_w) must "
                                 "be specified")
        if p.HasField("pad") and (p.HasField("pad_h") or p.HasField("pad_w")):
            raise self.error("pad is pad OR pad_h and pad_w; not both")
        if p.HasField("pad_h") != p.HasField("pad_w"):
            raise self.error("both pad_h and pad_w are required")
        if p.HasField("stride") and (p.HasField("stride_h") or p.HasField("stride_w")):
            raise self.error("stride is stride OR stride_h and stride_w; not both")
        if p.HasField("stride_h") != p.HasField("stride_w"):
            raise self.error("both stride_h and stride_w are required")
        if p.HasField("kernel_size"):
            self.kernel = [p.kernel_size] * 2
        elif not self.global_pooling:
            self.kernel = [p.kernel_h, p.kernel_w]
        self.pad = [p.pad_h, p.pad_w] if p.HasField("pad_h") else [p.pad] * 2
        self.stride = [p.stride_h, p.stride_w] if p.HasField("stride_h") else [p.stride] * 2
        if self.global_pooling and (max(self.pad) != 0 or max(self.stride) != 1):
            raise self.error(f"with global_pooling: true only pad = 0 and stride = 1 are "
                             f"allowed (pad {self.pad}, stride {self.stride})")
        if min(self.stride) <= 0:
            raise self.error(f"stride must be positive, got {self.stride}")
        if max(self.pad) > 0 and p.pool not in (_Pool.AVE, _Pool.MAX):
            raise self.error("padding implemented only for average and max pooling")
        if not self.global_pooling:
            if min(self.kernel) <= 0:
                raise self.error(f"filter dimensions must be greater than zero, got "
                                 f"{self.kernel}")
            if self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]:
                raise self.error(f"pad {self.pad} must be smaller than kernel_size "
                                 f"{self.kernel}")
        if len(top) > 1 and p.pool != _Pool.MAX:
            raise self.error("a second (mask) top is only produced by MAX pooling")
        self.method = p.pool
        self.round_mode = p.round_mode
        self.mask = None

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got "
                             f"shape {bottom[0].shape}")
        N, C, H, W = bottom[0].shape
        if self.global_pooling:
            self.kernel = [H, W]
        # the kernels compute Caffe's CEIL geometry; FLOOR keeps its leading windows.  A
        # kernel larger than the padded input gives Caffe's one clipped window (CEIL).
        self.ceil_shape = K.pool_output_shape(H, W, self.kernel, self.stride, self.pad)
        self.out_shape = tuple(pooled_size(s, k, st, p, self.round_mode) for s, k, st, p
                               in zip((H, W), self.kernel, self.stride, self.pad))
        if min(self.out_shape) <= 0:
            raise self.error(f"kernel_size {self.kernel} leaves no output on the padded input "
                             f"{H}x{W} + 2*pad {self.pad} (bottom shape {bottom[0].shape})")
        for t in top:
            t.reshape((N, C) + self.out_shape)

    # MAX keeps its own mask, AVE needs nothing; STOCHASTIC reads what it saw
    @property
    def retain_inputs(self):
        return () if self.method in (_Pool.MAX, _Pool.AVE) else None

    @property
    def retain_outputs(self):
        return () if self.method in (_Pool.MAX, _Pool.AVE) else None

    def state_bytes(self, bottom, top):
        if self.method == _Pool.MAX:   # the int32 argmax mask (Caffe's ceil geometry)
            return top[0].count() * 4
        return 0

    def _crop(self, a):
        PH, PW = self.out_shape
        return a if self.out_shape == tuple(self.ceil_shape) else a[:, :, :PH, :PW]

    def _uncrop(self, xp, dy):
        if self.out_shape == tuple(self.ceil_shape):
            return dy
        full = xp.zeros(dy.shape[:2] + tuple(self.ceil_shape), dtype=dy.dtype)
        full[:, :, :dy.shape[2], :dy.shape[3]] = dy
        return full

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        geo = (self.kernel, self.stride, self.pad)
        # CEIL geometry (the usual case): the kernels write straight into the top
        out = top[0].mutable_data_for(xp) if self.out_shape == tuple(self.ceil_shape) else None
        if self.method == _Pool.MAX:
            mask_out = None
            if xp is not np:   # one mask buffer for the layer's life (fixed address)
                shape = x.shape[:2] + tuple(self.ceil_shape)
                if getattr(self, "_mask_buf", None) is None or self._mask_buf.shape != shape:
                    self._mask_buf = xp.empty(shape, dtype=np.int32)
                mask_out = self._mask_buf
            relu = self.relu_after and out is not None and xp is np
            y, self.mask = K.max_pool_forward(x, *geo, out=out, mask_out=mask_out,
                                              **({"relu": True} if relu else {}))
            if len(top) > 1:
                top[1].mutable_data_for(xp)[...] = self._crop(self.mask)
        elif self.method == _Pool.AVE:
            y = K.ave_pool_forward(x, *geo, out=out)
        elif self.phase == caffe_pb2.TRAIN:
            shape = x.shape[:2] + tuple(self.ceil_shape)
            u = (context.rng().uniform(0, 1, size=shape).astype(x.dtype) if xp is np
                 else context.gpu_rng().uniform(0, 1, size=shape, dtype=x.dtype))
            y, self.mask = K.stochastic_pool_forward_train(x, u, *geo)
        else:
            y = K.stochastic_pool_forward_test(x, *geo)
        if y is not out:
            top[0].mutable_data_for(xp)[...] = self._crop(y)
        if self.relu_after and not (self.method == _Pool.MAX and out is not None
                                    and xp is np):
            t = top[0].mutable_data_for(xp)
            xp.maximum(t, 0, out=t)

    def takes_relu(self):
        return self.method == _Pool.MAX

    def backward_xp(self, xp, top, propagate_down, bottom):
        if self.relu_after:
            fused = (self.method == _Pool.MAX and xp is np and propagate_down[0]
                     and self.out_shape == tuple(self.ceil_shape))
            if not fused:   # the ReLU's backward apart
                xp.multiply(top[0].diff_for(xp), top[0].data_for(xp) > 0,
                            out=top[0].mutable_diff_for(xp))
        if not propagate_down[0]:
            return
        dy = self._uncrop(xp, top[0].diff_for(xp))
        shape = bottom[0].shape
        geo = (self.kernel, self.stride, self.pad)
        out = bottom[0].mutable_diff_for(xp)   # the kernels write the gradient into it
        if self.method == _Pool.MAX:
            mask = self.mask
            if mask is None:  # backward without a forward: the mask top has it
                mask = self._uncrop(xp, top[1].data_for(xp).astype(np.int32) + 1) - 1
            relu = (self.relu_after and xp is np and self.out_shape == tuple(self.ceil_shape))
            K.max_pool_backward(dy, mask, shape, *geo, out=out,
                                **({"relu_y": top[0].data_for(xp)} if relu else {}))
        elif self.method == _Pool.AVE:
            K.ave_pool_backward(dy, shape, *geo, out=out)
        else:
            if self.mask is None:
                raise self.error("stochastic pooling backward needs a TRAIN forward first")
            K.stochastic_pool_backward(dy, self.mask, shape, *geo, out=out)


# ---------------------------------------------------------------------------
# LRN
# ---------------------------------------------------------------------------
_LRN = caffe_pb2.LRNParameter


@register_layer("LRN")
class LRNLayer(Layer):
    """Local response normalisation of a (N, C, H, W) bottom.
    ACROSS_CHANNELS: y = x (k + alpha/n sum_{window of n channels} x^2)^-beta;
    WITHIN_CHANNEL: y = x (1 + alpha/n^2 sum_{n x n window} x^2)^-beta (Caffe's
    composition of pooling and power layers: k is not used).  Backward is the
    exact gradient (kernels/lrn.py)."""
    capturable = True
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.lrn_param
        self.size = p.local_size
        if self.size % 2 != 1:
            raise self.error(f"LRN only supports odd values for local_size, got {self.size}")
        self.alpha, self.beta, self.k = p.alpha, p.beta, p.k
        self.region = p.norm_region
        self.scale = self.x_saved = None

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got "
                             f"shape {bottom[0].shape}")
        top[0].reshape(bottom[0].shape)

    def state_bytes(self, bottom, top):
        n = bottom[0].count() * bottom[0].dtype.itemsize
        return n * (2 if top[0] is bottom[0] else 1)   # the scale, and x when in place

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        # in place, backward still needs the input: keep a copy
        self.x_saved = x.copy() if top[0] is bottom[0] else None
        if self.region == _LRN.ACROSS_CHANNELS:
            y, self.scale = K.lrn_across_channels_forward(x, self.size, self.alpha, self.beta,
                                                          self.k)
        else:
            y, self.scale = K.lrn_within_channel_forward(x, self.size, self.alpha, self.beta)
        top[0].mutable_data_for(xp)[...] = y

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = self.x_saved if self.x_saved is not None else bottom[0].data_for(xp)
        args = (top[0].diff_for(xp), x, top[0].data_for(xp), self.scale,
                self.size, self.alpha, self.beta)
        if self.region == _LRN.ACROSS_CHANNELS:
            dx = K.lrn_across_channels_backward(*args)
        else:
            dx = K.lrn_within_channel_backward(*args)
        bottom[0].mutable_diff_for(xp)[...] = dx


# ---------------------------------------------------------------------------
# SPP
# ---------------------------------------------------------------------------
@register_layer("SPP")
class SPPLayer(Layer):
    """Spatial pyramid pooling: for level l < pyramid_height, pool the
    (N, C, H, W) bottom into about 2^l x 2^l bins (kernel ceil(H/2^l), stride =
    kernel, pad (kernel*2^l - H + 1)/2, Caffe's Pooling rules), flatten each
    level and concatenate: top (N, C * sum_l bins_l).  pyramid_height 1 gives
    the single pooling's 4-D top (N, C, 1, 1), as in Caffe."""
    allow_in_place = False
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.spp_param
        self.pyramid_height = p.pyramid_height
        if self.pyramid_height < 1:
            raise self.error(f"pyramid_height must be at least 1, got {self.pyramid_height}")
        self.pool = p.pool
        self.in_shape = None

    def _pool_param(self, level, H, W):
        bins = 2 ** level
        lp = caffe_pb2.LayerParameter(name=f"{self.name} (pyramid level {level})",
                                      type="Pooling", phase=self.phase)
        pp = lp.pooling_param
        kh, kw = -(-H // bins), -(-W // bins)
        pp.kernel_h, pp.kernel_w = kh, kw
        pp.stride_h, pp.stride_w = kh, kw
        pp.pad_h, pp.pad_w = (kh * bins - H + 1) // 2, (kw * bins - W + 1) // 2
        pp.pool = self.pool
        return lp

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got "
                             f"shape {bottom[0].shape}")
        N, C, H, W = bottom[0].shape
        if H <= 0 or W <= 0:
            raise self.error(f"input dimensions cannot be zero (bottom shape {bottom[0].shape})")
        if self.in_shape != (N, C, H, W):
            self.in_shape = (N, C, H, W)
            self.pools, self.pool_tops = [], []
            for level in range(self.pyramid_height):
                layer = PoolingLayer(self._pool_param(level, H, W))
                t = Blob(dtype=bottom[0].dtype)
                layer.setup(bottom, [t])
                self.pools.append(layer)
                self.pool_tops.append(t)
        for layer, t in zip(self.pools, self.pool_tops):
            layer.reshape(bottom, [t])
        if self.pyramid_height == 1:
            top[0].reshape(self.pool_tops[0].shape)
        else:
            top[0].reshape((N, sum(t.count(1) for t in self.pool_tops)))

    def forward_xp(self, xp, bottom, top):
        y = top[0].mutable_data_for(xp).reshape(self.in_shape[0], -1)
        off = 0
        for layer, t in zip(self.pools, self.pool_tops):
            layer.forward_xp(xp, bottom, [t])
            n = t.count(1)
            y[:, off:off + n] = t.data_for(xp).reshape(self.in_shape[0], n)
            off += n

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff_for(xp).reshape(self.in_shape[0], -1)
        total = None
        off = 0
        for layer, t in zip(self.pools, self.pool_tops):
            n = t.count(1)
            t.mutable_diff_for(xp)[...] = dy[:, off:off + n].reshape(t.shape)
            off += n
            layer.backward_xp(xp, [t], [True], bottom)
            d = bottom[0].diff_for(xp)
            total = d.copy() if total is None else total + d
        bottom[0].mutable_diff_for(xp)[...] = total


# ---------------------------------------------------------------------------
# Crop
# ---------------------------------------------------------------------------
@register_layer("Crop")
class CropLayer(Layer):
    """Crop bottom 0 to the shape of bottom 1 on the axes from ``axis`` on,
    starting at ``offset`` (none: 0; one value: every cropped axis; else one
    per cropped axis).  Backward: bottom 0's diff is top's diff inside the
    crop and 0 outside; bottom 1 gets no gradient."""
    capturable = True
    exact_num_bottom_blobs = 2
    exact_num_top_blobs = 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.crop_param
        nd = bottom[0].num_axes
        try:
            self.start_axis = bottom[0].canonical_axis_index(p.axis)
        except IndexError:
            raise self.error(f"crop axis {p.axis} is out of range for bottom shape "
                             f"{bottom[0].shape}") from None
        if len(p.offset) > 1 and self.start_axis + len(p.offset) != nd:
            raise self.error(f"number of offset values specified ({len(p.offset)}) must be "
                             f"equal to the number of dimensions following axis "
                             f"{self.start_axis} ({nd - self.start_axis}; bottom shape "
                             f"{bottom[0].shape})")
        self.offset_param = list(p.offset)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom, top):
        a, b = bottom[0].shape, bottom[1].shape
        if len(a) != len(b):
            raise self.error(f"bottoms must have the same number of axes: {a} and {b}")
        shape, self.offsets = [], []
        for i in range(len(a)):
            off, size = 0, a[i]
            if i >= self.start_axis:
                size = b[i]
                if len(self.offset_param) == 1:
                    off = self.offset_param[0]
                elif len(self.offset_param) > 1:
                    off = self.offset_param[i - self.start_axis]
                if a[i] - off < b[i]:
                    raise self.error(f"the crop for dimension {i} is out-of-bounds with size "
                                     f"{b[i]} and offset {off} (bottom 0 shape {a}, bottom 1 "
                                     f"shape {b})")
            shape.append(size)
            self.offsets.append(off)
        top[0].reshape(tuple(shape))
        self.region = tuple(slice(o, o + s) for o, s in zip(self.offsets, shape))

    def forward_xp(self, xp, bottom, top):
        top[0].mutable_data_for(xp)[...] = bottom[0].data_for(xp)[self.region]

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].mutable_diff_for(xp)
        dx[...] = 0
        dx[self.region] = top[0].diff_for(xp)
