"""One registry of layer classes, keyed by the prototxt ``type`` string, with Caffe's
engine switch: a type may also have a cuDNN class, chosen at creation as Caffe's layer
factory chooses (``engine: CUDNN``, or ``DEFAULT`` when cuDNN loads).

The engine is chosen once, here: a cuDNN class declares what of a layer's parameters it
cannot compute as Caffe does (``cudnn_refuses(param)``: a leaky ReLU, STOCHASTIC
pooling...), and such a layer is built with Caffe's class and one log line saying why.
The Net adds what its wiring tells (``top_rewritten``: a later layer rewrites this layer's
top in place, and the cuDNN class's backward reads it: ``cudnn_reads_top(param)``; a class
that says its backward may not read it -- a 2-byte pooling with kernels of its own -- is
built, and the layer, told ``top_rewritten``, refuses cuDNN itself where it would).
The class's ``engine_name`` says which was chosen ('CAFFE' or 'CUDNN').  What only a
shape can tell (a pooling window clipped by Caffe's ceil-mode shape, an input of 3 axes)
the cuDNN class decides at its first reshape on a GPU, once, with one line when it takes
Caffe's engine (layers/cudnn_layers.py)."""
import difflib

from ..core import log
from ..core.errors import ConfigError

_LAYERS = {}
_CUDNN = {}
# the LayerParameter field holding each type's ``engine`` (BatchNorm has none: DEFAULT)
ENGINE_FIELDS = {"Convolution": "convolution_param", "Pooling": "pooling_param",
                 "LRN": "lrn_param", "ReLU": "relu_param", "Sigmoid": "sigmoid_param",
                 "TanH": "tanh_param", "Softmax": "softmax_param", "SPP": "spp_param"}
_said = set()


def register_layer(type_name):
    """Class decorator: ``@register_layer('ReLU')``."""
    def deco(cls):
        if type_name in _LAYERS and _LAYERS[type_name] is not cls:
            raise ValueError(f"layer type '{type_name}' registered twice")
        cls.type = type_name
        _LAYERS[type_name] = cls
        return cls
    return deco


def register_cudnn(type_name):
    """Class decorator: the cuDNN engine's class for layer type ``type_name``."""
    def deco(cls):
        cls.type = type_name
        cls.engine_name = "CUDNN"
        _CUDNN[type_name] = cls
        return cls
    return deco


def engine_name(param):
    """'DEFAULT', 'CAFFE' or 'CUDNN', as the layer's parameter says."""
    field = ENGINE_FIELDS.get(param.type)
    if field is None:
        return "DEFAULT"
    sub = getattr(param, field)
    return type(sub).Engine.Name(sub.engine)


def _say_once(key, fn, *args):
    if key not in _said:
        _said.add(key)
        fn(*args)


def cudnn_available():
    """(True, '') when the CUDNN engine can be chosen here, else (False, why): the
    registry's answer, which the Net's building passes ask too."""
    from ..gpu import cudnn
    return cudnn.available()


def choose_class(param, top_rewritten=False):
    """The class Caffe's factory would build: the cuDNN one for ``engine: CUDNN``, or for
    DEFAULT when cuDNN is usable; Caffe's own otherwise (with one line saying why).
    ``top_rewritten``: a later layer of the net rewrites this layer's top in place."""
    cls = layer_class(param.type, param.name)
    alt = _CUDNN.get(param.type)
    engine = engine_name(param)
    if engine == "CAFFE" or (alt is None and engine != "CUDNN"):
        return cls
    if alt is None:
        _say_once(("cudnn-none", param.type, param.name), log.warning,
                  "layer '%s' asks for engine CUDNN; minicaffe has no cuDNN %s layer: using "
                  "Caffe's engine", param.name, param.type)
        return cls
    ok, why = cudnn_available()
    if ok:
        refused = alt.cudnn_refuses(param)
        if refused is None and top_rewritten and alt.cudnn_reads_top(param):
            refused = "a later layer rewrites its top in place, and cuDNN's backward reads it"
        if refused is None:
            return alt
        _say_once(("cudnn-refuses", param.type, param.name),
                  log.warning if engine == "CUDNN" else log.info,
                  "layer '%s' (%s): cuDNN cannot compute it as Caffe does (%s): using "
                  "Caffe's engine", param.name, param.type, refused)
        return cls
    if engine == "CUDNN":
        _say_once(("cudnn-asked", param.type, param.name), log.warning,
                  "layer '%s' asks for engine CUDNN, but cuDNN is not available (%s); using "
                  "Caffe's engine", param.name, why)
    else:
        from ..core import backend
        if backend.gpu_available():
            _say_once("cudnn-default", log.info, "cuDNN is not available (%s): layers use "
                      "Caffe's engine", why)
    return cls


def _load_all():
    # Importing the layer package registers every built-in layer.
    from .. import layers  # noqa: F401


def layer_type_list():
    _load_all()
    return sorted(_LAYERS)


def layer_class(type_name, layer_name="?"):
    _load_all()
    cls = _LAYERS.get(type_name)
    if cls is None:
        lower = {t.lower(): t for t in _LAYERS}
        close = difflib.get_close_matches(type_name.lower(), lower, n=1, cutoff=0.6)
        hint = f" (did you mean '{lower[close[0]]}'?)" if close else ""
        raise ConfigError(f"layer '{layer_name}': unknown layer type '{type_name}'{hint}; "
                          f"known types: {', '.join(sorted(_LAYERS))}")
    return cls


def create_layer(param, top_rewritten=False):
    """A new layer for LayerParameter ``param`` (engine chosen as Caffe does;
    ``top_rewritten``: see ``choose_class``; the layer keeps it, ``Layer.top_rewritten``)."""
    _load_all()
    layer = choose_class(param, top_rewritten)(param)
    if top_rewritten:
        layer.top_rewritten = True
    return layer
