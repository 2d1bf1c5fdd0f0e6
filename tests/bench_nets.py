"""Small nets for the PyTorch-twin and bench tests: the layers and settings of AlexNet,
a ResNet block and a GoogLeNet inception block at toy sizes, and one net for the rest of
what the twin translates.  Text prototxts with Input layers (bench replaces them by
Input layers of the same shapes)."""


def _conv(name, bottom, n, k, pad=0, stride=1, group=1, bias=True, dilation=1, filler="xavier"):
    extra = "" if bias else "bias_term: false"
    dil = f"dilation: {dilation}" if dilation != 1 else ""
    return f"""layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}"
  param {{ lr_mult: 1 decay_mult: 1 }} {'param { lr_mult: 2 decay_mult: 0 }' if bias else ''}
  convolution_param {{ num_output: {n} kernel_size: {k} pad: {pad} stride: {stride}
    group: {group} {extra} {dil} weight_filler {{ type: "{filler}" }}
    bias_filler {{ type: "gaussian" std: 0.1 }} }} }}
"""


def _relu(name, bottom):
    return f'layer {{ name: "{name}" type: "ReLU" bottom: "{bottom}" top: "{bottom}" }}\n'


def _ip(name, bottom, n, **extra):
    more = " ".join(f"{k}: {v}" for k, v in extra.items())
    return f"""layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{name}"
  param {{ lr_mult: 1 decay_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}
  inner_product_param {{ num_output: {n} {more} weight_filler {{ type: "xavier" }}
    bias_filler {{ type: "gaussian" std: 0.1 }} }} }}
"""


def _pool(name, bottom, method, k=3, stride=2, pad=0, global_=False):
    geo = "global_pooling: true" if global_ else f"kernel_size: {k} stride: {stride} pad: {pad}"
    return f"""layer {{ name: "{name}" type: "Pooling" bottom: "{bottom}" top: "{name}"
  pooling_param {{ pool: {method} {geo} }} }}
"""


def _lrn(name, bottom, size=5, alpha=0.5, beta=0.75, k=2.0, region="ACROSS_CHANNELS"):
    return f"""layer {{ name: "{name}" type: "LRN" bottom: "{bottom}" top: "{name}"
  lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} k: {k} norm_region: {region} }} }}
"""


def _loss(name, bottom, label="label", weight=1.0, extra=""):
    return f"""layer {{ name: "{name}" type: "SoftmaxWithLoss" bottom: "{bottom}"
  bottom: "{label}" top: "{name}" loss_weight: {weight} {extra} }}
"""


def _input(shapes, tops=("data", "label")):
    dims = " ".join("shape { " + " ".join(f"dim: {d}" for d in s) + " }" for s in shapes)
    top = " ".join(f'top: "{t}"' for t in tops)
    return f'layer {{ name: "data" type: "Input" {top} input_param {{ {dims} }} }}\n'


# AlexNet's layers at 67x67: grouped convolutions, LRN across channels, overlapping
# max pooling with Caffe's ceil rounding, dropout (ratio 0 so steps are comparable)
ALEXNET_SMALL = ('name: "AlexNetSmall"\n' + _input([(4, 3, 67, 67), (4,)]) +
                 _conv("conv1", "data", 16, 11, stride=4) +
                 _relu("relu1", "conv1") + _lrn("norm1", "conv1") +
                 _pool("pool1", "norm1", "MAX") +
                 _conv("conv2", "pool1", 24, 5, pad=2, group=2) + _relu("relu2", "conv2") +
                 _lrn("norm2", "conv2") + _pool("pool2", "norm2", "MAX") +
                 _conv("conv3", "pool2", 32, 3, pad=1) + _relu("relu3", "conv3") +
                 _conv("conv4", "conv3", 32, 3, pad=1, group=2) + _relu("relu4", "conv4") +
                 _conv("conv5", "conv4", 24, 3, pad=1, group=2) + _relu("relu5", "conv5") +
                 _pool("pool5", "conv5", "MAX") +
                 _ip("fc6", "pool5", 32) + _relu("relu6", "fc6") +
                 'layer { name: "drop6" type: "Dropout" bottom: "fc6" top: "fc6" '
                 'dropout_param { dropout_ratio: 0 } }\n' +
                 _ip("fc7", "fc6", 32) + _relu("relu7", "fc7") + _ip("fc8", "fc7", 10) +
                 _loss("loss", "fc8"))


