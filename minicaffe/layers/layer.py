"""The Layer base class: Caffe's lifecycle (layer.hpp).

``setup`` checks the declared blob counts, calls ``layer_setup`` once (read
parameters, create and fill ``self.blobs``), then ``reshape``, then records the
loss weights.  ``forward`` reshapes, runs the CPU or GPU body for this thread's
mode and returns the weighted loss.  ``backward`` runs the body with
``propagate_down``.  Parameter diffs accumulate; bottom diffs are overwritten.

A layer writes its math once for numpy and cupy as ``forward_xp(xp, bottom, top)``
and ``backward_xp(xp, top, propagate_down, bottom)``, or as separate
``forward_cpu``/``forward_gpu`` bodies.  A layer with no GPU body runs its CPU
body in GPU mode (the SyncedMemory moves the data).
"""
import contextlib

import numpy as np

from ..core import backend, context
from ..core.blob import Blob
from ..core.errors import LayerError, MinicaffeError, layer_failure

CAST_WEIGHTS = "cast weights"   # the copy cast by the step's one launch (engine/plan.py)


class Layer:
    type = None
    exact_num_bottom_blobs = -1
    min_bottom_blobs = -1
    max_bottom_blobs = -1
    exact_num_top_blobs = -1
    min_top_blobs = -1
    max_top_blobs = -1
    equal_num_bottom_top_blobs = False
    auto_top_blobs = False
    # GPU: the forward and backward bodies may be captured in a CUDA graph and replayed
    # (they never wait for the host, read values back, call CuPy's cuBLAS or cuRAND, or
    # take decisions from device data; persistent buffers are made on the first call)
    capturable = False
    # a data layer: its forward is host work plus a copy into its tops, run before the
    # captured part of the iteration each time (engine/step.py)
    graph_prologue = False
    allow_in_place = True   # False: a top may not be one of the bottoms
    engine_name = "CAFFE"   # which engine's class this is (registry: 'CUDNN' for cuDNN's)
    # a later layer of the net rewrites a top of this one in place (the Net's
    # ``top_rewritten``), as the registry's ``create_layer`` built it: a cuDNN class chosen
    # so (its ``cudnn_reads_top`` said it may be) refuses cuDNN where its backward would
    # read that top
    top_rewritten = False
    in_place = False        # set by setup: a top is one of the bottoms
    # GPU: the bodies read and write 2-byte buffers of the layer's reduced type (real
    # 16-bit storage, engine/precision.py); False: the engine casts around the layer
    reduced_body = False
    # the 2-byte type in which the GPU step's one launch cast this layer's weights
    # (``weights_cast_by``); None: the body casts them itself
    _step_cast = None
    # What backward reads of the data forward saw, declared by each layer beside its math
    # (Chainer's retain_inputs / retain_outputs): the indices of the bottoms and of the tops
    # whose *data* the backward body reads.  None: all of them (the default, always safe).
    # A layer whose answer depends on its parameters, its engine or on running in place
    # makes these properties.  The memory plan and offload read them (engine/plan.py keeps a
    # blob's data alive until the last backward that retains it); tests/layers/
    # test_registry.py checks each declaration against the math (the data not retained is
    # poisoned before backward, and the gradients must not change).
    retain_inputs = None
    retain_outputs = None
    _config = None

    def weights_cast_by(self, storage):
        """The GPU step says, around its forward and backward only, that its one launch
        cast this layer's weights to ``storage``'s 2-byte type into the copy the memory plan
        gave it (``planned_workspace[CAST_WEIGHTS]``, engine/plan.py's ``one_cast``): a
        body reads that copy instead of casting.  None: the body casts them itself (a
        pycaffe forward between steps casts the weights it reads then)."""
        self._step_cast = storage

    @property
    def config(self):
        """The run's settings (``config.RunConfig``: TF32, workspace limit...), given by the
        Net that builds the layer; a layer made alone takes the environment's defaults."""
        if self._config is None:
            from ..core.config import RunConfig
            self._config = RunConfig.from_environment()
        return self._config

    @config.setter
    def config(self, value):
        self._config = value

    @classmethod
    def cudnn_refuses(cls, param):
        """For a cuDNN class: None when cuDNN computes this LayerParameter as Caffe does,
        else the reason (the registry then builds Caffe's class, with one log line)."""
        return None

    @classmethod
    def cudnn_reads_top(cls, param):
        """For a cuDNN class: True when its backward reads its top's data, which a later
        layer rewriting that top in place would change (the Net knows: ``Net.top_rewritten``;
        the registry then builds Caffe's class, with one log line)."""
        return False

    def __init__(self, param):
        self.layer_param = param
        self.phase = param.phase
        self.blobs = []
        for bp in param.blobs:
            b = Blob()
            b.from_proto(bp)
            self.blobs.append(b)
        self.param_propagate_down = []
        self._loss = []

    # -- names -------------------------------------------------------------
    @property
    def name(self):
        return self.layer_param.name

    def error(self, message):
        """A LayerError naming this layer, to raise."""
        return LayerError(self.layer_param.name, self.type, message)

    def failure(self, exc):
        """``exc``, raised by this layer's code, as one line naming the layer (and still of
        its own type: see errors.layer_failure)."""
        return layer_failure(self.layer_param.name, self.type, exc)

    # -- lifecycle -----------------------------------------------------------
    # Each step of the lifecycle turns any failure of the layer's code into one line
    # naming the layer (MinicaffeErrors already are one).
    def setup(self, bottom, top):
        self.check_blob_counts(bottom, top)
        self.in_place = any(t is b for t in top for b in bottom)
        if not self.allow_in_place and self.in_place:
            raise self.error("cannot be computed in place (a top is also its bottom); give "
                             "its top a name of its own")
        try:
            self.layer_setup(bottom, top)
            self.reshape(bottom, top)
        except MinicaffeError:
            raise
        except Exception as e:
            raise self.failure(e) from e
        self.set_loss_weights(top)

    def layer_setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError(f"{type(self).__name__}.reshape")

    def check_blob_counts(self, bottom, top):
        nb, nt = len(bottom), len(top)
        if self.exact_num_bottom_blobs >= 0 and nb != self.exact_num_bottom_blobs:
            raise self.error(f"takes exactly {self.exact_num_bottom_blobs} bottom blob(s), got {nb}")
        if self.min_bottom_blobs >= 0 and nb < self.min_bottom_blobs:
            raise self.error(f"takes at least {self.min_bottom_blobs} bottom blob(s), got {nb}")
        if self.max_bottom_blobs >= 0 and nb > self.max_bottom_blobs:
            raise self.error(f"takes at most {self.max_bottom_blobs} bottom blob(s), got {nb}")
        if self.exact_num_top_blobs >= 0 and nt != self.exact_num_top_blobs:
            raise self.error(f"produces exactly {self.exact_num_top_blobs} top blob(s), got {nt}")
        if self.min_top_blobs >= 0 and nt < self.min_top_blobs:
            raise self.error(f"produces at least {self.min_top_blobs} top blob(s), got {nt}")
        if self.max_top_blobs >= 0 and nt > self.max_top_blobs:
            raise self.error(f"produces at most {self.max_top_blobs} top blob(s), got {nt}")
        if self.equal_num_bottom_top_blobs and nb != nt:
            raise self.error(f"needs as many top blobs as bottom blobs, got {nb} bottom and {nt} top")

    def set_loss_weights(self, top):
        weights = self.layer_param.loss_weight
        if len(weights) == 0:
            return
        if len(weights) != len(top):
            raise self.error(f"loss_weight must be given once per top blob "
                             f"({len(weights)} given, {len(top)} tops)")
        for i, w in enumerate(weights):
            self.set_loss(i, w)
            if w != 0:
                top[i].mutable_cpu_diff()[...] = w

    def loss(self, top_index):
        return self._loss[top_index] if top_index < len(self._loss) else 0.0

    def set_loss(self, top_index, value):
        while len(self._loss) <= top_index:
            self._loss.append(0.0)
        self._loss[top_index] = float(value)

    # -- a plain in-place ReLU folded into this layer (the Net's, CPU only) --------------
    # While ``relu_after`` is True (``with layer.relu_folded():`` around one forward or
    # backward call of a layer whose ``takes_relu()``, by the Net), the forward ends with
    # top = max(top, 0) and the backward starts with top.diff *= (top > 0): the ReLU's own
    # two passes, done inside this layer's kernels (their pool parts) and skipped by the
    # Net.  Same bits.
    relu_after = False

    def takes_relu(self):
        """Whether this layer's forward and backward honour ``relu_after``."""
        return False

    @contextlib.contextmanager
    def relu_folded(self):
        """``relu_after`` on for the calls inside the ``with`` block."""
        self.relu_after = True
        try:
            yield
        finally:
            self.relu_after = False

    # -- forward/backward -------------------------------------------------------
    def forward(self, bottom, top):
        self.forward_body(bottom, top)
        xp = context.xp()
        loss = 0.0
        for i, t in enumerate(top):
            if self.loss(i):
                loss += float((t.data_for(xp) * t.diff_for(xp)).sum())
        if xp is not np:
            self.check_deferred()
        return loss

    def forward_body(self, bottom, top):
        """Reshape and run this mode's forward body; no loss read back (the GPU step
        accumulates it on the device)."""
        try:
            self.reshape(bottom, top)
            if context.is_gpu():
                self.forward_gpu(bottom, top)
            else:
                self.forward_cpu(bottom, top)
        except MinicaffeError:
            raise
        except Exception as e:
            raise self.failure(e) from e

    # -- what the memory plan needs to know (engine/plan.py) ---------------------------------

    def state_bytes(self, bottom, top):
        """Device bytes this layer keeps from forward to backward beside its tops (a mask,
        a saved input); counted in the planned peak."""
        return 0

    def check_deferred(self):
        """Raise the errors a GPU body found on the device without stopping for them
        (a label out of range, say).  Called once the host has waited for the work."""

    def backward(self, top, propagate_down, bottom):
        try:
            if context.is_gpu():
                self.backward_gpu(top, propagate_down, bottom)
            else:
                self.backward_cpu(top, propagate_down, bottom)
        except MinicaffeError:
            raise
        except Exception as e:
            raise self.failure(e) from e

    def forward_xp(self, xp, bottom, top):
        raise NotImplementedError

    def backward_xp(self, xp, top, propagate_down, bottom):
        raise NotImplementedError

    def forward_cpu(self, bottom, top):
        if type(self).forward_xp is Layer.forward_xp:
            raise NotImplementedError(f"{type(self).__name__} has no forward body")
        self.forward_xp(np, bottom, top)

    def forward_gpu(self, bottom, top):
        if type(self).forward_xp is not Layer.forward_xp:
            self.forward_xp(backend.gpu_module(), bottom, top)
        else:
            self.forward_cpu(bottom, top)

    def backward_cpu(self, top, propagate_down, bottom):
        if type(self).backward_xp is Layer.backward_xp:
            return  # layers with nothing to propagate (data, accuracy...)
        self.backward_xp(np, top, propagate_down, bottom)

    def backward_gpu(self, top, propagate_down, bottom):
        if type(self).backward_xp is not Layer.backward_xp:
            self.backward_xp(backend.gpu_module(), top, propagate_down, bottom)
        else:
            self.backward_cpu(top, propagate_down, bottom)

    # -- flags -------------------------------------------------------------------
    def allow_force_backward(self, bottom_index):
        return True

    def set_param_propagate_down(self, index, value):
        while len(self.param_propagate_down) <= index:
            self.param_propagate_down.append(True)
        self.param_propagate_down[index] = bool(value)

    def get_param_propagate_down(self, index):
        return self.param_propagate_down[index] if index < len(self.param_propagate_down) else True

    @property
    def types(self):
        """core/precision.LayerTypes of this layer: the storage and math types in its
        LayerParameter (NVIDIA Caffe's ``forward_type``...; a Net that resolved reduced
        types writes them there, as NVIDIA Caffe's Net::Init does); None when unset (fp32).
        A layer with a reduced-type body reads it."""
        p = self.layer_param
        if not p.HasField("forward_type"):
            return None
        from ..core.precision import LayerTypes
        from ..proto import caffe_pb2
        name = caffe_pb2.Type.Name
        ft = name(p.forward_type)
        bt = name(p.backward_type) if p.HasField("backward_type") else ft
        return LayerTypes(p.name, p.type, ft, bt,
                          name(p.forward_math) if p.HasField("forward_math") else ft,
                          name(p.backward_math) if p.HasField("backward_math") else bt)

    def to_proto(self, write_diff=False):
        from ..proto import caffe_pb2
        p = caffe_pb2.LayerParameter()
        p.CopyFrom(self.layer_param)
        del p.blobs[:]
        for b in self.blobs:
            b.to_proto(p.blobs.add(), write_diff)
        return p

    def __repr__(self):
        return f"<{type(self).__name__} '{self.name}'>"


class NeuronLayer(Layer):
    """One bottom, one top of the same shape (may be computed in place)."""
    exact_num_bottom_blobs = 1
    exact_num_top_blobs = 1

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)


class LossLayer(Layer):
    """Predictions and targets in, a scalar loss out (weight 1 unless given)."""
    exact_num_bottom_blobs = 2
    exact_num_top_blobs = 1
    auto_top_blobs = True

    def setup(self, bottom, top):
        if len(self.layer_param.loss_weight) == 0:
            self.layer_param.loss_weight.append(1.0)
        super().setup(bottom, top)

    def reshape(self, bottom, top):
        if bottom[0].shape[0] != bottom[1].shape[0]:
            raise self.error(f"the data and label should have the same first dimension "
                             f"(got {bottom[0].shape} and {bottom[1].shape})")
        top[0].reshape(())

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1
