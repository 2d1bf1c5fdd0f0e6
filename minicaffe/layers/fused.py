"""Fused layer types: two adjacent layers of a net that the GPU engine computes as one
(a net rewrite in the manner of Caffe's ``insert_splits``, made by ``find_fusions`` when
the Net is built; no Caffe counterpart, cuDNN's fused calls and PyTorch's affine batch
norm are the models).

A pair is a layer and the layer right after it computing in place on its only top:

- ``Convolution+ReLU``: a cuDNN convolution with a bias and one bottom, then a plain
  ReLU: y = max(W * x + b, 0) in one cudnnConvolutionBiasActivationForward; the ReLU's
  backward runs as usual (it reads y).
- ``Eltwise+ReLU``: a SUM of two bottoms with unit coefficients (not in place), then a
  plain ReLU (ResNet's y = relu(a + b)): one pass forward; backward writes the masked
  gradient to both bottoms in one kernel, and the ReLU's backward is part of it.
- ``BatchNorm+Scale``: a cuDNN BatchNorm training with batch statistics, then a learned
  per-channel Scale: the scale and bias are applied in the same cuDNN call (y = gamma
  x_hat + beta) and its backward gives their gradients; the Scale's bodies are part of it.
- ``BatchNorm+Scale+ReLU`` (three layers: ResNet's): that pair, then a plain ReLU in place
  on the same top.  On 2-byte maps held channels-last (engine/precision.py) the batch
  norm's own kernels apply it, y = max(gamma x_hat + beta, 0), and mask dy by y > 0
  before the batch norm's backward (kernels/reduced.bn_nhwc_*); elsewhere (fp32, NCHW)
  the group runs the pair's fused body, then the ReLU's own forward, and backward the
  ReLU's own backward, then the pair's.

The Net keeps every layer (their names, blobs, parameters and hooks are what pycaffe and
the log show) and, on the GPU, runs a group's fused body where the pass ran all its
layers (``Net.fusions``; the log says which groups at set-up, ``minicaffe memory`` and
``draw`` show them).  A fused body that cannot take this pass's shapes (a convolution
cuDNN does not run for this shape, a Scale that is not per channel) runs the first
layer's own body and the Net runs the others as usual.  The CPU runs every group one
layer after the other (``FusedPair.forward_cpu``/``backward_cpu`` say so in code).
"""
from ..core import config
from ..core.errors import MinicaffeError
from ..proto import caffe_pb2

_SUM = caffe_pb2.EltwiseParameter.SUM


class FusedPair:
    """Layers ``first`` and ``second`` (indices ``index`` and ``index + 1`` of a net), and
    for a group of ``size`` 3 ``third`` (``index + 2``)."""
    type = None
    size = 2
    # the second layer's backward is part of the fused backward (skipped by the Net)
    fuses_backward = False
    # tops of the first layer whose data the fused backward reads beside what the first
    # layer itself retains (``Layer.retain_outputs``): read by the memory plan
    retain_outputs = ()
    # False: the second layer's own backward and what it keeps from forward are not run
    # (its retain declarations and state are not counted by the memory plan)
    second_backward_runs = True

    def __init__(self, index, *layers):
        if len(layers) != self.size:
            raise ValueError(f"{self.type} fuses {self.size} layers, got {len(layers)}")
        self.index = index
        self.layers = tuple(layers)
        self.first, self.second = layers[0], layers[1]
        self.third = layers[2] if len(layers) > 2 else None

    @property
    def names(self):
        return tuple(layer.name for layer in self.layers)

    def forward_cpu(self, bottom, top):
        """The CPU's body: each layer's own forward, one after the other, in place on the
        group's one top (what the Net runs on the CPU)."""
        self.first.forward_body(bottom, top)
        for layer in self.layers[1:]:
            layer.forward_body(top, top)

    def backward_cpu(self, top, propagate_down, bottom):
        """The CPU's backward: each layer's own, last first."""
        for layer in self.layers[:0:-1]:
            layer.backward(top, [True], top)
        self.first.backward(top, propagate_down, bottom)

    def forward_body(self, bottom, top):
        """GPU: the first layer's forward, with the second's when this pass can fuse them:
        True when both ran (the Net then only reshapes the second)."""
        a = self.first
        try:
            a.reshape(bottom, top)
            done = self.forward_gpu(bottom, top)
            if not done:
                a.forward_gpu(bottom, top)
        except MinicaffeError:
            raise
        except Exception as e:
            raise a.failure(e) from e
        return done

    def forward(self, bottom, top):
        """``forward_body``, then the device's deferred checks (as ``Layer.forward``)."""
        done = self.forward_body(bottom, top)
        self.first.check_deferred()
        return done

    def backward(self, top, propagate_down, bottom):
        """The first layer's backward, the second's included (``fuses_backward``)."""
        self.first.backward(top, propagate_down, bottom)

    def forward_gpu(self, bottom, top):
        raise NotImplementedError

    def __repr__(self):
        return f"<{self.type} '{self.first.name}' + '{self.second.name}'>"


