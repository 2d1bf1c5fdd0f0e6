"""User-facing errors.

A :class:`MinicaffeError` is a mistake in what the user gave us (a bad prototxt, a
missing file, impossible shapes).  Its message is one line that names the file and
line or the layer; the command line prints it without a traceback and exits 1.
"""


class MinicaffeError(Exception):
    """An error in the user's input, reported as one clear line."""


class ConfigError(MinicaffeError):
    """A net or solver definition that cannot be used as written."""


class WaitInterrupted(KeyboardInterrupt):
    """A stop was asked for (a signal) while this thread waited on another one (the data
    prefetch): the solver stops as after any stop request, and elsewhere it is a Ctrl-C."""


class LayerError(MinicaffeError):
    """A layer was given parameters or blobs it cannot work with."""

    def __init__(self, layer_name, layer_type, message):
        self.layer_name = layer_name
        self.layer_type = layer_type
        super().__init__(f"layer '{layer_name}' ({layer_type}): {message}")


_failure_classes = {}


def layer_failure(layer_name, layer_type, exc, message=None):
    """The exception to raise when a layer's code failed with ``exc``: a LayerError (one
    line naming the layer, so the command line prints it without a traceback) that is
    also of ``exc``'s own type, so code that catches that type still does (pycaffe's
    ``test_python_layer`` expects a Python layer's RuntimeError as a RuntimeError).
    Raise it ``from exc`` to keep the original traceback as its cause."""
    if message is None:
        message = f"{type(exc).__name__}: {' '.join(str(exc).split()) or 'no message'}"
    cls = type(exc)
    failure = _failure_classes.get(cls)
    if failure is None:
        try:
            failure = type(cls.__name__, (cls, LayerError),
                           {"__init__": LayerError.__init__, "__str__": BaseException.__str__,
                            "__module__": cls.__module__})
        except TypeError:  # a type that cannot be subclassed: a plain LayerError
            failure = LayerError
        _failure_classes[cls] = failure
    e = failure.__new__(failure, message)
    LayerError.__init__(e, layer_name, layer_type, message)
    return e
