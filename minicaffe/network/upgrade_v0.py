"""V0 net definitions (``layers { layer { type: "conv" ... } }``) upgraded to V1, as
Caffe's UpgradeV0Net does: padding layers fold into the conv/pool that consumes
them, V0 type names map to V1 LayerType values, and each flat V0 field moves
into the parameter message of its layer type.  The V1 -> V2 step follows in
``upgrade.py``.
"""
from ..core import log
from ..core.errors import ConfigError
from ..proto import caffe_pb2

V1 = caffe_pb2.V1LayerParameter

V0_TYPES = {
    "accuracy": V1.ACCURACY, "bnll": V1.BNLL, "concat": V1.CONCAT, "conv": V1.CONVOLUTION,
    "data": V1.DATA, "dropout": V1.DROPOUT, "euclidean_loss": V1.EUCLIDEAN_LOSS,
    "flatten": V1.FLATTEN, "hdf5_data": V1.HDF5_DATA, "hdf5_output": V1.HDF5_OUTPUT,
    "im2col": V1.IM2COL, "images": V1.IMAGE_DATA, "infogain_loss": V1.INFOGAIN_LOSS,
    "innerproduct": V1.INNER_PRODUCT, "lrn": V1.LRN,
    "multinomial_logistic_loss": V1.MULTINOMIAL_LOGISTIC_LOSS, "pool": V1.POOLING,
    "relu": V1.RELU, "sigmoid": V1.SIGMOID, "softmax": V1.SOFTMAX,
    "softmax_loss": V1.SOFTMAX_LOSS, "split": V1.SPLIT, "tanh": V1.TANH,
    "window_data": V1.WINDOW_DATA,
}

# V0 field -> {V0 type: "param_message.field"}; "*" means any layer type.
FIELD_MAP = {
    "num_output": {"conv": "convolution_param.num_output",
                   "innerproduct": "inner_product_param.num_output"},
    "biasterm": {"conv": "convolution_param.bias_term",
                 "innerproduct": "inner_product_param.bias_term"},
    "weight_filler": {"conv": "convolution_param.weight_filler",
                      "innerproduct": "inner_product_param.weight_filler"},
    "bias_filler": {"conv": "convolution_param.bias_filler",
                    "innerproduct": "inner_product_param.bias_filler"},
    "pad": {"conv": "convolution_param.pad", "pool": "pooling_param.pad"},
    "kernelsize": {"conv": "convolution_param.kernel_size", "pool": "pooling_param.kernel_size"},
    "group": {"conv": "convolution_param.group"},
    "stride": {"conv": "convolution_param.stride", "pool": "pooling_param.stride"},
    "pool": {"pool": "pooling_param.pool"},
    "dropout_ratio": {"dropout": "dropout_param.dropout_ratio"},
    "local_size": {"lrn": "lrn_param.local_size"},
    "alpha": {"lrn": "lrn_param.alpha"},
    "beta": {"lrn": "lrn_param.beta"},
    "k": {"lrn": "lrn_param.k"},
    "source": {"data": "data_param.source", "hdf5_data": "hdf5_data_param.source",
               "images": "image_data_param.source", "window_data": "window_data_param.source",
               "infogain_loss": "infogain_loss_param.source"},
    "scale": {"*": "transform_param.scale"},
    "meanfile": {"*": "transform_param.mean_file"},
    "batchsize": {"data": "data_param.batch_size", "hdf5_data": "hdf5_data_param.batch_size",
                  "images": "image_data_param.batch_size",
                  "window_data": "window_data_param.batch_size"},
    "cropsize": {"*": "transform_param.crop_size"},
    "mirror": {"*": "transform_param.mirror"},
    "rand_skip": {"data": "data_param.rand_skip", "images": "image_data_param.rand_skip"},
    "shuffle_images": {"images": "image_data_param.shuffle"},
    "new_height": {"images": "image_data_param.new_height"},
    "new_width": {"images": "image_data_param.new_width"},
    "concat_dim": {"concat": "concat_param.concat_dim"},
    "det_fg_threshold": {"window_data": "window_data_param.fg_threshold"},
    "det_bg_threshold": {"window_data": "window_data_param.bg_threshold"},
    "det_fg_fraction": {"window_data": "window_data_param.fg_fraction"},
    "det_context_pad": {"window_data": "window_data_param.context_pad"},
    "det_crop_mode": {"window_data": "window_data_param.crop_mode"},
    "hdf5_output_param": {"hdf5_output": "hdf5_output_param"},
}