class ConvolutionReLU(FusedPair):
    type = "Convolution+ReLU"

    def forward_gpu(self, bottom, top):
        return self.first.forward_gpu_relu(bottom, top)


class EltwiseReLU(FusedPair):
    type = "Eltwise+ReLU"
    fuses_backward = True
    retain_outputs = (0,)     # the mask of the ReLU's gradient

    def forward_gpu(self, bottom, top):
        return self.first.forward_gpu_relu(bottom, top)

    def backward(self, top, propagate_down, bottom):
        a = self.first
        try:
            a.backward_gpu_relu(top, propagate_down, bottom)
        except MinicaffeError:
            raise
        except Exception as e:
            raise a.failure(e) from e


class BatchNormScale(FusedPair):
    type = "BatchNorm+Scale"
    fuses_backward = True
    second_backward_runs = False

    @property
    def reduced_body(self):
        """The pair runs on 2-byte buffers (real 16-bit storage, engine/precision.py)
        where cuDNN's training batch norm applies the per-channel Scale."""
        a, b = self.first, self.second
        return bool(getattr(a, "reduced_body", False)) and \
            len(b.layer_param.bottom) == 1 and b.blobs[0].num_axes == 1 and \
            b.layer_param.scale_param.axis == 1

    def forward_gpu(self, bottom, top):
        return self.first.forward_gpu_scale(bottom, top, self.second)


class BatchNormScaleReLU(BatchNormScale):
    type = "BatchNorm+Scale+ReLU"
    size = 3
    # the ReLU's mask where it runs apart (fp32, NCHW): the group's output
    retain_outputs = (0,)
    # the pass ran the ReLU as a layer of its own (the batch norm's kernels did not)
    _relu_apart = False

    def forward_gpu(self, bottom, top):
        done = self.first.forward_gpu_scale(bottom, top, self.second, relu=True)
        self._relu_apart = done is True
        if self._relu_apart:
            self.third.reshape(top, top)
            self.third.forward_gpu(top, top)
        return bool(done)

    def backward(self, top, propagate_down, bottom):
        if self._relu_apart:
            self.third.backward(top, [True], top)
        self.first.backward(top, propagate_down, bottom)


def _relu_in_place(lp, name):
    return (lp.type == "ReLU" and lp.relu_param.negative_slope == 0
            and list(lp.bottom) == [name] and list(lp.top) == [name])


def find_fusions(layer_params, engine_of, use_global_stats=None, per_channel=None):
    """[(first index, fused type covering ``size`` layers)] of a net's layers
    (``layer_params``: its LayerParameters, after the splits); ``engine_of(i)``: 'CAFFE'
    or 'CUDNN', the engine layer i was (or would be) built with; ``use_global_stats(i)``:
    whether BatchNorm i normalises with its global statistics, ``per_channel(i)``: whether
    Scale i is a learned per-channel scale of one bottom (defaults: as the parameters and
    phase say).  MINICAFFE_FUSE_BN_RELU=0: no
    BatchNorm+Scale+ReLU (the pair, then the ReLU apart)."""
    out = []
    bn_relu = config.env("MINICAFFE_FUSE_BN_RELU")
    i = 0
    while i + 1 < len(layer_params):
        a, b = layer_params[i], layer_params[i + 1]
        kind = None
        if any(a.loss_weight) or any(b.loss_weight):
            pass        # a loss read from a top the fused call writes: not fused
        elif len(a.top) == 1 and a.top[0] not in a.bottom:
            name = a.top[0]
            if a.type == "Convolution" and engine_of(i) == "CUDNN" and len(a.bottom) == 1 \
                    and a.convolution_param.bias_term and _relu_in_place(b, name):
                kind = ConvolutionReLU
            elif a.type == "Eltwise" and a.eltwise_param.operation == _SUM \
                    and len(a.bottom) == 2 and all(c == 1 for c in a.eltwise_param.coeff) \
                    and _relu_in_place(b, name):
                kind = EltwiseReLU
        if (kind is None and a.type == "BatchNorm" and engine_of(i) == "CUDNN"
                and len(a.bottom) == 1 and len(a.top) == 1 and b.type == "Scale"
                and list(b.bottom) == [a.top[0]] and list(b.top) == [a.top[0]]
                and not any(a.loss_weight) and not any(b.loss_weight)
                and (per_channel(i + 1) if per_channel is not None else
                     b.scale_param.axis == 1 and b.scale_param.num_axes == 1)):
            if use_global_stats is not None:
                global_stats = use_global_stats(i)
            else:
                p = a.batch_norm_param
                global_stats = (p.use_global_stats if p.HasField("use_global_stats")
                                else a.phase == caffe_pb2.TEST)
            if not global_stats:
                kind = BatchNormScale
                if bn_relu and i + 2 < len(layer_params) and \
                        _relu_in_place(layer_params[i + 2], a.top[0]) and \
                        not any(layer_params[i + 2].loss_weight):
                    kind = BatchNormScaleReLU
        if kind is not None:
            out.append((i, kind))
            i += kind.size      # a layer belongs to one group at most
        else:
            i += 1
    return out
