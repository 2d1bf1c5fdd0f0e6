"""TensorBoard event files: the run record's scalars, written and read back.

No Caffe counterpart (PyTorch's ``torch.utils.tensorboard``).  ``TensorBoardWriter``
is a Solver observer (a ``Recorder`` whose sink is a tensorboardX ``SummaryWriter``):
the same series as the dashboard (``train/smoothed_loss``, ``train/<output>``, ``test/<output>``,
``lr``, ``speed/images_per_s``...), the run's facts as a text summary ``run/facts`` and
each snapshot as ``run/snapshots``.  One is attached to the root solver when
``SolverParameter.minicaffe_tensorboard_dir`` is set (``minicaffe train --tensorboard
DIR``), so a multi-GPU run writes one file: this module registers ``attach_to`` with
``core/observers.py`` (``import minicaffe`` imports it), which every Solver runs.  Needs the ``tensorboard`` extra
(tensorboardX); without it the solver stops with one line saying what to install.

``read_events(path)`` reads an event file (or the newest one in a folder) back into a
RunRecord with no TensorFlow: TFRecord framing (length, masked CRC-32C of the length,
data, masked CRC-32C of the data; both checked) and tensorboardX's ``Event`` message.
"""
import glob
import os
import struct

from ..core import observers
from ..core.errors import ConfigError, MinicaffeError
from .record import Recorder, RunRecord

INSTALL = 'pip install ".[tensorboard]" (tensorboardX)'


def _summary_writer():
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError(f"TensorBoard event files (--tensorboard, minicaffe_tensorboard_dir) "
                          f"need tensorboardX: {INSTALL}") from None
    return SummaryWriter


class _EventSink:
    """What a Recorder writes to, turned into scalar and text summaries."""

    def __init__(self, logdir):
        self.logdir = os.fspath(logdir)
        self._cls = _summary_writer()
        self._writer = None
        self.facts = {}
        self.max_iter = None

    @property
    def writer(self):
        if self._writer is None:
            self._writer = self._cls(logdir=self.logdir, flush_secs=5)
        return self._writer

    def add(self, name, iteration, value):
        if value is not None:
            self.writer.add_scalar(name, float(value), int(iteration))

    def set_fact(self, key, value):
        self.facts[key] = value

    def add_snapshot(self, iteration, path):
        self.writer.add_text("run/snapshots", str(path), int(iteration))

    def set_status(self, status, iteration=None):
        if status == "training":
            rows = "\n".join(f"| {k} | {v} |" for k, v in self.facts.items())
            self.writer.add_text("run/facts", "| fact | value |\n|---|---|\n" + rows,
                                 int(iteration or 0))
            return
        self.writer.add_text("run/status", status, int(iteration or 0))
        self.writer.close()
        self._writer = None


class TensorBoardWriter(Recorder):
    """A Solver observer writing the run's scalars into event files under ``logdir``."""

    def __init__(self, logdir, solver=None, devices=None):
        self.logdir = os.fspath(logdir)
        try:
            os.makedirs(self.logdir, exist_ok=True)
        except OSError as e:
            raise MinicaffeError(f"{self.logdir}: cannot make the TensorBoard folder "
                                 f"({e.strerror})") from None
        super().__init__(_EventSink(self.logdir), solver, devices)


def attach_to(solver):
    """A writer on ``solver`` when it is the root and its ``minicaffe_tensorboard_dir``
    is set (run by every Solver's set-up: core/observers.py)."""
    logdir = solver.param.minicaffe_tensorboard_dir
    if solver.root and logdir:
        TensorBoardWriter(logdir, solver)      # attaches itself


observers.register(attach_to)


# -- reading back -------------------------------------------------------------------------
def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_records(path):
    """The data of each TFRecord in ``path``; a bad length or checksum is an error."""
    out = []
    with open(path, "rb") as f:
        while True:
            head = f.read(12)
            if not head:
                return out
            if len(head) < 12:
                raise MinicaffeError(f"{path}: truncated event file")
            n, crc = struct.unpack("<QI", head)
            if masked_crc(head[:8]) != crc:
                raise MinicaffeError(f"{path}: corrupt event file (length checksum)")
            data = f.read(n)
            tail = f.read(4)
            if len(data) < n or len(tail) < 4:
                raise MinicaffeError(f"{path}: truncated event file")
            if masked_crc(data) != struct.unpack("<I", tail)[0]:
                raise MinicaffeError(f"{path}: corrupt event file (data checksum)")
            out.append(data)


def event_files(path):
    """The event files of ``path`` (a file, or a folder: its files, oldest first)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = glob.glob(os.path.join(path, "**", "*tfevents*"), recursive=True)
        if not files:
            raise MinicaffeError(f"{path}: no TensorBoard event file in this folder")
        return sorted(files, key=os.path.getmtime)
    return [path]


def _text(value):
    t = value.tensor
    if t.string_val:
        return t.string_val[0].decode(errors="replace")
    return ""


def read_events(path):
    """A RunRecord of the scalars (and facts, snapshots, status) in event files."""
    try:
        from tensorboardX.proto import event_pb2
    except ImportError:
        raise MinicaffeError(f"reading event files needs tensorboardX: {INSTALL}") from None
    files = event_files(path)
    record = RunRecord(source=os.fspath(path))
    record.status = "finished?"
    for fname in files:
        for data in read_records(fname):
            ev = event_pb2.Event.FromString(data)
            if not ev.HasField("summary"):
                continue
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    record.add(v.tag, ev.step, v.simple_value)
                elif v.tag.startswith("run/facts"):
                    for line in _text(v).splitlines()[2:]:
                        cells = [c.strip() for c in line.strip().strip("|").split("|")]
                        if len(cells) == 2:
                            record.set_fact(*cells)
                elif v.tag.startswith("run/snapshots"):
                    record.add_snapshot(ev.step, _text(v))
                elif v.tag.startswith("run/status"):
                    record.set_status(_text(v), ev.step)
                elif v.tensor.float_val:
                    record.add(v.tag, ev.step, v.tensor.float_val[0])
    if "max_iter" in record.facts:
        try:
            record.max_iter = int(record.facts["max_iter"])
        except ValueError:
            pass
    return record
