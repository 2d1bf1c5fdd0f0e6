"""glog-shaped logging, so Caffe's log tools read minicaffe's logs.

Lines look like Caffe's: ``I1122 09:10:11.123456 12345 solver.py:123] message``.
``init_log`` attaches a stderr handler (and optionally a file); the level
follows ``GLOG_minloglevel`` (0 INFO, 1 WARNING, 2 ERROR) unless given.

Three volumes on the terminal (warnings and errors always show):

- ``"caffe"``: every INFO line, as Caffe prints them (the ``minicaffe`` command's default,
  and ``caffe.init_log()``'s): the solver and net definitions, each layer's set-up, progress.
- ``"normal"``: the Python API's default (a first log call without ``init_log``): INFO
  lines, the solver's progress among them, as pycaffe prints them, but the net set-up report
  (the solver and net definitions, each layer's set-up lines: Caffe's ``Net::Init``) only at
  verbose level 1 (``GLOG_v=1``, glog's variable, or ``init_log(verbose=1)``).
- ``"quiet"`` (``minicaffe train --quiet``): the lines Caffe's ``parse_log.py`` reads (each
  display line: iteration, loss, lr, train/test net outputs, "Testing net") and the result
  (``Optimization Done.``, snapshots, ``minicaffe test``'s scores, ``time``'s averages).
  A ``--log`` file still gets every line.
"""
import logging
import os
import sys
import threading
import time

_logger = logging.getLogger("minicaffe")
_logger.propagate = False
_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.CRITICAL}


class GlogFormatter(logging.Formatter):
    def format(self, record):
        t = record.created
        lt = time.localtime(t)
        usec = int((t - int(t)) * 1e6)
        head = "%s%02d%02d %02d:%02d:%02d.%06d %5d %s:%d] " % (
            record.levelname[0], lt.tm_mon, lt.tm_mday, lt.tm_hour, lt.tm_min, lt.tm_sec,
            usec, getattr(record, "thread_native", threading.get_native_id()),
            record.filename, record.lineno)
        return head + record.getMessage()


class _ThreadFilter(logging.Filter):
    def filter(self, record):
        record.thread_native = threading.get_native_id()
        return True


_logger.addFilter(_ThreadFilter())

VOLUMES = ("quiet", "normal", "caffe")
# the start of the INFO lines that quiet mode keeps (parse_log.py's lines and the result)
_QUIET_KEEP = ("Iteration ", "    Train net output", "    Test net output", "Test loss:",
               "Optimization Done.", "Optimization stopped early.", "Snapshotting",
               "Stopped by ", "Resuming from ")
_SOLVER_SETUP = ("Initializing solver from parameters", "Creating training net",
                 "Creating test net", "Solver scaffolding done.")


def _is_result(record):
    return getattr(record, "result", False) or record.getMessage().startswith(_QUIET_KEEP)


def _is_net_setup(record):
    """Caffe's ``Net::Init`` report (net.py's INFO lines but debug_info's, which start with
    ``"    ["``) and the solver's definition dump."""
    if record.filename == "net.py":
        return not record.getMessage().startswith("    [")
    return record.filename == "solver.py" and record.getMessage().startswith(_SOLVER_SETUP)


class VolumeFilter(logging.Filter):
    """Keeps the INFO lines of a volume (see the module docstring) on one handler."""

    def __init__(self, volume="caffe", verbose=0):
        super().__init__()
        if volume not in VOLUMES:
            raise ValueError(f"log volume must be one of {', '.join(VOLUMES)} (got {volume!r})")
        self.volume, self.verbose = volume, verbose

    def filter(self, record):
        if record.levelno >= logging.WARNING or self.volume == "caffe":
            return True
        if self.volume == "quiet":
            return _is_result(record)
        return self.verbose >= 1 or not _is_net_setup(record)


def glog_verbose():
    """glog's verbose level from ``GLOG_v`` (0 when unset or not a number)."""
    try:
        return int(os.environ.get("GLOG_v", "0") or 0)
    except ValueError:
        return 0


