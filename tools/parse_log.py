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
import os
import sys

# the parser lives in the package (``minicaffe plot`` and ``minicaffe dashboard`` read logs too)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minicaffe.watch.logparse import (REGEX_GLOG_TIME, REGEX_ITERATION,  # noqa: E402,F401
                                      REGEX_LEARNING_RATE, REGEX_TEST_OUTPUT,
                                      REGEX_TRAIN_OUTPUT, parse_lines, parse_log)


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
