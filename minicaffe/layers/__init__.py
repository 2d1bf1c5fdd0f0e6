"""Built-in layers, one module per family; importing registers them all."""
from . import data, vision, neuron, common, loss, normalization, cudnn_layers  # noqa: F401

_OPTIONAL = ["recurrent", "python_layer", "data_layers"]
for _name in _OPTIONAL:
    try:
        __import__(f"{__name__}.{_name}")
    except ModuleNotFoundError as _e:  # a family not written yet
        if _e.name != f"{__name__}.{_name}":
            raise
