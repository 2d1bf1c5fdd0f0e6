"""Read a Caffe or minicaffe training log (glog text): train and test tables, and a
RunRecord for the dashboard.

Caffe's counterpart: ``tools/extra/parse_log.py`` (and ``extract_seconds.py``).
``parse_lines``/``parse_log`` give (train_rows, test_rows) exactly as Caffe's script
builds them (each row: NumIters, Seconds since the "Solving" line, LearningRate, one
column per net output); ``tools/parse_log.py`` writes them as CSV.  This version also
reads NaN/inf values and logs that cross a new year.

``read_log(path)`` turns a log into a ``RunRecord`` (minicaffe/watch/record.py) with the
series the dashboard draws: ``train/smoothed_loss`` (the loss of the display line),
``train/<output>``, ``test/<output>``, ``lr``, ``speed/iter_per_s``, and the facts a log
states (net name, lr policy, CPU or GPU ids, snapshots written, how the run ended).
"""
import datetime
import os
import re
from collections import OrderedDict

# The patterns of Caffe's tools/extra/parse_log.py.
REGEX_ITERATION = re.compile(r"Iteration (\d+)")
REGEX_TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+|[-+]?nan|[-+]?inf)")
REGEX_TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+|[-+]?nan|[-+]?inf)")
REGEX_LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")
# glog's line header: LMMDD HH:MM:SS.uuuuuu
REGEX_GLOG_TIME = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6})\b")


class _Clock:
    """Line timestamps as datetimes: glog omits the year, so take the file's and
    step it forward when the month goes backwards (a run across New Year)."""

    def __init__(self, year):
        self.year = year
        self.last_month = None

    def __call__(self, line):
        m = REGEX_GLOG_TIME.match(line)
        if not m:
            return None
        month, day, hour, minute, second, usec = (int(g) for g in m.groups())
        if self.last_month is not None and month < self.last_month:
            self.year += 1
        self.last_month = month
        return datetime.datetime(self.year, month, day, hour, minute, second, usec)


def _log_year(path):
    try:
        return datetime.datetime.fromtimestamp(os.path.getmtime(path)).year
    except OSError:
        return datetime.datetime.now().year


def parse_lines(lines, year=None):
    """(train_rows, test_rows) from log lines; rows are OrderedDicts."""
    clock = _Clock(year or datetime.datetime.now().year)
    lines = list(lines)
    start = None
    for line in lines:
        if "Solving" in line:
            start = clock(line.strip())
            break
    clock = _Clock(clock.year)
    iteration = -1
    learning_rate = float("nan")
    train, test = [], []
    train_row = test_row = None
    for raw in lines:
        line = raw.strip()
        m = REGEX_ITERATION.search(line)
        if m:
            iteration = float(m.group(1))
        if iteration == -1:
            continue
        when = clock(line)
        if when is None:
            continue  # not a glog line (a progress bar, a stray print)
        if start is None:
            start = when
        seconds = (when - start).total_seconds()
        m = REGEX_LEARNING_RATE.search(line)
        if m:
            learning_rate = float(m.group(1))
        train_row = _add_output(REGEX_TRAIN_OUTPUT, train_row, train, line, iteration, seconds,
                                learning_rate)
        test_row = _add_output(REGEX_TEST_OUTPUT, test_row, test, line, iteration, seconds,
                               learning_rate)
    for rows, row in ((train, train_row), (test, test_row)):
        if row is not None and (not rows or len(row) == len(rows[0])):
            rows.append(row)
    for rows in (train, test):
        if len(rows) > 1:  # the first lr is printed after the first outputs
            rows[0]["LearningRate"] = rows[1]["LearningRate"]
    return train, test


def _add_output(regex, row, rows, line, iteration, seconds, learning_rate):
    m = regex.search(line)
    if m:
        if row is None or row["NumIters"] != iteration:
            if row is not None:
                rows.append(row)
            row = OrderedDict([("NumIters", iteration), ("Seconds", seconds),
                               ("LearningRate", learning_rate)])
        row[m.group(2)] = float(m.group(3))
    if row is not None and rows and len(row) == len(rows[0]):
        rows.append(row)
        row = None
    return row


def parse_log(path):
    """(train_rows, test_rows) of a log file."""
    with open(path, errors="replace") as f:
        return parse_lines(f, _log_year(path))


