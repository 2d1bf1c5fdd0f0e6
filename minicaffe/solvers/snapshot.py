"""Solver state files, as Caffe writes them.

BINARYPROTO: ``PREFIX_iter_N.solverstate``, a SolverState message (iter,
learned_net, current_step, history blobs).

HDF5: ``PREFIX_iter_N.solverstate.h5`` with int datasets ``iter`` and ``current_step``
(one element, rank 1, as Caffe's ``hdf5_save_int`` writes them; rank 0 is read too), a
string dataset ``learned_net`` and a group ``history`` of float datasets ``0``, ``1``,
... (Caffe's ``SnapshotSolverStateToHDF5``).

Both formats also carry minicaffe's ResumeState (SolverState.resume, field 10001; in
HDF5 the serialized message as the uint8 dataset ``minicaffe_resume``): the training
thread's generator and each data layer's position, so a resumed run reads what the
uninterrupted one would have.  Caffe's readers skip it; a file without it still loads.

Every file is written under a temporary name and renamed into place, so a crash
never leaves a truncated snapshot.
"""
import os

import numpy as np

from ..core import fileio, protoio
from ..core.errors import MinicaffeError
from ..proto import caffe_pb2


class SolverStateData:
    """What a solver state file holds: iter, learned_net, current_step, history
    (a list of (shape, numpy array)) and minicaffe's ``resume`` (a ResumeState, or None
    for a file Caffe wrote)."""

    def __init__(self, iter_=0, learned_net="", current_step=0, history=(), resume=None):
        self.iter = int(iter_)
        self.learned_net = learned_net
        self.current_step = int(current_step)
        self.history = list(history)
        self.resume = resume


# -- minicaffe's ResumeState: generators and data positions ----------------------------------
def rng_to_proto(state, msg):
    """numpy's RandomState.get_state() tuple into an RNGState message."""
    _, key, pos, has_gauss, cached = state
    msg.key.extend(np.asarray(key, np.uint32).tolist())
    msg.pos, msg.has_gauss, msg.cached_gaussian = int(pos), bool(has_gauss), float(cached)
    return msg


def rng_from_proto(msg):
    """The RandomState.set_state() tuple of an RNGState message."""
    return ("MT19937", np.asarray(msg.key, np.uint32), msg.pos, int(msg.has_gauss),
            msg.cached_gaussian)


_RNG_FIELDS = ("rng", "shuffle_rng")
_ARRAY_FIELDS = ("order", "file_order")


def position_to_proto(position, msg):
    """A data layer's position (a dict of DataPosition's field names) into ``msg``."""
    for key, value in position.items():
        if key in _RNG_FIELDS:
            rng_to_proto(value, getattr(msg, key))
        elif key in _ARRAY_FIELDS:
            getattr(msg, key).extend(np.asarray(value, np.int64).tolist())
        else:
            setattr(msg, key, int(value))
    return msg


def position_from_proto(msg):
    """The position dict of a DataPosition message (the fields it holds)."""
    out = {}
    for field, value in msg.ListFields():
        if field.name in _RNG_FIELDS:
            out[field.name] = rng_from_proto(value)
        elif field.name in _ARRAY_FIELDS:
            out[field.name] = np.asarray(value, np.int64)
        elif field.name not in ("net", "layer"):
            out[field.name] = int(value)
    return out


RESUME_DATASET = "minicaffe_resume"


def _h5py(path):
    try:
        import h5py
    except ImportError:
        raise MinicaffeError(f"{path}: HDF5 snapshots need h5py "
                             "(pip install \".[data]\")") from None
    return h5py


def write_binary_state(path, state):
    msg = caffe_pb2.SolverState()
    msg.iter = state.iter
    msg.learned_net = state.learned_net
    msg.current_step = state.current_step
    from ..core.blob import blob_proto_bytes
    for shape, arr in state.history:
        msg.history.add().ParseFromString(blob_proto_bytes(shape, arr))
    if state.resume is not None:
        msg.resume.CopyFrom(state.resume)
    protoio.write_binary(path, msg)


def _shape_of(bp):
    if bp.HasField("num") or bp.HasField("channels") or bp.HasField("height") \
            or bp.HasField("width"):
        return (bp.num, bp.channels, bp.height, bp.width)
    return tuple(bp.shape.dim)


def read_binary_state(path):
    msg = caffe_pb2.SolverState()
    protoio.read_binary(path, msg)
    history = []
    for bp in msg.history:
        if len(bp.double_data):
            arr = np.asarray(bp.double_data, dtype=np.float64)
        else:
            arr = np.asarray(bp.data, dtype=np.float32)
        history.append((_shape_of(bp), arr))
    return SolverStateData(msg.iter, msg.learned_net if msg.HasField("learned_net") else "",
                           msg.current_step, history,
                           msg.resume if msg.HasField("resume") else None)


