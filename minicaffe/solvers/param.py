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

from .. import log, protoio
from ..errors import ConfigError
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
