"""Reading and writing Caffe's protobuf files: prototxt text, binary, and YAML.

Errors are one line naming the file (and line and column for text).
"""
import os

from google.protobuf import text_format, json_format
from google.protobuf.message import DecodeError

from . import fileio
from .errors import ConfigError, MinicaffeError


def _read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise MinicaffeError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise MinicaffeError(f"{path}: is a directory, not a file") from None
    except OSError as e:
        raise MinicaffeError(f"{path}: cannot read ({e.strerror})") from None


def parse_text(text, message, source="<string>"):
    try:
        text_format.Merge(text, message, allow_unknown_field=False)
    except text_format.ParseError as e:
        line, col = e.GetLine(), e.GetColumn()
        msg = str(e)
        # protobuf prefixes the message with "line:col : "; keep only the words
        if line is not None and msg.startswith(f"{line}:"):
            msg = msg.split(" : ", 1)[-1]
        where = f"{source}:{line}:{col}" if line is not None else source
        raise ConfigError(f"{where}: {msg}") from None
    return message


def parse_yaml(text, message, source="<string>"):
    import yaml
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise ConfigError(f"{where}: {getattr(e, 'problem', e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of field names")
    try:
        json_format.ParseDict(_yaml_to_proto_dict(data, message.DESCRIPTOR), message)
    except json_format.ParseError as e:
        raise ConfigError(f"{source}: {e}") from None
    return message


def _yaml_to_proto_dict(data, descriptor=None):
    """YAML keys match the prototxt field names one to one; json_format accepts them.
    As in prototxt, a repeated field given once may be written without a list
    (``bottom: data``, ``include: {phase: TRAIN}``)."""
    if descriptor is None or not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        field = descriptor.fields_by_name.get(key) or descriptor.fields_by_camelcase_name.get(key)
        if field is None:
            out[key] = value
            continue
        repeated = getattr(field, "is_repeated", None)
        if repeated is None:  # protobuf < 5.29
            repeated = field.label == field.LABEL_REPEATED
        if repeated and not isinstance(value, list):
            value = [value]
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            if repeated:
                value = [_yaml_to_proto_dict(v, field.message_type) for v in value]
            else:
                value = _yaml_to_proto_dict(value, field.message_type)
        out[key] = value
    return out


def read_text(path, message):
    """Parse a prototxt (or .yaml/.yml) file into ``message``."""
    raw = _read_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (binary data where prototxt was expected)") from None
    if str(path).endswith((".yaml", ".yml")):
        return parse_yaml(text, message, str(path))
    return parse_text(text, message, str(path))


def read_binary(path, message):
    raw = _read_bytes(path)
    try:
        message.ParseFromString(raw)
    except DecodeError as e:
        raise MinicaffeError(f"{path}: not a valid binary {message.DESCRIPTOR.name} ({e})") from None
    return message


def read_any(path, message):
    """Text or binary, by content: binary protobuf is rarely valid UTF-8 text."""
    raw = _read_bytes(path)
    if str(path).endswith((".yaml", ".yml")):
        return parse_yaml(raw.decode("utf-8"), message, str(path))
    try:
        text = raw.decode("utf-8")
        if "\x00" not in text:
            return parse_text(text, message, str(path))
    except UnicodeDecodeError:
        pass
    return read_binary(path, message)


def atomic_write(path, data, mode="wb"):
    """Write to a temporary file in the same folder, then rename into place (fileio)."""
    with fileio.atomic_path(path) as tmp, open(tmp, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_binary(path, message):
    atomic_write(path, message.SerializeToString())


def write_text(path, message):
    atomic_write(path, text_format.MessageToString(message), mode="w")
