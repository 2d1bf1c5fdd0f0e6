"""Reading a SolverParameter: prototxt, YAML or a message, upgraded as Caffe does.

- The deprecated ``solver_type`` enum becomes the ``type`` string
  (Caffe's ``UpgradeSolverType``); giving both is an error.
- ``snapshot_prefix`` (Caffe's ``UpgradeSnapshotPrefixProperty``): when the solver
  comes from a file and gives no prefix, the prefix is the solver file's path
  without its extension; when the prefix names an existing directory, the solver
  file's stem is appended.  Snapshot files are ``PREFIX_iter_N.caffemodel``,
  relative to the working directory (Caffe's ``Solver::SnapshotFilename``).
"""
import os

from ..core import log, protoio
from ..core.errors import ConfigError
from ..proto import caffe_pb2

_SP = caffe_pb2.SolverParameter
SOLVER_TYPE_NAMES = {
    _SP.SGD: "SGD",
    _SP.NESTEROV: "Nesterov",
    _SP.ADAGRAD: "AdaGrad",
    _SP.RMSPROP: "RMSProp",
    _SP.ADADELTA: "AdaDelta",
    _SP.ADAM: "Adam",
}


def upgrade_solver_type(param, source="solver"):
    """Caffe's UpgradeSolverAsNeeded: ``solver_type: ADAM`` -> ``type: "Adam"``."""
    if not param.HasField("solver_type"):
        return False
    if param.HasField("type"):
        raise ConfigError(f"{source}: the old solver_type field (enum) and the new type field "
                          "(string) cannot both be given")
    log.info("Attempting to upgrade input file specified using deprecated "
             "'solver_type' field (enum)': %s", source)
    param.type = SOLVER_TYPE_NAMES[param.solver_type]
    param.ClearField("solver_type")
    log.info("Successfully upgraded file specified using deprecated "
             "'solver_type' field (enum) to 'type' field (string).")
    return True


def upgrade_snapshot_prefix(param, param_file):
    """Caffe's UpgradeSnapshotPrefixProperty (a prefix from the solver file's name)."""
    stem_path = os.path.splitext(str(param_file))[0]
    if not param.HasField("snapshot_prefix"):
        param.snapshot_prefix = stem_path
        log.info("snapshot_prefix was not specified and is set to %s", param.snapshot_prefix)
    elif param.snapshot_prefix and os.path.isdir(param.snapshot_prefix):
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, os.path.basename(stem_path))
        log.info("snapshot_prefix was a directory and is replaced to %s", param.snapshot_prefix)


# field: (the test a value must pass, what it must be); only fields given are checked
_RANGES = {
    "max_iter": (lambda v: v >= 0, ">= 0"),
    "display": (lambda v: v >= 0, ">= 0 (0: no display)"),
    "snapshot": (lambda v: v >= 0, ">= 0 (0: no periodic snapshots)"),
    "test_interval": (lambda v: v >= 0, ">= 0"),
    "base_lr": (lambda v: v >= 0, ">= 0 (a negative rate climbs the loss)"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "momentum": (lambda v: v >= 0, ">= 0"),
    "momentum2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "delta": (lambda v: v >= 0, ">= 0"),
    "power": (lambda v: v >= 0, ">= 0"),
    "clip_gradients": (lambda v: v >= 0 or v == -1, ">= 0 (or -1, the default: no clipping)"),
}


def check_solver_param(param, source="solver"):
    """One line naming the file and the field for a value no training can use (Caffe
    trains with them and fails later, or silently does nothing)."""
    for field, (ok, what) in _RANGES.items():
        if param.HasField(field) and not ok(getattr(param, field)):
            raise ConfigError(f"{source}: {field} must be {what}, got {getattr(param, field):g}")
    for i, n in enumerate(param.test_iter):
        if n <= 0:
            raise ConfigError(f"{source}: test_iter must be positive, got {n} (test net #{i})")
    steps = list(param.stepvalue)
    if any(b <= a for a, b in zip(steps, steps[1:])) or (steps and steps[0] < 0):
        raise ConfigError(f"{source}: stepvalue must increase (got {', '.join(map(str, steps))})")


def read_solver_param(source):
    """A SolverParameter from a path (.prototxt/.yaml/.yml), prototxt text or a message.
    Returns (param, path or None)."""
    if isinstance(source, caffe_pb2.SolverParameter):
        p = caffe_pb2.SolverParameter()
        p.CopyFrom(source)
        upgrade_solver_type(p, "<SolverParameter>")
        return p, None
    p = caffe_pb2.SolverParameter()
    text = str(source)
    if isinstance(source, os.PathLike) or os.path.exists(text) or not (
            "\n" in text or ":" in text or "{" in text):
        path = os.fspath(source)
        protoio.read_text(path, p)
        upgrade_solver_type(p, path)
        upgrade_snapshot_prefix(p, path)
        return p, path
    protoio.parse_text(text, p, "<solver text>")
    upgrade_solver_type(p, "<solver text>")
    return p, None