class LogFile(logging.FileHandler):
    """The ``--log`` file.  Its first failed write (a full disk) is said once, as a warning
    on the other handlers, and ends the writes to it; ``failure`` keeps the error so the
    command can exit non-zero (logging's own handler would print a traceback per line)."""

    failure = None

    def emit(self, record):
        if self.failure is None:
            super().emit(record)

    def flush(self):
        try:
            super().flush()
        except OSError as e:
            self._failed(e)

    def close(self):
        try:
            super().close()
        except OSError as e:  # what was still buffered could not be written either
            self._failed(e)

    def handleError(self, record):
        self._failed(sys.exc_info()[1])

    def _failed(self, error):
        if self.failure is not None:
            return
        self.failure = error
        why = getattr(error, "strerror", None) or error
        warn = _logger.makeRecord(_logger.name, logging.WARNING, "log.py", 0,
                                  "cannot write the log file %s (%s); it is incomplete from "
                                  "here on", (self.baseFilename, why), None)
        for h in _logger.handlers:
            if h is not self:
                h.handle(warn)


def log_file_failure():
    """(path, error) of a log file that could not be written, else None."""
    for h in _logger.handlers:
        if isinstance(h, LogFile) and h.failure is not None:
            return h.baseFilename, h.failure
    return None
_default_handler = None


def _minloglevel(default):
    try:
        return _LEVELS.get(int(os.environ.get("GLOG_minloglevel", default)), logging.WARNING)
    except ValueError:
        return _LEVELS[default]


def _ensure_handler():
    """The Python API's logging when nothing called ``init_log``: INFO at the "normal"
    volume, as pycaffe logs (its net set-up report behind ``GLOG_v=1``)."""
    global _default_handler
    if _default_handler is None and not _logger.handlers:
        _default_handler = logging.StreamHandler(sys.stderr)
        _default_handler.setFormatter(GlogFormatter())
        _default_handler.addFilter(VolumeFilter("normal", glog_verbose()))
        _logger.addHandler(_default_handler)
        _logger.setLevel(_minloglevel(0))


def result(msg, *args):
    """An INFO line that is a command's result: quiet mode keeps it."""
    _ensure_handler()
    _logger.info(msg, *args, stacklevel=2, extra={"result": True})


def init_log(level=None, log_file=None, stream=None, volume="caffe", verbose=None):
    """Log to ``stream`` (stderr) at ``level`` (default from GLOG_minloglevel, else INFO)
    and, if given, also to ``log_file``.  ``volume`` ("caffe", "normal" or "quiet") and
    ``verbose`` (default ``GLOG_v``) choose the INFO lines the stream shows; the file gets
    every line of the level."""
    global _default_handler
    for h in list(_logger.handlers):
        _logger.removeHandler(h)
        if isinstance(h, logging.FileHandler):
            h.close()
    _default_handler = logging.StreamHandler(stream or sys.stderr)
    _default_handler.setFormatter(GlogFormatter())
    _default_handler.addFilter(VolumeFilter(volume, glog_verbose() if verbose is None
                                            else int(verbose)))
    _logger.addHandler(_default_handler)
    if log_file:
        fh = LogFile(log_file)
        fh.setFormatter(GlogFormatter())
        _logger.addHandler(fh)
    if level is None:
        level = _minloglevel(0)
    _logger.setLevel(level)


def save_config():
    """The logger's handlers and level, for ``restore_config``: an application (or a test)
    that runs ``cli.main`` in its own process gets its logging back afterwards."""
    return list(_logger.handlers), _logger.level, _default_handler


def restore_config(saved):
    """Put back what ``save_config`` returned; log files opened since are closed."""
    global _default_handler
    handlers, level, default = saved
    for h in list(_logger.handlers):
        _logger.removeHandler(h)
        if isinstance(h, logging.FileHandler) and h not in handlers:
            h.close()
    for h in handlers:
        _logger.addHandler(h)
    _logger.setLevel(level)
    _default_handler = default


def info(msg, *args):
    _ensure_handler()
    _logger.info(msg, *args, stacklevel=2)


def warning(msg, *args):
    _ensure_handler()
    _logger.warning(msg, *args, stacklevel=2)


def error(msg, *args):
    _ensure_handler()
    _logger.error(msg, *args, stacklevel=2)


def is_enabled(level=logging.INFO):
    _ensure_handler()
    return _logger.isEnabledFor(level)


logger = _logger