def _bn_scale(name, bottom):
    return f"""layer {{ name: "bn_{name}" type: "BatchNorm" bottom: "{bottom}" top: "{bottom}"
  batch_norm_param {{ moving_average_fraction: 0.9 eps: 1e-5 }} }}
layer {{ name: "scale_{name}" type: "Scale" bottom: "{bottom}" top: "{bottom}"
  scale_param {{ bias_term: true filler {{ type: "uniform" min: 0.5 max: 1.5 }}
    bias_filler {{ type: "gaussian" std: 0.1 }} }} }}
"""


def _res_unit(name, bottom, n_in, n_out, stride, project):
    s = ""
    short = bottom
    if project:
        s += _conv(f"res{name}_branch1", bottom, n_out, 1, stride=stride, bias=False)
        s += _bn_scale(f"{name}_branch1", f"res{name}_branch1")
        short = f"res{name}_branch1"
    mid = max(n_out // 4, 2)
    s += _conv(f"res{name}_branch2a", bottom, mid, 1, stride=stride, bias=False)
    s += _bn_scale(f"{name}_branch2a", f"res{name}_branch2a")
    s += _relu(f"res{name}_branch2a_relu", f"res{name}_branch2a")
    s += _conv(f"res{name}_branch2b", f"res{name}_branch2a", mid, 3, pad=1, bias=False)
    s += _bn_scale(f"{name}_branch2b", f"res{name}_branch2b")
    s += _relu(f"res{name}_branch2b_relu", f"res{name}_branch2b")
    s += _conv(f"res{name}_branch2c", f"res{name}_branch2b", n_out, 1, bias=False)
    s += _bn_scale(f"{name}_branch2c", f"res{name}_branch2c")
    s += f"""layer {{ name: "res{name}" type: "Eltwise" bottom: "{short}"
  bottom: "res{name}_branch2c" top: "res{name}" }}
"""
    s += _relu(f"res{name}_relu", f"res{name}")
    return s


# ResNet-50's pattern: conv + BatchNorm + Scale (bias), a projection unit and an identity
# unit with Eltwise SUM, global average pooling
RESNET_SMALL = ('name: "ResNetSmall"\n' + _input([(8, 3, 8, 8), (8,)]) +
                _conv("conv1", "data", 8, 3, pad=1, bias=False) + _bn_scale("conv1", "conv1") +
                _relu("conv1_relu", "conv1") +
                _res_unit("2a", "conv1", 8, 16, 2, True) +
                _res_unit("2b", "res2a", 16, 16, 1, False) +
                _pool("pool5", "res2b", "AVE", global_=True) + _ip("fc10", "pool5", 10) +
                _loss("loss", "fc10"))


def _inception(name, bottom):
    s = _conv(f"{name}/1x1", bottom, 8, 1) + _relu(f"{name}/relu_1x1", f"{name}/1x1")
    s += _conv(f"{name}/3x3_reduce", bottom, 4, 1) + _relu(f"{name}/r3", f"{name}/3x3_reduce")
    s += _conv(f"{name}/3x3", f"{name}/3x3_reduce", 8, 3, pad=1)
    s += _relu(f"{name}/relu_3x3", f"{name}/3x3")
    s += _conv(f"{name}/5x5_reduce", bottom, 4, 1) + _relu(f"{name}/r5", f"{name}/5x5_reduce")
    s += _conv(f"{name}/5x5", f"{name}/5x5_reduce", 4, 5, pad=2)
    s += _relu(f"{name}/relu_5x5", f"{name}/5x5")
    s += _pool(f"{name}/pool", bottom, "MAX", k=3, stride=1, pad=1)
    s += _conv(f"{name}/pool_proj", f"{name}/pool", 4, 1)
    s += _relu(f"{name}/relu_pool_proj", f"{name}/pool_proj")
    s += f"""layer {{ name: "{name}/output" type: "Concat" bottom: "{name}/1x1"
  bottom: "{name}/3x3" bottom: "{name}/5x5" bottom: "{name}/pool_proj" top: "{name}/output" }}
"""
    return s


# GoogLeNet's pattern: inception blocks (Split of one top into four branches, Concat),
# LRN, an auxiliary classifier with loss_weight 0.3, average pooling
GOOGLENET_SMALL = ('name: "GoogLeNetSmall"\n' + _input([(4, 3, 16, 16), (4,)]) +
                   _conv("conv1", "data", 16, 3, pad=1) + _relu("relu1", "conv1") +
                   _pool("pool1", "conv1", "MAX") + _lrn("norm1", "pool1") +
                   _inception("inception_3a", "norm1") +
                   _inception("inception_3b", "inception_3a/output") +
                   _pool("loss1/ave_pool", "inception_3a/output", "AVE", k=5, stride=3) +
                   _conv("loss1/conv", "loss1/ave_pool", 8, 1) +
                   _relu("loss1/relu_conv", "loss1/conv") + _ip("loss1/fc", "loss1/conv", 10) +
                   _loss("loss1/loss", "loss1/fc", weight=0.3) +
                   _pool("pool5", "inception_3b/output", "AVE", k=8, stride=1) +
                   _ip("loss3/classifier", "pool5", 10) + _loss("loss3/loss", "loss3/classifier"))

# The rest: dilation, LRN within channel, Sigmoid/TanH, Eltwise PROD/MAX/SUM with
# coefficients, leaky ReLU, average pooling whose last window is clipped, a standalone
# Scale, Reshape/Flatten, InnerProduct with transpose, Softmax, SoftmaxWithLoss with
# ignore_label and BATCH_SIZE normalization, EuclideanLoss
MISC = ('name: "Misc"\n' + _input([(4, 6, 9, 9), (4,), (4, 7)], ("data", "label", "target")) +
        _conv("dil", "data", 6, 3, pad=2, dilation=2) +
        _lrn("within", "dil", size=3, alpha=0.5, beta=0.75, region="WITHIN_CHANNEL") +
        'layer { name: "sig" type: "Sigmoid" bottom: "within" top: "sig" }\n'
        'layer { name: "th" type: "TanH" bottom: "dil" top: "th" }\n'
        'layer { name: "prod" type: "Eltwise" bottom: "sig" bottom: "th" top: "prod" '
        'eltwise_param { operation: PROD } }\n'
        'layer { name: "mx" type: "Eltwise" bottom: "sig" bottom: "th" top: "mx" '
        'eltwise_param { operation: MAX } }\n'
        'layer { name: "sum" type: "Eltwise" bottom: "prod" bottom: "mx" top: "sum" '
        'eltwise_param { operation: SUM coeff: 1 coeff: -0.5 } }\n'
        'layer { name: "leaky" type: "ReLU" bottom: "sum" top: "sum" '
        'relu_param { negative_slope: 0.1 } }\n' +
        _pool("ave", "sum", "AVE", k=3, stride=2, pad=1) +
        _pool("maxp", "ave", "MAX", k=2, stride=2) +
        'layer { name: "sc" type: "Scale" bottom: "maxp" top: "sc" scale_param { '
        'bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 } '
        'bias_filler { type: "gaussian" std: 0.1 } } }\n'
        'layer { name: "flat" type: "Flatten" bottom: "sc" top: "flat" }\n'
        'layer { name: "resh" type: "Reshape" bottom: "sc" top: "resh" '
        'reshape_param { shape { dim: 0 dim: -1 } } }\n' +
        _ip("ip1", "flat", 10) + _ip("ip2", "resh", 7, transpose="true") +
        _loss("loss_valid", "ip1", extra='loss_param { ignore_label: 0 }') +
        _loss("loss_batch", "ip1", weight=0.5, extra='loss_param { normalization: BATCH_SIZE }') +
        'layer { name: "prob" type: "Softmax" bottom: "ip2" top: "prob" }\n'
        'layer { name: "l2" type: "EuclideanLoss" bottom: "prob" bottom: "target" top: "l2" '
        'loss_weight: 2 }\n')

SMALL_NETS = {"alexnet_small": ALEXNET_SMALL, "resnet_small": RESNET_SMALL,
              "googlenet_small": GOOGLENET_SMALL, "misc": MISC}
