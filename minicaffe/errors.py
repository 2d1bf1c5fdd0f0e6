"""User-facing errors.

A :class:`MinicaffeError` is a mistake in what the user gave us (a bad prototxt, a
missing file, impossible shapes).  Its message is one line that names the file and
line or the layer; the command line prints it without a traceback and exits 1.
"""


class MinicaffeError(Exception):
    """An error in the user's input, reported as one clear line."""


class ConfigError(MinicaffeError):
    """A net or solver definition that cannot be used as written."""


class LayerError(MinicaffeError):
    """A layer was given parameters or blobs it cannot work with."""

    def __init__(self, layer_name, layer_type, message):
        self.layer_name = layer_name
        self.layer_type = layer_type
        super().__init__(f"layer '{layer_name}' ({layer_type}): {message}")
