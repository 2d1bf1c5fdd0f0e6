"""Net: a graph of layers built from a NetParameter (Caffe's net.cpp).

Building a Net filters layers by the NetState (phase, level, stages), inserts
Split layers where one top feeds several bottoms (Caffe's names), creates and
sets up each layer, works out which layers and blobs need backward, and shares
parameters by ParamSpec name.  The Net never touches numpy or cupy itself: the
layers do, in this thread's mode.

The Python surface uses pycaffe's names: ``Net(file, phase, weights=...)``,
``blobs``/``params`` (ordered dicts), ``forward()`` returning the outputs,
``backward()``, ``reshape()``.
"""
import collections
import os

import numpy as np

from ..core import context, fileio, log, precision, protoio
from ..core.blob import Blob
from ..core.errors import ConfigError, MinicaffeError
from ..proto import caffe_pb2
from ..layers.registry import create_layer
from .upgrade import upgrade_net_as_needed

TRAIN = caffe_pb2.TRAIN
TEST = caffe_pb2.TEST


# -- reading definitions -------------------------------------------------------------
def read_net_param(source):
    """A NetParameter from a path (prototxt, YAML or binary), text, bytes or a message."""
    if isinstance(source, caffe_pb2.NetParameter):
        p = caffe_pb2.NetParameter()
        p.CopyFrom(source)
        upgrade_net_as_needed(p)
        return p
    p = caffe_pb2.NetParameter()
    if isinstance(source, bytes):
        p.ParseFromString(source)
    elif isinstance(source, (str, os.PathLike)) and (os.path.exists(source) or
                                                     not ("{" in str(source) or ":" in str(source))):
        protoio.read_any(source, p)
    else:
        protoio.parse_text(str(source), p)
    upgrade_net_as_needed(p, str(source) if not isinstance(source, bytes) else "<bytes>")
    return p


def read_weights(path):
    """A NetParameter of trained weights from a binary .caffemodel (upgraded as needed)."""
    p = caffe_pb2.NetParameter()
    protoio.read_binary(path, p)
    upgrade_net_as_needed(p, str(path))
    return p


# -- NetState filtering -----------------------------------------------------------------
def state_meets_rule(state, rule, layer_name=""):
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    for s in rule.stage:
        if s not in state.stage:
            return False
    for s in rule.not_stage:
        if s in state.stage:
            return False
    return True


def filter_net(param):
    """A copy of ``param`` holding only the layers its state includes."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for lp in param.layer:
        if len(lp.include) and len(lp.exclude):
            raise ConfigError(f"layer '{lp.name}': specify either include rules or exclude rules; not both")
        included = len(lp.include) == 0
        for rule in lp.exclude:
            if state_meets_rule(param.state, rule, lp.name):
                included = False
        for rule in lp.include:
            if state_meets_rule(param.state, rule, lp.name):
                included = True
        if included:
            out.layer.add().CopyFrom(lp)
    return out


# -- Split insertion ----------------------------------------------------------------------
def split_layer_name(layer_name, blob_name, blob_idx):
    return f"{blob_name}_{layer_name}_{blob_idx}_split"


def split_blob_name(layer_name, blob_name, blob_idx, split_idx):
    return f"{blob_name}_{layer_name}_{blob_idx}_split_{split_idx}"


def insert_splits(param):
    """Caffe's InsertSplits: a Split layer wherever a top feeds more than one consumer
    (a loss weight on a top counts as a consumer)."""
    last_top = {}
    source_of_bottom = {}
    bottom_count = collections.Counter()
    loss_weight = {}
    for i, lp in enumerate(param.layer):
        for j, name in enumerate(lp.bottom):
            if name not in last_top:
                raise ConfigError(f"layer '{lp.name}': unknown bottom blob '{name}' "
                                  f"(bottom index {j}; no earlier layer produces it)")
            source_of_bottom[(i, j)] = last_top[name]
            bottom_count[last_top[name]] += 1
        for j, name in enumerate(lp.top):
            last_top[name] = (i, j)
        for j in range(min(len(lp.loss_weight), len(lp.top))):
            idx = last_top[lp.top[j]]
            loss_weight[idx] = lp.loss_weight[j]
            if loss_weight[idx]:
                bottom_count[idx] += 1
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    split_idx = collections.Counter()
    for i, lp in enumerate(param.layer):
        nl = out.layer.add()
        nl.CopyFrom(lp)
        for j, name in enumerate(lp.bottom):
            src = source_of_bottom[(i, j)]
            if bottom_count[src] > 1:
                src_layer = param.layer[src[0]].name
                nl.bottom[j] = split_blob_name(src_layer, name, src[1], split_idx[src])
                split_idx[src] += 1
        for j, name in enumerate(lp.top):
            idx = (i, j)
            n = bottom_count[idx]
            if n > 1:
                lw = loss_weight.get(idx, 0.0)
                sp = out.layer.add()
                sp.name = split_layer_name(lp.name, name, j)
                sp.type = "Split"
                sp.bottom.append(name)
                for k in range(n):
                    sp.top.append(split_blob_name(lp.name, name, j, k))
                    if lw:
                        sp.loss_weight.append(lw if k == 0 else 0.0)
                if lw:
                    del nl.loss_weight[:]
                    split_idx[idx] += 1
    return out


def tops_rewritten(layer_params):
    """For each LayerParameter of a net (after the splits): whether a later layer rewrites
    one of its tops in place (a top named as the bottom of the same index is that blob;
    a name is produced once).  ``Net.top_rewritten`` keeps it; the registry reads it (a
    cuDNN backward that reads its top would read the later value)."""
    out, rewritten = [], set()
    for lp in reversed(list(layer_params)):
        out.append(any(t in rewritten for t in lp.top))
        rewritten.update(t for j, t in enumerate(lp.top)
                         if j < len(lp.bottom) and lp.bottom[j] == t)
    return out[::-1]


def _batchnorm_out_of_place(param):
    """Training: a BatchNorm that runs in place on the output of the layer just before it
    reads that output from a blob of its own instead (``<bn layer>_input``): its backward
    (Caffe's and cuDNN's) needs BatchNorm's input, which in place would have to be copied
    aside every iteration (and, for cuDNN, its gradient copied back).  The memory is the
    same (that copy is what the new blob holds); the copies go.  Every other blob keeps its
    name and, after a forward, its value.  Done on every device and engine, so that a
    net's blob names are the same on the CPU and the GPU."""
    if param.state.phase != TRAIN:
        return param
    out = None
    for i, lp in enumerate(param.layer):
        if (lp.type != "BatchNorm" or i == 0 or len(lp.bottom) != 1 or lp.top[:] != lp.bottom[:]
                or (lp.batch_norm_param.HasField("use_global_stats")
                    and lp.batch_norm_param.use_global_stats)):
            continue
        prev = param.layer[i - 1]
        name = lp.bottom[0]
        if list(prev.top) != [name] or name in prev.bottom:
            continue   # the producer must be the layer before, and not in place itself
        if out is None:
            out = caffe_pb2.NetParameter()
            out.CopyFrom(param)
        new = f"{lp.name}_input"
        del out.layer[i - 1].top[:]
        out.layer[i - 1].top.append(new)
        out.layer[i].bottom[0] = new
    return param if out is None else out