def _write_string(h5py, f, name, value):
    # H5LTmake_dataset_string: a scalar, null-terminated fixed-length string
    raw = value.encode("utf-8")
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(len(raw) + 1)
    tid.set_strpad(h5py.h5t.STR_NULLTERM)
    space = h5py.h5s.create(h5py.h5s.SCALAR)
    ds = h5py.h5d.create(f.id, name.encode(), tid, space)
    ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(raw + b"\0", dtype=f"S{len(raw) + 1}"),
             mtype=tid)


def write_hdf5_state(path, state):
    h5py = _h5py(path)
    with fileio.atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        # hdf5_save_int: one-element rank-1 int datasets, as Caffe writes them
        f.create_dataset("iter", data=np.array([state.iter], np.int32))
        _write_string(h5py, f, "learned_net", state.learned_net)
        f.create_dataset("current_step", data=np.array([state.current_step], np.int32))
        g = f.create_group("history")
        for i, (shape, arr) in enumerate(state.history):
            g.create_dataset(str(i), data=np.asarray(arr).reshape(shape))
        if state.resume is not None:  # minicaffe's addition; Caffe reads only the above
            f.create_dataset(RESUME_DATASET, data=np.frombuffer(
                state.resume.SerializeToString(), np.uint8))


def _h5_int(dataset):
    """An int dataset's value: Caffe writes rank 1 (one element), older minicaffe rank 0."""
    return int(np.asarray(dataset[()]).reshape(-1)[0])


def read_hdf5_state(path):
    h5py = _h5py(path)
    if not os.path.exists(path):
        raise MinicaffeError(f"{path}: no such file")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise MinicaffeError(f"{path}: not a readable HDF5 solver state ({e})") from None
    with f:
        for key in ("iter", "history"):
            if key not in f:
                raise MinicaffeError(f"{path}: not a Caffe HDF5 solver state (no '{key}')")
        learned = ""
        if "learned_net" in f:
            v = f["learned_net"][()]
            learned = v.decode("utf-8").rstrip("\0") if isinstance(v, bytes) else str(v)
        current_step = _h5_int(f["current_step"]) if "current_step" in f else 0
        g = f["history"]
        n = len(g)
        history = []
        for i in range(n):
            if str(i) not in g:
                raise MinicaffeError(f"{path}: history dataset '{i}' is missing")
            arr = np.asarray(g[str(i)])
            history.append((arr.shape, arr.reshape(-1)))
        resume = None
        if RESUME_DATASET in f:
            resume = caffe_pb2.ResumeState.FromString(np.asarray(f[RESUME_DATASET]).tobytes())
        return SolverStateData(_h5_int(f["iter"]), learned, current_step, history, resume)


def read_state(path):
    """A SolverStateData from a .solverstate or .solverstate.h5 (chosen by the
    ``.h5`` suffix, as Caffe's Solver::Restore does)."""
    path = os.fspath(path)
    if path.endswith(".h5"):
        return read_hdf5_state(path)
    return read_binary_state(path)


def shapes_compatible(a, b):
    """Equal shapes, or equal once padded to Caffe's legacy 4-D (num, channels,
    height, width) form: BVLC files store history as (1, 1, 500, 800) for a
    (500, 800) weight."""
    a, b = tuple(a), tuple(b)
    if a == b:
        return True
    if len(a) <= 4 and len(b) <= 4:
        return (1,) * (4 - len(a)) + a == (1,) * (4 - len(b)) + b
    return False


def resolve_learned_net(learned_net, state_path):
    """Where the weights a state file names are: as written (relative to the working
    directory, as Caffe reads it), else next to the state file, else the state
    file's own name with .caffemodel (.caffemodel.h5)."""
    state_dir = os.path.dirname(os.path.abspath(state_path))
    candidates = []
    if learned_net:
        candidates += [learned_net, os.path.join(state_dir, learned_net),
                       os.path.join(state_dir, os.path.basename(learned_net))]
    base = os.fspath(state_path)
    if base.endswith(".solverstate.h5"):
        candidates.append(base[: -len(".solverstate.h5")] + ".caffemodel.h5")
    elif base.endswith(".solverstate"):
        candidates.append(base[: -len(".solverstate")] + ".caffemodel")
    for c in candidates:
        if os.path.isfile(c):
            return c
    return None
