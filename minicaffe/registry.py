"""One registry of layer classes, keyed by the prototxt ``type`` string."""
import difflib

from .errors import ConfigError

_LAYERS = {}


def register_layer(type_name):
    """Class decorator: ``@register_layer('ReLU')``."""
    def deco(cls):
        if type_name in _LAYERS and _LAYERS[type_name] is not cls:
            raise ValueError(f"layer type '{type_name}' registered twice")
        cls.type = type_name
        _LAYERS[type_name] = cls
        return cls
    return deco


def _load_all():
    # Importing the layer package registers every built-in layer.
    from . import layers  # noqa: F401


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


def create_layer(param):
    """A new layer for LayerParameter ``param``."""
    return layer_class(param.type, param.name)(param)