class Net:
    """A network of layers.  ``Net(network_file, phase, level=0, stages=None, weights=None)``
    or the legacy ``Net(network_file, weights, phase)``; ``network_file`` may also be a
    NetParameter or prototxt text.  ``config``: the run's ``config.RunConfig`` (a solver
    passes its own; by default the environment's), handed to every layer."""

    def __init__(self, network, phase=None, weights=None, level=0, stages=None, *legacy,
                 config=None):
        if isinstance(phase, (str, os.PathLike)) and not isinstance(weights, (str, os.PathLike)):
            # legacy pycaffe signature Net(file, weights, phase)
            phase, weights = weights, phase
        if legacy:
            raise TypeError("Net() takes (network, phase, weights=None, level=0, stages=None)")
        if config is None:
            from ..core.config import RunConfig
            config = RunConfig.from_environment()
        self.config = config
        param = read_net_param(network)
        self._source = str(network) if isinstance(network, (str, os.PathLike)) else "<net>"
        if phase is not None:
            param.state.phase = phase
            param.state.level = level
            del param.state.stage[:]
            param.state.stage.extend(stages or [])
        elif stages:
            param.state.stage.extend(stages)
        self._init(param)
        if weights:
            self.copy_from(weights)

    # -- construction ------------------------------------------------------------
    def _init(self, in_param):
        from ..core.config import offload_settings
        self.phase = in_param.state.phase
        policy, budget = offload_settings(in_param, self.config)
        # each layer sees its net's offload settings (``RunConfig.offloads``: an offloading
        # net's cuDNN Find may not take more scratch than its plan allows)
        layer_config = self.config.replace(offload_policy=policy, offload_budget=budget)
        filtered = filter_net(in_param)
        log.info("Initializing net from parameters: \n%s", _short_text(filtered))
        param = insert_splits(_batchnorm_out_of_place(filtered))
        self.net_param = param
        # the storage type of every blob (core/precision.py: NVIDIA Caffe's type fields
        # under the run's --precision); reduced types are kept by rounding (hooks below)
        self.types = precision.resolve(param, self.config.precision)
        if self.types.reduced:
            log.info("Precision: %s", self.types.describe())
        self.name = param.name
        self.layers = []
        self.layer_names = []
        self._blobs = []
        self.blob_names = []
        self._blob_need_backward = []
        self.bottom_vecs, self.bottom_id_vecs, self.bottom_need_backward = [], [], []
        self.top_vecs, self.top_id_vecs = [], []
        self.param_id_vecs = []
        self.params_ = []  # every param blob, shared ones included
        self.param_owners = []
        self.param_display_names = []
        self.param_layer_indices = []
        self.param_names_index = {}
        self.learnable_params = []
        self.learnable_param_ids = []
        self.params_lr = []
        self.params_weight_decay = []
        self.has_params_lr = []
        self.has_params_decay = []
        self._blob_loss_weights = []
        self.layer_need_backward = []
        self.input_blob_indices = []
        self.output_blob_indices = []
        self.debug_info = param.debug_info
        self._before_forward, self._after_forward = [], []
        self._before_backward, self._after_backward = [], []
        available = []  # insertion-ordered set of blobs not yet consumed
        name_to_idx = {}
        memory_used = 0
        # the Net's table of what its wiring tells the engine choice (registry.choose_class)
        self.top_rewritten = tops_rewritten(param.layer)
        for layer_id, lp in enumerate(param.layer):
            if not lp.HasField("phase"):
                lp.phase = self.phase
            if len(lp.propagate_down) and len(lp.propagate_down) != len(lp.bottom):
                raise ConfigError(f"layer '{lp.name}': propagate_down param must be specified "
                                  f"either 0 or bottom_size times ({len(lp.bottom)})")
            if self.types.reduced:     # its resolved types, NVIDIA Caffe's way: into its
                lt = self.types.layers[layer_id]    # own LayerParameter (Layer.types)
                for f in ("forward_type", "backward_type", "forward_math", "backward_math"):
                    setattr(lp, f, caffe_pb2.Type.Value(getattr(lt, f)))
            layer = create_layer(lp, self.top_rewritten[layer_id])
            layer.config = layer_config
            self.layers.append(layer)
            self.layer_names.append(lp.name)
            log.info("Creating Layer %s", lp.name)
            need_backward = False
            self.bottom_vecs.append([])
            self.bottom_id_vecs.append([])
            self.bottom_need_backward.append([])
            self.top_vecs.append([])
            self.top_id_vecs.append([])
            self.param_id_vecs.append([])
            for bottom_id, bname in enumerate(lp.bottom):
                if bname not in available:
                    raise ConfigError(f"layer '{lp.name}': unknown bottom blob '{bname}' "
                                      f"(bottom index {bottom_id})")
                blob_id = name_to_idx[bname]
                log.info("%s <- %s", lp.name, bname)
                self.bottom_vecs[-1].append(self._blobs[blob_id])
                self.bottom_id_vecs[-1].append(blob_id)
                available.remove(bname)
                nb = self._blob_need_backward[blob_id]
                if len(lp.propagate_down):
                    nb = bool(lp.propagate_down[bottom_id])
                self.bottom_need_backward[-1].append(nb)
                need_backward |= nb
            for top_id, tname in enumerate(lp.top):
                self._append_top(lp, layer_id, top_id, tname, available, name_to_idx)
                if lp.type == "Input":
                    self.input_blob_indices.append(self.top_id_vecs[-1][-1])
            if layer.auto_top_blobs:
                needed = max(layer.min_top_blobs, layer.exact_num_top_blobs)
                for top_id in range(len(lp.top), needed):
                    self._append_top(lp, layer_id, top_id, "(automatic)", None, None)
            layer.setup(self.bottom_vecs[-1], self.top_vecs[-1])
            log.info("Setting up %s", lp.name)
            for top_id, blob_id in enumerate(self.top_id_vecs[-1]):
                while len(self._blob_loss_weights) <= blob_id:
                    self._blob_loss_weights.append(0.0)
                self._blob_loss_weights[blob_id] = layer.loss(top_id)
                top = self._blobs[blob_id]
                log.info("Top shape: %s", top.shape_string())
                if layer.loss(top_id):
                    log.info("    with loss weight %g", layer.loss(top_id))
                memory_used += top.count()
            log.info("Memory required for data: %d", memory_used * 4)
            if not lp.bottom:  # a data layer: an empty batch is a mistake in its parameters
                for blob_id in self.top_id_vecs[-1]:
                    if 0 in self._blobs[blob_id].shape:
                        raise layer.error(f"top '{self.blob_names[blob_id]}' has shape "
                                          f"{self._blobs[blob_id].shape}: a zero dimension")
            n_specs, n_blobs = len(lp.param), len(layer.blobs)
            if n_specs > n_blobs:
                raise ConfigError(f"layer '{lp.name}': too many params specified "
                                  f"({n_specs} param specs, the layer has {n_blobs} blobs)")
            default_spec = caffe_pb2.ParamSpec()
            for param_id in range(n_blobs):
                spec = lp.param[param_id] if param_id < n_specs else default_spec
                pnb = spec.lr_mult != 0
                need_backward |= pnb
                layer.set_param_propagate_down(param_id, pnb)
            for param_id in range(n_blobs):
                self._append_param(layer_id, param_id)
            self.layer_need_backward.append(need_backward)
            if need_backward:
                for blob_id in self.top_id_vecs[-1]:
                    self._blob_need_backward[blob_id] = True
        self._analyse_backward(param)
        self._find_fusions()
        self.output_blob_indices = [name_to_idx[n] for n in sorted(available)]
        for i in self.output_blob_indices:
            log.info("This network produces output %s", self.blob_names[i])
        self.blob_names_index = {n: i for i, n in enumerate(self.blob_names)}
        self._check_unique_names()
        self.layer_names_index = {n: i for i, n in enumerate(self.layer_names)}
        self.share_weights()
        self._share_workspace()
        self._round_to_storage()
        log.info("Network initialization done.")

    def _share_workspace(self, config=None):
        """One cuDNN workspace size for this net's convolutions (they share a buffer):
        ``layers/cudnn_layers.share_workspace``; ``config``: a RunConfig to price it by
        (``minicaffe memory --offload``), else the net's own."""
        if any(getattr(l, "candidates", None) for l in self.layers):
            from ..core.config import offload_settings
            from ..layers import cudnn_layers
            policy, budget = offload_settings(self.net_param, config or self.config)
            price = (cudnn_layers.OFFLOAD_PRICE_PER_GIB if policy != "NONE" or budget else
                     cudnn_layers.PRICE_PER_GIB)
            cap = cudnn_layers.share_workspace(self.layers, price)
            if cap != getattr(self, "_workspace_cap", None):
                log.info("cuDNN workspace for %s: %.1f MiB", self.name, cap / 2 ** 20)
            self._workspace_cap = cap

    def _round_to_storage(self):
        """Where a blob is stored in a reduced type (``self.types``), round what a layer
        writes to that type's values: its tops' data after its forward, its bottoms' diffs
        after its backward (core/precision.round_to), the first of the Net's hooks.  The
        arithmetic stays fp32; the values are the reduced storage's, on every device."""
        from ..kernels.precision import round_storage
        t = self.types
        if not t.reduced:
            return
        FLOAT = precision.FLOAT
        # per layer, (blob id, storage type) of the tops whose data its forward hook
        # rounds and of the bottoms whose diff its backward hook rounds; ``rounding`` keeps
        # their names (the precision pass prints them as cast ops)
        tops, bottoms = [], []
        for i, lp in enumerate(self.net_param.layer):
            names = [self.blob_names[b] for b in self.bottom_id_vecs[i]]
            ins = {t.data.get(n, FLOAT) for n in names}
            outs = {t.diff.get(self.blob_names[b], FLOAT) for b in self.top_id_vecs[i]}
            # a layer that writes only values it read, from inputs of the output's type,
            # needs no rounding (ReLU, MAX pooling, the data movers)
            tops.append([(b, s) for b, s in ((b, t.data.get(self.blob_names[b], FLOAT))
                                              for b in self.top_id_vecs[i])
                         if s != FLOAT and not (precision.preserves(lp) and names and
                                                ins == {s})])
            bottoms.append([(b, s) for j, (b, s) in enumerate(
                (b, t.diff.get(n, FLOAT)) for b, n in zip(self.bottom_id_vecs[i], names))
                if self.bottom_need_backward[i][j] and s != FLOAT and
                not (precision.preserves(lp, backward=True) and outs == {s})])
        self.rounding = ([[(self.blob_names[b], s) for b, s in x] for x in tops],
                         [[(self.blob_names[b], s) for b, s in x] for x in bottoms])
        tops = [[(self._blobs[b], s) for b, s in x] for x in tops]
        bottoms = [[(self._blobs[b], s) for b, s in x] for x in bottoms]

        def after_forward(i):
            # a layer whose reduced-type body rounds what it writes (a cuDNN convolution
            # in float16/bfloat16) says so (``rounds_outputs``); the first layer of a pair
            # that ran fused (BatchNorm+Scale...) stores nothing: its pair's output is
            f, role = self.fusion_of(i)
            if f is not None and f.index in self._fused_pass and role < f.size - 1:
                return
            if tops[i] and not getattr(self.layers[i], "rounds_outputs", False):
                xp = context.xp()
                for blob, storage in tops[i]:
                    # (a buffer held in 2-byte words, or pointed at a 16-bit scratch by
                    # a cast op, needs none: engine/precision.py)
                    if getattr(blob.data_mem, "reduced", None) is None and \
                            getattr(blob.data_mem, "storage", None) is None:
                        round_storage(xp, blob.mutable_data_for(xp), storage)

        def after_backward(i):
            f, role = self.fusion_of(i)
            if role and f.fuses_backward and f.index in self._fused_pass:
                return      # computed inside its pair's backward: nothing stored between
            if bottoms[i] and self.layer_need_backward[i] and \
                    not getattr(self.layers[i], "rounds_outputs", False):
                xp = context.xp()
                for blob, storage in bottoms[i]:
                    if getattr(blob.diff_mem, "reduced", None) is None and \
                            getattr(blob.diff_mem, "storage", None) is None:
                        round_storage(xp, blob.mutable_diff_for(xp), storage)

        self.add_hook("after_forward", after_forward)
        self.add_hook("after_backward", after_backward)

    def _check_unique_names(self):
        """Weights are matched to layers by name, so two layers of one name where either has
        parameters would take each other's weights: an error.  (Caffe's own
        mnist_autoencoder.prototxt names two parameterless loss layers alike: allowed.)"""
        first = {}
        for i, (name, layer) in enumerate(zip(self.layer_names, self.layers)):
            j = first.setdefault(name, i)
            if j != i and (layer.blobs or self.layers[j].blobs):
                raise ConfigError(f"layer '{name}' is defined twice in net '{self.name}' "
                                  f"(layers #{j} and #{i}); a layer with parameters needs a "
                                  "name of its own (weights are matched to layers by name)")

    def _append_top(self, lp, layer_id, top_id, name, available, name_to_idx):
        if name_to_idx is not None and top_id < len(lp.bottom) and name == lp.bottom[top_id]:
            log.info("%s -> %s (in-place)", lp.name, name)
            blob_id = name_to_idx[name]
        elif name_to_idx is not None and name in name_to_idx:
            raise ConfigError(f"layer '{lp.name}': top blob '{name}' produced by multiple sources")
        else:
            log.info("%s -> %s", lp.name, name)
            blob_id = len(self._blobs)
            self._blobs.append(Blob())
            self.blob_names.append(name)
            self._blob_need_backward.append(False)
            if name_to_idx is not None:
                name_to_idx[name] = blob_id
        self.top_vecs[layer_id].append(self._blobs[blob_id])
        self.top_id_vecs[layer_id].append(blob_id)
        if available is not None and name not in available:
            available.append(name)

    def _append_param(self, layer_id, param_id):
        lp = self.layers[layer_id].layer_param
        spec = lp.param[param_id] if param_id < len(lp.param) else caffe_pb2.ParamSpec()
        pname = spec.name
        self.param_display_names.append(pname if pname else str(param_id))
        net_param_id = len(self.params_)
        blob = self.layers[layer_id].blobs[param_id]
        self.params_.append(blob)
        self.param_id_vecs[layer_id].append(net_param_id)
        self.param_layer_indices.append((layer_id, param_id))
        if not pname or pname not in self.param_names_index:
            self.param_owners.append(-1)
            if pname:
                self.param_names_index[pname] = net_param_id
            self.learnable_param_ids.append(len(self.learnable_params))
            self.learnable_params.append(blob)
            self.has_params_lr.append(spec.HasField("lr_mult"))
            self.has_params_decay.append(spec.HasField("decay_mult"))
            self.params_lr.append(spec.lr_mult)
            self.params_weight_decay.append(spec.decay_mult)
            return
        owner_id = self.param_names_index[pname]
        self.param_owners.append(owner_id)
        owner_layer, owner_param = self.param_layer_indices[owner_id]
        log.info("Sharing parameters '%s' owned by layer '%s', param index %d",
                 pname, self.layer_names[owner_layer], owner_param)
        owner_blob = self.layers[owner_layer].blobs[owner_param]
        if spec.share_mode == caffe_pb2.ParamSpec.PERMISSIVE:
            if blob.count() != owner_blob.count():
                raise ConfigError(f"layer '{lp.name}': cannot share param '{pname}' owned by layer "
                                  f"'{self.layer_names[owner_layer]}'; count mismatch. Owner layer "
                                  f"param shape is {owner_blob.shape_string()}; sharing layer shape "
                                  f"is {blob.shape_string()}")
        elif blob.shape != owner_blob.shape:
            raise ConfigError(f"layer '{lp.name}': cannot share param '{pname}' owned by layer "
                              f"'{self.layer_names[owner_layer]}'; shape mismatch. Owner layer param "
                              f"shape is {owner_blob.shape_string()}; sharing layer expects shape "
                              f"{blob.shape_string()}")
        lid = self.learnable_param_ids[owner_id]
        self.learnable_param_ids.append(lid)
        if spec.HasField("lr_mult"):
            if self.has_params_lr[lid] and spec.lr_mult != self.params_lr[lid]:
                raise ConfigError(f"layer '{lp.name}': shared param '{pname}' has mismatched lr_mult")
            self.has_params_lr[lid] = True
            self.params_lr[lid] = spec.lr_mult
        if spec.HasField("decay_mult"):
            if self.has_params_decay[lid] and spec.decay_mult != self.params_weight_decay[lid]:
                raise ConfigError(f"layer '{lp.name}': shared param '{pname}' has mismatched decay_mult")
            self.has_params_decay[lid] = True
            self.params_weight_decay[lid] = spec.decay_mult

    def _find_fusions(self):
        """The fused layer types of this net (layers/fused.py): pairs of adjacent layers the
        GPU engine computes as one, each logged once here.  The layers stay in the net."""
        from ..layers.fused import BatchNormScale, find_fusions
        layers = self.layers

        def per_channel(i):
            return len(layers[i].blobs) >= 1 and layers[i].per_channel(self.bottom_vecs[i])

        self.fusions = []
        for i, kind in find_fusions(self.net_param.layer, lambda i: layers[i].engine_name,
                                    lambda i: layers[i].use_global_stats, per_channel):
            if issubclass(kind, BatchNormScale) and self.layer_need_backward[i + 1] and not (
                    self.layer_need_backward[i] and self.bottom_need_backward[i][0]):
                continue    # the Scale's gradients come from a BatchNorm backward that runs
            pair = kind(i, *layers[i:i + kind.size])
            self.fusions.append(pair)
            log.info("Fused layer type %s: %s and %s", pair.type, ", ".join(pair.names[:-1]),
                     pair.names[-1])
        self._fusion_at = {f.index: f for f in self.fusions}
        self._fused_pass = set()
        self._relu_heads = None      # CPU: {layer i: its ReLU i + 1} (``_cpu_relus``)
        self._relu_pass = {}         # CPU: those of this forward pass (by head)
        self._relu_ran = set()       # CPU: ReLUs whose forward ran inside their head's
        self._relu_pending = None    # CPU: a ReLU whose backward waits for its head's

    def _cpu_relus(self):
        """CPU: {i: i + 1} where layer i takes a plain in-place ReLU on its only top into
        its own numpy kernels (``Layer.takes_relu``: Convolution, MAX Pooling): the
        ReLU's forward at the end of each of layer i's pool parts, its backward at the
        start, one pool call and one pass over the map fewer each (same bits as the two
        layers apart).  Not with debug_info (it prints each layer's output) nor with
        reduced storage (a rounding hook between the two)."""
        if self._relu_heads is None:
            from ..layers.fused import _relu_in_place
            heads = {}
            params = self.net_param.layer
            if not self.types.reduced:
                for i in range(len(self.layers) - 1):
                    a, b = params[i], params[i + 1]
                    if (len(a.top) == 1 and len(a.bottom) == 1 and a.top[0] not in a.bottom
                            and not any(a.loss_weight) and not any(b.loss_weight)
                            and _relu_in_place(b, a.top[0]) and self.layers[i].takes_relu()
                            and self.top_vecs[i][0].dtype in (np.float32, np.float64)):
                        heads[i] = i + 1
            self._relu_heads = heads
        return self._relu_heads

    def _flush_relu(self):
        """The backward of a ReLU that waited for its head's and did not get it."""
        j, self._relu_pending = self._relu_pending, None
        if j is not None:
            self._backward_layer(j)

    def fusion_of(self, i):
        """(the fused group layer ``i`` belongs to, its place in it: 0 for the first layer,
        1 for the second...), or (None, None)."""
        for role in range(3):
            f = self._fusion_at.get(i - role)
            if f is not None:
                return (f, role) if role < f.size else (None, None)
        return None, None

    def _begin_forward(self, start, end):
        """The pairs a forward over layers [start, end] may fuse (GPU only, both layers in
        the pass), by first index; which did is recorded for the backward."""
        self._fused_pass = set()
        self._flush_relu()
        self._relu_ran = set()
        self._relu_pass = {}
        if not context.is_gpu() and not self.debug_info:
            self._relu_pass = {i: j for i, j in self._cpu_relus().items()
                               if start <= i and j <= end}
        if not self.fusions or not context.is_gpu():
            return {}
        return {i: f for i, f in self._fusion_at.items()
                if start <= i and i + f.size - 1 <= end}

    def _forward_layer(self, i, fused, body_only=False):
        """Layer i's forward, or its fused pair's; the weighted loss (0 for ``body_only``)."""
        layer, bottom, top = self.layers[i], self.bottom_vecs[i], self.top_vecs[i]
        f, role = self.fusion_of(i)
        if role and f.index in self._fused_pass:
            layer.reshape(bottom, top)      # its body ran in its pair's fused call
            return 0.0
        if self._relu_pass:
            if i in self._relu_ran:
                layer.reshape(bottom, top)  # its forward ran in layer i - 1's kernels
                return 0.0
            if i in self._relu_pass:
                with layer.relu_folded():
                    loss = layer.forward_body(bottom, top) if body_only else \
                        layer.forward(bottom, top)
                self._relu_ran.add(i + 1)
                return 0.0 if body_only else loss
        pair = fused.get(i)
        if pair is not None:
            if pair.forward_body(bottom, top) if body_only else pair.forward(bottom, top):
                self._fused_pass.add(i)
            return 0.0
        if body_only:
            layer.forward_body(bottom, top)
            return 0.0
        return layer.forward(bottom, top)

    def _backward_layer(self, i):
        f, role = self.fusion_of(i)
        if f is not None and f.index in self._fused_pass:
            if role and f.fuses_backward:
                return                      # part of its pair's fused backward
            if role == 0:
                f.backward(self.top_vecs[i], self.bottom_need_backward[i], self.bottom_vecs[i])
                return
        self.layers[i].backward(self.top_vecs[i], self.bottom_need_backward[i],
                                self.bottom_vecs[i])

    def _analyse_backward(self, param):
        under_loss, skip_backp = set(), set()
        for layer_id in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[layer_id]
            contributes, skip_pd = False, True
            for top_id, blob_id in enumerate(self.top_id_vecs[layer_id]):
                name = self.blob_names[blob_id]
                if layer.loss(top_id) or name in under_loss:
                    contributes = True
                if name not in skip_backp:
                    skip_pd = False
                if contributes and not skip_pd:
                    break
            if self.layer_need_backward[layer_id] and skip_pd:
                self.layer_need_backward[layer_id] = False
                self.bottom_need_backward[layer_id] = [False] * len(self.bottom_need_backward[layer_id])
            if not contributes:
                self.layer_need_backward[layer_id] = False
            log.info("%s %s backward computation.", self.layer_names[layer_id],
                     "needs" if self.layer_need_backward[layer_id] else "does not need")
            for bottom_id, blob_id in enumerate(self.bottom_id_vecs[layer_id]):
                name = self.blob_names[blob_id]
                if contributes:
                    under_loss.add(name)
                else:
                    self.bottom_need_backward[layer_id][bottom_id] = False
                if not self.bottom_need_backward[layer_id][bottom_id]:
                    skip_backp.add(name)
        if param.force_backward:
            for layer_id, layer in enumerate(self.layers):
                self.layer_need_backward[layer_id] = True
                for bottom_id, blob_id in enumerate(self.bottom_id_vecs[layer_id]):
                    nb = self.bottom_need_backward[layer_id][bottom_id] or \
                        layer.allow_force_backward(bottom_id)
                    self.bottom_need_backward[layer_id][bottom_id] = nb
                    self._blob_need_backward[blob_id] = self._blob_need_backward[blob_id] or nb
                for param_id in range(len(layer.blobs)):
                    layer.set_param_propagate_down(param_id, True)

    def flat_params(self):
        """The learnable parameters' data and diffs as one flat buffer each
        (:class:`~minicaffe.core.flat_params.FlatBuffer`, in ``learnable_params`` order), made on
        first use and again if a reshape detached a parameter; shared parameters follow
        their owners."""
        from ..core.flat_params import FlatBuffer
        fb = getattr(self, "_flat_params", None)
        if fb is None or not fb.intact():
            fb = self._flat_params = FlatBuffer(self.learnable_params)
            self.share_weights()
        return fb

    def share_weights(self):
        for i, owner in enumerate(self.param_owners):
            if owner >= 0:
                self.params_[i].share_data(self.params_[owner])
                self.params_[i].share_diff(self.params_[owner])

    # -- running ---------------------------------------------------------------------
    def forward_from_to(self, start=0, end=None):
        if end is None:
            end = len(self.layers) - 1
        fused = self._begin_forward(start, end)
        loss = 0.0
        for i in range(start, end + 1):
            loss += self.forward_layer(i, fused)
        return loss

    def begin_pass(self):
        """Start a forward over every layer run layer by layer (``forward_layer``, the
        engine's eager executor); returns the fused pairs it may run."""
        return self._begin_forward(0, len(self.layers) - 1)

    def forward_layer(self, i, fused):
        """Layer i's forward (or its fused pair's, ``fused``: what ``begin_pass`` gave)
        with the Net's hooks and debug info around it; its weighted loss."""
        for cb in self._before_forward:
            cb(i)
        loss = self._forward_layer(i, fused)
        if self.debug_info:
            self._forward_debug_info(i)
        for cb in self._after_forward:
            cb(i)
        return loss

    def backward_layer(self, i):
        """Layer i's backward where it needs one (or its part of its fused pair's), with
        the Net's hooks and debug info around it (the hooks run for every layer)."""
        for cb in self._before_backward:
            cb(i)
        if self._relu_pending is not None and self._relu_pending != i + 1:
            self._flush_relu()
        if self.layer_need_backward[i]:
            if (i in self._relu_ran and self.layer_need_backward[i - 1]
                    and self.bottom_need_backward[i][0]):
                self._relu_pending = i      # run by layer i - 1's backward (next)
            elif self._relu_pending == i + 1:
                self._relu_pending = None
                with self.layers[i].relu_folded():
                    self._backward_layer(i)
            else:
                self._backward_layer(i)
            if self.debug_info:
                self._backward_debug_info(i)
        for cb in self._after_backward:
            cb(i)

    def forward_again(self, i):
        """Layer i's forward body once more, as this pass ran it (a fused pair's fused
        body from its first layer; nothing for its second), without hooks or debug info:
        offload's recompute of a dropped feature map during the backward
        (engine/offload.py ``choose_recompute``).  The same kernels on the same inputs
        write the same values."""
        f, role = self.fusion_of(i)
        if f is not None and f.index in self._fused_pass:
            if role:
                return                      # its pair's fused body made it
            f.forward_body(self.bottom_vecs[i], self.top_vecs[i])
            return
        self.layers[i].forward_body(self.bottom_vecs[i], self.top_vecs[i])

    def end_pass(self):
        """After a backward over every layer: the debug info's norms (as
        ``forward_backward``)."""
        self._flush_relu()
        if self.debug_info:
            self._update_norms_log()

    def forward_device(self, start, end=None, ring_addr=0, counter=None, ring=1):
        """GPU: run layers [start, end] without reading anything back; each loss top adds
        sum(data * loss weight) into ``ring[counter % ring]`` (a float64 ring in mapped
        host memory at ``ring_addr``) on the device (engine/step.py)."""
        if end is None:
            end = len(self.layers) - 1
        fused = self._begin_forward(start, end)
        for i in range(start, end + 1):
            self.forward_layer_device(i, fused, ring_addr, counter, ring)

    def forward_layer_device(self, i, fused, ring_addr=0, counter=None, ring=1):
        """GPU: layer i's forward (or its fused pair's) with the hooks around it, nothing
        read back; its loss tops add into the ring (see ``forward_device``)."""
        from ..kernels.step import loss_accumulate
        for cb in self._before_forward:
            cb(i)
        layer = self.layers[i]
        self._forward_layer(i, fused, body_only=True)
        if ring_addr:
            for j, t in enumerate(self.top_vecs[i]):
                if layer.loss(j):
                    loss_accumulate(t.gpu_data(), t.gpu_diff(), ring_addr, counter, ring)
        for cb in self._after_forward:
            cb(i)

    def forward_prefilled(self):
        """Run every layer; return the total weighted loss (Caffe's ``Forward(&loss)``)."""
        return self.forward_from_to(0, len(self.layers) - 1)

    def backward_from_to(self, start=None, end=0):
        if start is None:
            start = len(self.layers) - 1
        for i in range(start, end - 1, -1):
            self.backward_layer(i)
        self._flush_relu()

    def forward_backward(self):
        loss = self.forward_prefilled()
        self.backward_from_to()
        if self.debug_info:
            self._update_norms_log()
        return loss

    def update(self):
        for b in self.learnable_params:
            b.update()

    def clear_param_diffs(self):
        xp = context.xp()
        fb = getattr(self, "_flat_params", None)
        if fb is not None and fb.intact():
            (fb.diff.mutable_gpu_data() if xp is not np else fb.diff.mutable_cpu_data()).fill(0)
            return
        for b in self.learnable_params:
            b.mutable_diff_for(xp)[...] = 0

    def reshape(self):
        for i, layer in enumerate(self.layers):
            layer.reshape(self.bottom_vecs[i], self.top_vecs[i])
        self._share_workspace()

    def close(self):
        """Stop the layers' background work (data prefetch threads) now, rather than when
        the Net is garbage-collected."""
        for layer in self.layers:
            close = getattr(layer, "close", None)
            if callable(close):
                close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- pycaffe surface -----------------------------------------------------------------
    @property
    def blobs(self):
        return collections.OrderedDict(zip(self.blob_names, self._blobs))

    @property
    def params(self):
        return collections.OrderedDict((name, layer.blobs) for name, layer in
                                       zip(self.layer_names, self.layers) if layer.blobs)

    @property
    def blob_loss_weights(self):
        """pycaffe's OrderedDict {blob name: loss weight}; ``[i]`` with an int still gives
        the weight of blob i (Caffe's ``blob_loss_weights()[i]``)."""
        return _NameOrIndexDict(zip(self.blob_names, self._blob_loss_weights))

    @property
    def layer_dict(self):
        return collections.OrderedDict(zip(self.layer_names, self.layers))

    @property
    def inputs(self):
        return [self.blob_names[i] for i in self.input_blob_indices]

    @property
    def outputs(self):
        return [self.blob_names[i] for i in self.output_blob_indices]

    @property
    def output_blobs(self):
        return [self._blobs[i] for i in self.output_blob_indices]

    @property
    def input_blobs(self):
        return [self._blobs[i] for i in self.input_blob_indices]

    def blob_by_name(self, name):
        if name not in self.blob_names_index:
            raise KeyError(f"unknown blob name '{name}'")
        return self._blobs[self.blob_names_index[name]]

    def layer_by_name(self, name):
        if name not in self.layer_names_index:
            raise KeyError(f"unknown layer name '{name}'")
        return self.layers[self.layer_names_index[name]]

    def has_blob(self, name):
        return name in self.blob_names_index

    def has_layer(self, name):
        return name in self.layer_names_index

    def forward(self, blobs=None, start=None, end=None, **kwargs):
        """pycaffe's forward: set inputs from ``kwargs``, run [start, end], and return
        {output name: data} (plus any ``blobs`` asked for)."""
        start_ind = self.layer_names_index[start] if start is not None else 0
        if end is not None:
            end_ind = self.layer_names_index[end]
            outputs = set(self.top_names_of(end) + list(blobs or []))
        else:
            end_ind = len(self.layers) - 1
            outputs = set(self.outputs + list(blobs or []))
        for name, value in kwargs.items():
            if name not in self.inputs:
                raise KeyError(f"'{name}' is not an input of this net (inputs: {self.inputs})")
            b = self.blob_by_name(name)
            value = np.asarray(value)
            if value.shape[0] != b.shape[0]:
                raise ValueError(f"input '{name}' is not batch sized: {value.shape[0]} vs {b.shape[0]}")
            b.data[...] = value
        self.forward_from_to(start_ind, end_ind)
        return {out: self.blob_by_name(out).data for out in outputs}

    def backward(self, diffs=None, start=None, end=None, **kwargs):
        start_ind = self.layer_names_index[start] if start is not None else len(self.layers) - 1
        end_ind = self.layer_names_index[end] if end is not None else 0
        if end is not None:
            outputs = set(self.bottom_names_of(end) + list(diffs or []))
        else:
            outputs = set(self.inputs + list(diffs or []))
        for name, value in kwargs.items():
            if name not in self.outputs:
                raise KeyError(f"'{name}' is not an output of this net (outputs: {self.outputs})")
            self.blob_by_name(name).diff[...] = value
        self.backward_from_to(start_ind, end_ind)
        return {out: self.blob_by_name(out).diff for out in outputs}

    def top_names_of(self, layer_name):
        i = self.layer_names_index[layer_name]
        return [self.blob_names[b] for b in self.top_id_vecs[i]]

    def bottom_names_of(self, layer_name):
        i = self.layer_names_index[layer_name]
        return [self.blob_names[b] for b in self.bottom_id_vecs[i]]

    @property
    def top_names(self):
        return collections.OrderedDict((n, self.top_names_of(n)) for n in self.layer_names)

    @property
    def bottom_names(self):
        return collections.OrderedDict((n, self.bottom_names_of(n)) for n in self.layer_names)

    HOOK_KINDS = ("before_forward", "after_forward", "before_backward", "after_backward")

    def add_hook(self, kind, fn):
        """Callbacks ``fn(layer_index)``; kind is before/after_forward/backward."""
        getattr(self, "_" + kind).append(fn)

    def run_hooks(self, kind, layer_index):
        """Call the ``kind`` hooks for layer ``layer_index``, as the Net's own passes do
        around each layer: what a driver that runs the layers itself (the GPU step's
        data prologue, a test harness) calls so that hooks see every layer."""
        if kind not in self.HOOK_KINDS:
            raise ValueError(f"unknown hook kind {kind!r} (one of {', '.join(self.HOOK_KINDS)})")
        for cb in getattr(self, "_" + kind):
            cb(layer_index)

    # -- weights ------------------------------------------------------------------------
    def copy_from(self, source):
        """Copy trained layers from a .caffemodel, .caffemodel.h5, or a NetParameter (layers
        matched by name).  Fails when a file fills none of this net's parameters; warns
        when it leaves some of them at their initial values."""
        if isinstance(source, caffe_pb2.NetParameter):
            filled = self.copy_trained_layers_from_param(source, "<NetParameter>")
            return self._check_filled(filled, "<NetParameter>", len(source.layer))
        for path in str(source).split(","):
            if path.endswith(".h5"):
                filled = self.copy_trained_layers_from_hdf5(path)
                n_layers = None
            else:
                weights = read_weights(path)
                filled = self.copy_trained_layers_from_param(weights, path)
                n_layers = len(weights.layer)
            self._check_filled(filled, path, n_layers)

    copy_trained_layers_from = copy_from

    def _check_filled(self, filled, source, n_layers=None):
        """``filled``: the (layer id, blob index) pairs a weights file wrote."""
        owners = {pid for pid, owner in enumerate(self.param_owners) if owner == -1}
        if not owners:
            return
        done = set()
        for lid, j in filled:
            pid = self.param_id_vecs[lid][j]
            done.add(pid if self.param_owners[pid] == -1 else self.param_owners[pid])
        missing = sorted({self.layer_names[self.param_layer_indices[pid][0]]
                          for pid in owners - done}, key=self.layer_names.index)
        if not done:
            what = ("it holds no layers (an empty or truncated file?)" if n_layers == 0 else
                    "none of its layers with weights matches a layer of this net by name")
            raise MinicaffeError(f"{source}: no weights were copied into net '{self.name}': "
                                 f"{what}; layers with parameters here: {', '.join(missing)}")
        if missing:
            log.warning("%s: %d of %d parameter blobs of net '%s' were not in the file and keep "
                        "their initial values (layers: %s)", source, len(owners - done),
                        len(owners), self.name, ", ".join(missing))

    def copy_trained_layers_from_param(self, param, source="<net>"):
        """Copy the blobs of ``param``'s layers into this net's layers of the same names;
        returns the (layer id, blob index) pairs written."""
        filled = []
        for src in param.layer:
            if src.name not in self.layer_names_index:
                log.info("Ignoring source layer %s", src.name)
                continue
            lid = self.layer_names_index[src.name]
            target = self.layers[lid].blobs
            if len(target) != len(src.blobs):
                raise MinicaffeError(f"{source}: incompatible number of blobs for layer "
                                     f"'{src.name}' (file has {len(src.blobs)}, net has {len(target)})")
            for j, bp in enumerate(src.blobs):
                if not target[j].shape_equals(bp):
                    raise MinicaffeError(
                        f"{source}: cannot copy param {j} weights from layer '{src.name}'; shape "
                        f"mismatch. Source param shape is {Blob.proto_shape(bp)}; target param "
                        f"shape is {target[j].shape}. To learn this layer's parameters from "
                        f"scratch rather than copying from a saved net, rename the layer.")
                target[j].from_proto(bp, reshape=False)
                filled.append((lid, j))
        return filled

    def copy_trained_layers_from_hdf5(self, path):
        """Copy weights from a .caffemodel.h5; returns the (layer id, blob index) pairs
        written.  A layer named with '/' ('inception_3a/1x1') is a nested group there."""
        try:
            import h5py
        except ImportError:
            raise MinicaffeError(f"{path}: reading HDF5 weights needs h5py "
                                 "(pip install \".[data]\")") from None
        if not os.path.exists(path):
            raise MinicaffeError(f"{path}: no such file")
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            raise MinicaffeError(f"{path}: not a readable HDF5 file ({_one_line(e)})") from None
        with f:
            if "data" not in f:
                raise MinicaffeError(f"{path}: not a Caffe HDF5 weights file (no 'data' group)")
            try:
                return self._copy_hdf5_layers(f["data"], path, h5py)
            except MinicaffeError:
                raise
            except Exception as e:  # a damaged file: h5py's errors name no file
                raise MinicaffeError(f"{path}: cannot read the weights ({type(e).__name__}: "
                                     f"{_one_line(e)})") from None

    def _copy_hdf5_layers(self, data, path, h5py):
        filled = []
        for lname, group in _hdf5_groups(data, h5py):
            blobs = {k: v for k, v in group.items() if isinstance(v, h5py.Dataset)}
            if lname not in self.layer_names_index:
                if blobs:
                    log.info("Ignoring source layer %s", lname)
                continue
            lid = self.layer_names_index[lname]
            target = self.layers[lid].blobs
            if len(blobs) > len(target):
                raise MinicaffeError(f"{path}: incompatible number of blobs for layer '{lname}'")
            for j, blob in enumerate(target):
                key = str(j)
                if key not in blobs:
                    if self.param_owners[self.param_id_vecs[lid][j]] != -1:
                        continue
                    raise MinicaffeError(f"{path}: incompatible number of blobs for layer '{lname}'")
                arr = np.asarray(blobs[key])
                if arr.shape != blob.shape:
                    raise MinicaffeError(
                        f"{path}: cannot copy param {j} weights from layer '{lname}'; shape "
                        f"mismatch. Source param shape is {arr.shape}; target param shape is "
                        f"{blob.shape}")
                blob.mutable_cpu_data()[...] = arr
                filled.append((lid, j))
        return filled

    def to_proto(self, write_diff=False):
        p = caffe_pb2.NetParameter()
        p.CopyFrom(self.net_param)
        del p.layer[:]
        for layer in self.layers:
            p.layer.add().CopyFrom(layer.to_proto(write_diff))
        return p

    def save(self, filename, write_diff=False):
        """Write a binary .caffemodel (temporary file, then rename)."""
        protoio.write_binary(filename, self.to_proto(write_diff))

    def save_hdf5(self, filename, write_diff=False):
        """Write a .caffemodel.h5 (temporary file, then rename)."""
        import h5py
        with fileio.atomic_path(filename) as tmp, h5py.File(tmp, "w") as f:
            groups = [("data", False)] + ([("diff", True)] if write_diff else [])
            for gname, is_diff in groups:
                g = f.create_group(gname)
                for lid, layer in enumerate(self.layers):
                    lg = g.require_group(self.layer_names[lid])  # 'a/b': nested
                    for j, blob in enumerate(layer.blobs):
                        if self.param_owners[self.param_id_vecs[lid][j]] != -1:
                            continue
                        lg.create_dataset(str(j), data=blob.cpu_diff() if is_diff else blob.cpu_data())

    def load_hdf5(self, filename):
        """pycaffe's ``load_hdf5``: copy_from for a .caffemodel.h5 of any name."""
        self._check_filled(self.copy_trained_layers_from_hdf5(filename), filename)

    def share_trained_layers_with(self, other):
        """Make this net's layers use ``other``'s parameter blobs (same names)."""
        for src_name, src_layer in zip(other.layer_names, other.layers):
            if src_name not in self.layer_names_index:
                continue
            target = self.layers[self.layer_names_index[src_name]].blobs
            if len(target) != len(src_layer.blobs):
                raise MinicaffeError(f"incompatible number of blobs for layer '{src_name}'")
            for t, s in zip(target, src_layer.blobs):
                if t.shape != s.shape:
                    raise MinicaffeError(f"cannot share param of layer '{src_name}': shape "
                                         f"{s.shape} vs {t.shape}")
                t.share_data(s)

    share_with = share_trained_layers_with

    # -- diagnostics ---------------------------------------------------------------------
    def memory_report(self):
        """Bytes per layer: tops' data and diff, and params; with totals."""
        rows = []
        seen = set()
        for lid, layer in enumerate(self.layers):
            data = diff = 0
            for bid in self.top_id_vecs[lid]:
                if bid in seen:
                    continue
                seen.add(bid)
                b = self._blobs[bid]
                data += b.count() * b.dtype.itemsize
                diff += b.count() * b.dtype.itemsize
            params = sum(b.count() * b.dtype.itemsize for j, b in enumerate(layer.blobs)
                         if self.param_owners[self.param_id_vecs[lid][j]] == -1)
            rows.append({"layer": self.layer_names[lid], "type": layer.type,
                         "data": data, "diff": diff, "params": params})
        total = {k: sum(r[k] for r in rows) for k in ("data", "diff", "params")}
        return {"layers": rows, "total": total}

    def first_nonfinite(self):
        """(layer name, blob name) of the first top holding NaN or inf, or None."""
        for lid in range(len(self.layers)):
            for bid in self.top_id_vecs[lid]:
                b = self._blobs[bid]
                xp = context.xp()
                if b.count() and not bool(xp.isfinite(b.data_for(xp)).all()):
                    return self.layer_names[lid], self.blob_names[bid]
        return None

    def _forward_debug_info(self, lid):
        for bid in self.top_id_vecs[lid]:
            b = self._blobs[bid]
            log.info("    [Forward] Layer %s, top blob %s data: %g", self.layer_names[lid],
                     self.blob_names[bid], b.asum_data() / max(b.count(), 1))
        for j, pid in enumerate(self.param_id_vecs[lid]):
            b = self.layers[lid].blobs[j]
            log.info("    [Forward] Layer %s, param blob %s data: %g", self.layer_names[lid],
                     self.param_display_names[pid], b.asum_data() / max(b.count(), 1))

    def _backward_debug_info(self, lid):
        for k, bid in enumerate(self.bottom_id_vecs[lid]):
            if not self.bottom_need_backward[lid][k]:
                continue
            b = self._blobs[bid]
            log.info("    [Backward] Layer %s, bottom blob %s diff: %g", self.layer_names[lid],
                     self.blob_names[bid], b.asum_diff() / max(b.count(), 1))
        for j, b in enumerate(self.layers[lid].blobs):
            if not self.layers[lid].get_param_propagate_down(j):
                continue
            log.info("    [Backward] Layer %s, param blob %d diff: %g", self.layer_names[lid], j,
                     b.asum_diff() / max(b.count(), 1))

    def _update_norms_log(self):
        asum_data = asum_diff = sumsq_data = sumsq_diff = 0.0
        for b in self.learnable_params:
            asum_data += b.asum_data()
            asum_diff += b.asum_diff()
            sumsq_data += b.sumsq_data()
            sumsq_diff += b.sumsq_diff()
        log.info("    [Backward] All net params (data, diff): L1 norm = (%g, %g); L2 norm = (%g, %g)",
                 asum_data, asum_diff, sumsq_data ** 0.5, sumsq_diff ** 0.5)


def _hdf5_groups(group, h5py, prefix=""):
    """(layer name, group) for every group below ``group``, nested ones included: h5py
    stores a name with '/' as nested groups, as HDF5 paths are."""
    for name, item in group.items():
        if isinstance(item, h5py.Group):
            yield prefix + name, item
            yield from _hdf5_groups(item, h5py, prefix + name + "/")


def _one_line(e):
    return " ".join(str(e).split()) or type(e).__name__


class _NameOrIndexDict(collections.OrderedDict):
    """An OrderedDict keyed by name that also answers integer positions."""

    def __getitem__(self, key):
        if isinstance(key, int) and not isinstance(key, bool):
            return list(self.values())[key]
        return super().__getitem__(key)


def _short_text(param):
    from google.protobuf import text_format
    p = caffe_pb2.NetParameter()
    p.CopyFrom(param)
    for l in p.layer:
        del l.blobs[:]
    return text_format.MessageToString(p)
