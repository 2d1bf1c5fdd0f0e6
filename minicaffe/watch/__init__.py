"""Watch a run as it trains: the run record, the dashboard page, TensorBoard event
files, ``minicaffe plot`` and the terminal's progress line.

No single Caffe counterpart: NVIDIA DIGITS's job page, Caffe's
``tools/extra/parse_log.py`` and ``plot_training_log.py``, PyTorch's TensorBoard writer.
Everything here reads what the solver already computed for its log lines, through the
Solver's observer hook (``solver.observers``; see record.py); no layer knows about it.

- ``serve(solver_or_path, port=0, host="127.0.0.1")`` -- the live dashboard (server.py);
- ``RunRecord``, ``Recorder`` -- the scalars and facts of a run (record.py);
- ``read_run(path)`` -- a record from a Caffe/minicaffe log or TensorBoard events;
- ``TensorBoardWriter`` -- event files (tensorboard.py, the ``tensorboard`` extra);
- ``plot_log`` -- Caffe's plot_training_log.py charts (plot.py, the ``plot`` extra).
"""
from .record import Recorder, RunRecord


def serve(run, port=0, host="127.0.0.1", token=None, require_token=None, devices=None):
    """Serve the dashboard of ``run`` (see server.serve); returns the Dashboard."""
    from .server import serve as _serve
    return _serve(run, port, host, token, require_token, devices)


def read_run(path):
    from .server import read_run as _read_run
    return _read_run(path)


__all__ = ["RunRecord", "Recorder", "serve", "read_run"]
