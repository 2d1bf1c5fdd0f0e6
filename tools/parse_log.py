#!/usr/bin/env python3
"""Turn a Caffe or minicaffe training log into train and test tables (CSV).

    python tools/parse_log.py LOGFILE [OUTPUT_DIR] [--delimiter ,] [--verbose]

writes OUTPUT_DIR/LOGFILE.train and OUTPUT_DIR/LOGFILE.test (the names Caffe's
tools/extra/parse_log.py uses).  Each row is one iteration: NumIters, Seconds
(since the "Solving" line), LearningRate, then one column per net output
("loss", "accuracy", ...).  The line patterns are the ones Caffe's parse_log.py
matches, so a log from either program gives the same tables; this version also
reads NaN/inf values and logs that cross a new year.
"""
import argparse
import csv
import datetime
import os
import re
import sys
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


def write_csv(path, rows, delimiter=","):
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        if rows:
            columns = list(rows[0].keys())
            for r in rows[1:]:
                columns += [k for k in r if k not in columns]
            w = csv.DictWriter(f, fieldnames=columns, delimiter=delimiter, restval="")
            w.writeheader()
            w.writerows(rows)
    os.replace(tmp, path)


def save_csv_files(logfile, output_dir, train, test, delimiter=",", verbose=False):
    base = os.path.basename(logfile)
    out = []
    for suffix, rows in ((".train", train), (".test", test)):
        path = os.path.join(output_dir, base + suffix)
        write_csv(path, rows, delimiter)
        out.append(path)
        if verbose:
            print(f"wrote {path} ({len(rows)} rows)")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Parse a Caffe/minicaffe training log into CSV "
                                             "train and test tables.")
    ap.add_argument("logfile_path")
    ap.add_argument("output_dir", nargs="?", default=".")
    ap.add_argument("--delimiter", default=",", help="column delimiter (default ',')")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    try:
        train, test = parse_log(args.logfile_path)
        if not os.path.isdir(args.output_dir):
            raise OSError(f"{args.output_dir}: no such folder")
        save_csv_files(args.logfile_path, args.output_dir, train, test, args.delimiter,
                       args.verbose)
    except OSError as e:
        msg = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
        print(f"parse_log.py: error: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
