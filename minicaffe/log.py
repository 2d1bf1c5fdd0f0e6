"""glog-shaped logging, so Caffe's log tools read minicaffe's logs.

Lines look like Caffe's: ``I1122 09:10:11.123456 12345 solver.py:123] message``.
``init_log`` attaches a stderr handler (and optionally a file); the level
follows ``GLOG_minloglevel`` (0 INFO, 1 WARNING, 2 ERROR) unless given.
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


def _ensure_handler():
    global _default_handler
    if _default_handler is None and not _logger.handlers:
        _default_handler = logging.StreamHandler(sys.stderr)
        _default_handler.setFormatter(GlogFormatter())
        _logger.addHandler(_default_handler)
        lvl = int(os.environ.get("GLOG_minloglevel", "1"))
        _logger.setLevel(_LEVELS.get(lvl, logging.WARNING))


def init_log(level=None, log_file=None, stream=None):
    """Log to ``stream`` (stderr) at ``level`` (default from GLOG_minloglevel, else INFO)
    and, if given, also to ``log_file``."""
    global _default_handler
    for h in list(_logger.handlers):
        _logger.removeHandler(h)
        if isinstance(h, logging.FileHandler):
            h.close()
    _default_handler = logging.StreamHandler(stream or sys.stderr)
    _default_handler.setFormatter(GlogFormatter())
    _logger.addHandler(_default_handler)
    if log_file:
        fh = LogFile(log_file)
        fh.setFormatter(GlogFormatter())
        _logger.addHandler(fh)
    if level is None:
        level = _LEVELS.get(int(os.environ.get("GLOG_minloglevel", "0")), logging.INFO)
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