def _assign(msg, path, value):
    """Set ``msg.<path>`` to ``value``: append for repeated fields, copy for messages."""
    *parents, last = path.split(".")
    for p in parents:
        msg = getattr(msg, p)
    fd = msg.DESCRIPTOR.fields_by_name[last]
    repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.28; `label` before
    if repeated is None:
        repeated = fd.label == fd.LABEL_REPEATED
    if repeated:
        getattr(msg, last).append(value)
    elif fd.type == fd.TYPE_MESSAGE:
        getattr(msg, last).CopyFrom(value)
    else:
        setattr(msg, last, value)


def upgrade_v0_padding_layers(net):
    """Fold each V0 "padding" layer into the conv or pool layer that reads it."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    del out.layers[:]
    last_top = {name: -1 for name in net.input}
    for i, conn in enumerate(net.layers):
        lp = conn.layer
        if lp.type != "padding":
            out.layers.add().CopyFrom(conn)
        for j, blob in enumerate(conn.bottom):
            if blob not in last_top:
                raise ConfigError(f"layer '{lp.name}': unknown blob input '{blob}' (bottom {j})")
            src = last_top[blob]
            if src == -1 or net.layers[src].layer.type != "padding":
                continue
            pad_layer = net.layers[src]
            if lp.type not in ("conv", "pool"):
                raise ConfigError(f"layer '{lp.name}': padding layer input to non-convolutional / "
                                  f"non-pooling layer type {lp.type}")
            if len(conn.bottom) != 1 or len(pad_layer.bottom) != 1 or len(pad_layer.top) != 1:
                raise ConfigError(f"layer '{lp.name}': padding layers must have one input and "
                                  f"one output and feed a single-input layer")
            target = out.layers[len(out.layers) - 1]
            target.layer.pad = pad_layer.layer.pad
            target.bottom[j] = pad_layer.bottom[0]
        for blob in conn.top:
            last_top[blob] = i
    return out


def upgrade_v0_layer(conn, out):
    """V1LayerParameter ``out`` from a V0 connection (bottom/top + ``layer``)."""
    out.bottom.extend(conn.bottom)
    out.top.extend(conn.top)
    if not conn.HasField("layer"):
        return
    v0 = conn.layer
    if v0.HasField("name"):
        out.name = v0.name
    t = v0.type
    if v0.HasField("type"):
        if t not in V0_TYPES:
            raise ConfigError(f"layer '{v0.name}': unknown V0 layer type '{t}'")
        out.type = V0_TYPES[t]
    for b in v0.blobs:
        out.blobs.add().CopyFrom(b)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    for fd, value in v0.ListFields():
        if fd.name not in FIELD_MAP:
            continue
        targets = FIELD_MAP[fd.name]
        path = targets.get(t, targets.get("*"))
        if path is None:
            log.error("Unknown parameter %s for layer type %s", fd.name, t)
            continue
        if fd.name == "pool":
            getattr(out, "pooling_param").pool = caffe_pb2.PoolingParameter.PoolMethod.Value(
                caffe_pb2.V0LayerParameter.PoolMethod.Name(value))
            continue
        _assign(out, path, value)


def upgrade_v0_net(net, source="<net>"):
    """Upgrade a V0 NetParameter in place to V1 (``layers`` with V1 types)."""
    padded = upgrade_v0_padding_layers(net)
    upgraded = caffe_pb2.NetParameter()
    if padded.HasField("name"):
        upgraded.name = padded.name
    for conn in padded.layers:
        upgrade_v0_layer(conn, upgraded.layers.add())
    upgraded.input.extend(padded.input)
    upgraded.input_dim.extend(padded.input_dim)
    if padded.HasField("force_backward"):
        upgraded.force_backward = padded.force_backward
    net.CopyFrom(upgraded)