# -- a log as a run record (the dashboard of a finished run) -----------------------------------
_NUM = r"([-+]?(?:[\d.]+(?:[eE][-+]?\d+)?|nan|inf))"
REGEX_DISPLAY = re.compile(r"Iteration (\d+) \(" + _NUM + r" iter/s, [^)]*\), loss = " + _NUM)
REGEX_DISPLAY_OLD = re.compile(r"Iteration (\d+), loss = " + _NUM)
REGEX_SOLVING = re.compile(r"Solving (\S+)")
REGEX_POLICY = re.compile(r"Learning Rate Policy: (\S+)")
REGEX_SNAPSHOT = re.compile(r"Snapshotting to (?:binary proto|HDF5) file (\S+)")
REGEX_SNAPSHOT_ITER = re.compile(r"_iter_(\d+)\.caffemodel")
REGEX_LR = re.compile(r"Iteration (\d+), lr = " + _NUM)
REGEX_GPU = re.compile(r"Use GPU with device ID (\d+)|Using GPUs ([\d, ]+)")
REGEX_SOLVER_FIELD = re.compile(r'^(type|base_lr|max_iter|solver_type): "?([^"\s]+)"?\s*$')
_ENDINGS = {"Optimization Done.": "finished", "Optimization stopped early.": "stopped"}


def read_log(path):
    """A RunRecord from a Caffe or minicaffe training log."""
    from .record import RunRecord
    path = os.fspath(path)
    if os.path.isdir(path):
        raise OSError(f"{path}: a folder, not a log file")
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    train, test = parse_lines(lines, _log_year(path))
    record = RunRecord(source=path)
    record.status = "unfinished"
    for row in train:
        it = int(row["NumIters"])
        for k, v in row.items():
            if k not in ("NumIters", "Seconds", "LearningRate"):
                record.add(f"train/{k}", it, v)
    for row in test:
        for k, v in row.items():
            if k not in ("NumIters", "Seconds", "LearningRate"):
                record.add(f"test/{k}", int(row["NumIters"]), v)
    iteration, in_solver_block, found_log = 0, False, False
    for line in lines:
        headed = REGEX_GLOG_TIME.match(line) is not None
        found_log |= headed
        if in_solver_block and not headed:
            m = REGEX_SOLVER_FIELD.match(line.strip())
            if m:
                key = {"solver_type": "type"}.get(m.group(1), m.group(1))
                record.facts.setdefault("solver " + key, m.group(2))
            continue
        in_solver_block = "Initializing solver from parameters" in line
        m = REGEX_ITERATION.search(line)
        if m:
            iteration = int(m.group(1))
        m = REGEX_DISPLAY.search(line)
        if m:
            record.add("train/smoothed_loss", iteration, float(m.group(3)))
            if int(m.group(1)) and float(m.group(2)) > 0:  # Caffe logs 0 iter/s at first
                record.add("speed/iter_per_s", iteration, float(m.group(2)))
        elif REGEX_DISPLAY_OLD.search(line) and "Testing" not in line:
            record.add("train/smoothed_loss", iteration,
                       float(REGEX_DISPLAY_OLD.search(line).group(2)))
        m = REGEX_LR.search(line)
        if m:
            record.add("lr", int(m.group(1)), float(m.group(2)))
        for regex, key in ((REGEX_SOLVING, "net"), (REGEX_POLICY, "lr policy")):
            m = regex.search(line)
            if m:
                record.facts[key] = m.group(1)
        m = REGEX_SNAPSHOT.search(line)
        if m:
            it = REGEX_SNAPSHOT_ITER.search(m.group(1))
            record.add_snapshot(int(it.group(1)) if it else iteration, m.group(1))
        m = REGEX_GPU.search(line)
        if m:
            record.facts["devices"] = "GPU " + (m.group(1) or m.group(2)).strip()
        elif "Use CPU." in line:
            record.facts["devices"] = "CPU"
        for words, status in _ENDINGS.items():
            if words in line:
                record.status = status
        if headed and line[0] == "F":
            record.status = "failed"
    if not found_log:
        raise ValueError(f"{path}: not a Caffe or minicaffe log (no glog line in it)")
    record.iteration = max(record.iteration, iteration)
    if "solver max_iter" in record.facts:
        record.max_iter = int(record.facts["solver max_iter"])
    record.version += 1
    return record
