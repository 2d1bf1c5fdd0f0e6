"""Upgrading old net definitions as Caffe's upgrade_proto.cpp does.

V0 (``layers { layer { type: "conv" ... } }``) -> V1 -> V2 (``layer { type: "Convolution" }``),
``input``/``input_dim``/``input_shape`` -> an Input layer, transformation fields
inside V1 data parameters -> ``transform_param``, and BatchNorm's forced ``param``
specs dropped.
"""
from ..core import log
from ..core.errors import ConfigError
from ..proto import caffe_pb2

V1_TYPE_NAMES = {
    "NONE": "", "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution", "DATA": "Data", "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData", "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise",
    "EXP": "Exp", "FLATTEN": "Flatten", "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col", "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct", "LRN": "LRN",
    "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence",
    "SOFTMAX": "Softmax", "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice",
    "TANH": "TanH", "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}


def net_needs_v0_to_v1(net):
    return any(l.HasField("layer") for l in net.layers)


def net_needs_v1_to_v2(net):
    return len(net.layers) > 0


def net_needs_input_upgrade(net):
    return len(net.input) > 0


def net_needs_data_upgrade(net):
    for l in net.layers:
        for pname in ("data_param", "image_data_param", "window_data_param"):
            if l.HasField(pname):
                p = getattr(l, pname)
                if any(p.HasField(f) for f in ("scale", "mean_file", "crop_size", "mirror")):
                    return True
    return False


def upgrade_v1_layer(v1, out):
    """Fill LayerParameter ``out`` from V1LayerParameter ``v1``."""
    if v1.HasField("layer"):
        raise ConfigError(f"layer '{v1.name}': V0 layer inside V1 net; upgrade V0 first")
    out.name = v1.name
    out.bottom.extend(v1.bottom)
    out.top.extend(v1.top)
    out.loss_weight.extend(v1.loss_weight)
    if v1.HasField("type"):
        tname = caffe_pb2.V1LayerParameter.LayerType.Name(v1.type)
        out.type = V1_TYPE_NAMES[tname]
    n_specs = max(len(v1.param), len(v1.blob_share_mode), len(v1.blobs_lr), len(v1.weight_decay))
    for i in range(n_specs):
        spec = out.param.add()
        if i < len(v1.param):
            spec.name = v1.param[i]
        if i < len(v1.blob_share_mode):
            spec.share_mode = v1.blob_share_mode[i]
        if i < len(v1.blobs_lr):
            spec.lr_mult = v1.blobs_lr[i]
        if i < len(v1.weight_decay):
            spec.decay_mult = v1.weight_decay[i]
    for b in v1.blobs:
        out.blobs.add().CopyFrom(b)
    for rule in v1.include:
        out.include.add().CopyFrom(rule)
    for rule in v1.exclude:
        out.exclude.add().CopyFrom(rule)
    target_fields = {f.name for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields}
    for field, value in v1.ListFields():
        if field.name.endswith("_param") and field.name in target_fields:
            getattr(out, field.name).CopyFrom(value)
    return out


def upgrade_v1_net(net):
    upgraded = caffe_pb2.NetParameter()
    upgraded.CopyFrom(net)
    del upgraded.layers[:]
    del upgraded.layer[:]
    if len(net.layer):
        raise ConfigError("net has both V1 'layers' and V2 'layer' fields; use one")
    for v1 in net.layers:
        upgrade_v1_layer(v1, upgraded.layer.add())
    net.CopyFrom(upgraded)


def upgrade_input(net):
    has_shape = len(net.input_shape) > 0
    has_dim = len(net.input_dim) > 0
    if has_shape or has_dim:
        if has_dim and len(net.input_dim) != 4 * len(net.input):
            raise ConfigError(f"input_dim must give 4 values per input ({len(net.input)} inputs, "
                              f"{len(net.input_dim)} dims)")
        if has_shape and len(net.input_shape) != len(net.input):
            raise ConfigError("input_shape must be given once per input")
        layer = caffe_pb2.LayerParameter(name="input", type="Input")
        for i, name in enumerate(net.input):
            layer.top.append(name)
            shape = layer.input_param.shape.add()
            if has_shape:
                shape.CopyFrom(net.input_shape[i])
            else:
                shape.dim.extend(net.input_dim[4 * i: 4 * i + 4])
        rest = [caffe_pb2.LayerParameter.FromString(l.SerializeToString()) for l in net.layer]
        del net.layer[:]
        for l in [layer] + rest:
            net.layer.add().CopyFrom(l)
    del net.input[:]
    del net.input_shape[:]
    del net.input_dim[:]


def upgrade_data_transform(net):
    for l in net.layers:
        for pname in ("data_param", "image_data_param", "window_data_param"):
            if not l.HasField(pname):
                continue
            p = getattr(l, pname)
            for f in ("scale", "mean_file", "crop_size", "mirror"):
                if p.HasField(f):
                    setattr(l.transform_param, f, getattr(p, f))
                    p.ClearField(f)


def upgrade_batchnorm(net):
    for l in net.layer:
        if l.type == "BatchNorm" and len(l.param) == 3:
            del l.param[:]


def upgrade_net_as_needed(net, source="<net>"):
    """Upgrade ``net`` in place; returns True if anything changed."""
    changed = False
    if net_needs_v0_to_v1(net):
        from .upgrade_v0 import upgrade_v0_net
        log.info("Attempting to upgrade input file specified using deprecated V0LayerParameter: %s", source)
        upgrade_v0_net(net, source)
        changed = True
    if net_needs_data_upgrade(net):
        log.info("Attempting to upgrade input file specified using deprecated transformation "
                 "parameters: %s", source)
        upgrade_data_transform(net)
        changed = True
    if net_needs_v1_to_v2(net):
        log.info("Attempting to upgrade input file specified using deprecated V1LayerParameter: %s", source)
        upgrade_v1_net(net)
        changed = True
    if net_needs_input_upgrade(net):
        log.info("Attempting to upgrade input file specified using deprecated input fields: %s", source)
        upgrade_input(net)
        changed = True
    if any(l.type == "BatchNorm" and len(l.param) == 3 for l in net.layer):
        upgrade_batchnorm(net)
        changed = True
    return changed
