"""Caffe's tools/extra/parse_log.py reads a minicaffe log into the same train/test
tables as a Caffe log.

The regexes below are copied from Caffe's parse_log.py, and the row-building and
timestamp logic follows it and its extract_seconds.py step by step (a line that is
not glog-shaped after the first "Iteration" would make Caffe's script exit, so it
fails here).  tools/parse_log.py (ours) must give the same rows, and
tools/plot_training_log.py must plot them (or say that matplotlib is missing).
"""
import csv
import datetime
import importlib.util
import logging
import math
import pathlib
import re
import subprocess
import sys
from collections import OrderedDict

import pytest

from minicaffe.core import log
from minicaffe.solvers import get_solver
from test_solver_nets import DUMMY_NET, solver_param

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"

# -- Caffe's parse_log.py, as a reference ---------------------------------------------------
regex_iteration = re.compile(r'Iteration (\d+)')
regex_train_output = re.compile(r'Train net output #(\d+): (\S+) = ([\.\deE+-]+)')
regex_test_output = re.compile(r'Test net output #(\d+): (\S+) = ([\.\deE+-]+)')
regex_learning_rate = re.compile(r'lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)')


def caffe_extract_datetime_from_line(line, year):
    # extract_seconds.py: "I0210 13:39:22.381027 25210 solver.cpp:204] ..."; Caffe's
    # script prints the line and exits on a ValueError
    line = line.strip().split()
    month = int(line[0][1:3])
    day = int(line[0][3:])
    timestamp = line[1]
    pos = timestamp.rfind('.')
    ts = [int(x) for x in timestamp[:pos].split(':')]
    microsecond = int(timestamp[pos + 1:])
    return datetime.datetime(year, month, day, ts[0], ts[1], ts[2], microsecond)


def caffe_parse_line_for_net_output(regex_obj, row, row_dict_list, line, iteration, seconds,
                                    learning_rate):
    output_match = regex_obj.search(line)
    if output_match:
        if not row or row['NumIters'] != iteration:
            if row:
                row_dict_list.append(row)
            row = OrderedDict([('NumIters', iteration), ('Seconds', seconds),
                               ('LearningRate', learning_rate)])
        output_name = output_match.group(2)
        output_val = output_match.group(3)
        row[output_name] = float(output_val)
    if row and len(row_dict_list) >= 1 and len(row) == len(row_dict_list[0]):
        row_dict_list.append(row)
        row = None
    return row_dict_list, row


def caffe_parse_log(lines, year=2024):
    start_time = None
    for line in lines:
        if line.strip().find('Solving') != -1:
            start_time = caffe_extract_datetime_from_line(line.strip(), year)
            break
    iteration = -1
    learning_rate = float('NaN')
    train_dict_list, test_dict_list = [], []
    train_row = test_row = None
    for line in lines:
        iteration_match = regex_iteration.search(line)
        if iteration_match:
            iteration = float(iteration_match.group(1))
        if iteration == -1:
            continue
        time = caffe_extract_datetime_from_line(line, year)
        seconds = (time - start_time).total_seconds()
        learning_rate_match = regex_learning_rate.search(line)
        if learning_rate_match:
            learning_rate = float(learning_rate_match.group(1))
        train_dict_list, train_row = caffe_parse_line_for_net_output(
            regex_train_output, train_row, train_dict_list, line, iteration, seconds,
            learning_rate)
        test_dict_list, test_row = caffe_parse_line_for_net_output(
            regex_test_output, test_row, test_dict_list, line, iteration, seconds, learning_rate)
    for dict_list in (train_dict_list, test_dict_list):  # fix_initial_nan_learning_rate
        if len(dict_list) > 1:
            dict_list[0]['LearningRate'] = dict_list[1]['LearningRate']
    return train_dict_list, test_dict_list


# A BVLC Caffe LeNet log (lines as solver.cpp and sgd_solver.cpp print them).
CAFFE_LOG = """\
I0210 13:39:22.381027 25210 solver.cpp:280] Solving LeNet
I0210 13:39:22.381058 25210 solver.cpp:281] Learning Rate Policy: inv
I0210 13:39:22.381997 25210 solver.cpp:338] Iteration 0, Testing net (#0)
I0210 13:39:24.129220 25210 solver.cpp:406]     Test net output #0: accuracy = 0.0997
I0210 13:39:24.129273 25210 solver.cpp:406]     Test net output #1: loss = 2.31252 (* 1 = 2.31252 loss)
I0210 13:39:24.160588 25210 solver.cpp:229] Iteration 0 (0 iter/s, 1.779s/100 iters), loss = 2.29386
I0210 13:39:24.160636 25210 solver.cpp:245]     Train net output #0: loss = 2.29386 (* 1 = 2.29386 loss)
I0210 13:39:24.160667 25210 sgd_solver.cpp:106] Iteration 0, lr = 0.01
I0210 13:39:26.830286 25210 solver.cpp:229] Iteration 100 (37.4586 iter/s, 2.66964s/100 iters), loss = 0.215848
I0210 13:39:26.830333 25210 solver.cpp:245]     Train net output #0: loss = 0.215848 (* 1 = 0.215848 loss)
I0210 13:39:26.830351 25210 sgd_solver.cpp:106] Iteration 100, lr = 0.00992565
I0210 13:39:29.468710 25210 solver.cpp:229] Iteration 200 (37.9016 iter/s, 2.63841s/100 iters), loss = 0.155377
I0210 13:39:29.468756 25210 solver.cpp:245]     Train net output #0: loss = 0.155377 (* 1 = 0.155377 loss)
I0210 13:39:29.468775 25210 sgd_solver.cpp:106] Iteration 200, lr = 0.00985258
I0210 13:39:32.103211 25210 solver.cpp:338] Iteration 300, Testing net (#0)
I0210 13:39:33.790466 25210 solver.cpp:406]     Test net output #0: accuracy = 0.9713
I0210 13:39:33.790512 25210 solver.cpp:406]     Test net output #1: loss = 0.0897432 (* 1 = 0.0897432 loss)
I0210 13:39:33.816789 25210 solver.cpp:229] Iteration 300 (28.6023 iter/s, 3.4962s/100 iters), loss = 0.171592
I0210 13:39:33.816834 25210 solver.cpp:245]     Train net output #0: loss = 0.171592 (* 1 = 0.171592 loss)
I0210 13:39:33.816854 25210 sgd_solver.cpp:106] Iteration 300, lr = 0.00978075
I0210 13:39:36.453521 25210 solver.cpp:456] Snapshotting to binary proto file examples/mnist/lenet_iter_400.caffemodel
I0210 13:39:36.461227 25210 sgd_solver.cpp:273] Snapshotting solver state to binary proto file examples/mnist/lenet_iter_400.solverstate
I0210 13:39:36.465342 25210 solver.cpp:318] Iteration 400, loss = 0.0814536
I0210 13:39:36.465379 25210 solver.cpp:338] Iteration 400, Testing net (#0)
I0210 13:39:38.147921 25210 solver.cpp:406]     Test net output #0: accuracy = 0.9786
I0210 13:39:38.147969 25210 solver.cpp:406]     Test net output #1: loss = 0.0661744 (* 1 = 0.0661744 loss)
I0210 13:39:38.147980 25210 solver.cpp:323] Optimization Done.
"""


@pytest.fixture
def minicaffe_log(tmp_path):
    """A short real training run (tests at 0, 10, 20; display every 5), logged to a file
    the way `minicaffe train --log` does."""
    path = tmp_path / "train.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(log.GlogFormatter())
    logger = log.logger
    log.is_enabled()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        s = get_solver(solver_param(DUMMY_NET, type="SGD", base_lr=0.05, momentum=0.9,
                                    lr_policy="inv", gamma=0.01, power=0.75, display=5,
                                    max_iter=20, test_iter=[3], test_interval=10, random_seed=4,
                                    snapshot_after_train=False))
        s.solve()
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(old_level)
    return path


def _lines_matching(text, pattern):
    return [re.search(pattern, l) for l in text.splitlines() if re.search(pattern, l)]


def test_caffes_regexes_extract_every_train_and_test_line(minicaffe_log):
    text = minicaffe_log.read_text()
    train, test = caffe_parse_log(text.splitlines(keepends=True))
    # every "Train net output" line is in the train table, every test line in the test table
    train_lines = _lines_matching(text, r"Train net output #0: loss = (\S+) \(")
    test_acc = _lines_matching(text, r"Test net output #0: accuracy = (\S+)$")
    test_loss = _lines_matching(text, r"Test net output #1: loss = (\S+) \(")
    assert len(train_lines) == 4 and len(test_acc) == len(test_loss) == 3
    assert [r["NumIters"] for r in train] == [0, 5, 10, 15]
    assert [r["loss"] for r in train] == [float(m.group(1)) for m in train_lines]
    assert [r["NumIters"] for r in test] == [0, 10, 20]
    assert [r["accuracy"] for r in test] == [float(m.group(1)) for m in test_acc]
    assert [r["loss"] for r in test] == [float(m.group(1)) for m in test_loss]
    # the learning rate printed at each display reaches the next rows
    lrs = [float(m.group(1)) for m in _lines_matching(text, r"Iteration \d+, lr = (\S+)$")]
    assert len(lrs) == 4
    assert [r["LearningRate"] for r in train] == [lrs[0]] + lrs[:3]
    assert lrs[1] == pytest.approx(0.05 * (1 + 0.01 * 5) ** -0.75, rel=1e-5)
    seconds = [r["Seconds"] for r in train]
    assert all(s >= 0 for s in seconds) and seconds == sorted(seconds)


def test_same_tables_as_for_a_caffe_log(minicaffe_log):
    ours = caffe_parse_log(minicaffe_log.read_text().splitlines(keepends=True))
    caffes = caffe_parse_log(CAFFE_LOG.splitlines(keepends=True))
    for mine, theirs in zip(ours, caffes):
        assert list(mine[0].keys()) == list(theirs[0].keys())
        assert all(list(r.keys()) == list(mine[0].keys()) for r in mine)
    assert list(caffes[0][0].keys()) == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert list(caffes[1][0].keys()) == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]
    assert [r["NumIters"] for r in caffes[0]] == [0, 100, 200, 300]
    assert [r["accuracy"] for r in caffes[1]] == [0.0997, 0.9713, 0.9786]
    assert caffes[0][1]["LearningRate"] == 0.01 and caffes[0][2]["LearningRate"] == 0.00992565


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same_rows(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert list(x.keys()) == list(y.keys())
        for k in x:
            assert x[k] == y[k] or (math.isnan(x[k]) and math.isnan(y[k])), k


def test_our_parse_log_gives_caffes_tables_and_csv(minicaffe_log, tmp_path):
    pl = _tool("parse_log")
    for text in (minicaffe_log.read_text(), CAFFE_LOG):
        mine = pl.parse_lines(text.splitlines(), 2024)
        ref = caffe_parse_log(text.splitlines(keepends=True), 2024)
        _same_rows(mine[0], ref[0])
        _same_rows(mine[1], ref[1])
    out = tmp_path / "csv"
    out.mkdir()
    r = subprocess.run([sys.executable, str(TOOLS / "parse_log.py"), str(minicaffe_log), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open(out / "train.log.train") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert [float(r["NumIters"]) for r in rows] == [0, 5, 10, 15]
    with open(out / "train.log.test") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]
    r = subprocess.run([sys.executable, str(TOOLS / "parse_log.py"), str(tmp_path / "nolog")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "No such file" in r.stderr and "Traceback" not in r.stderr


def test_our_parser_skips_non_glog_lines_and_reads_nan():
    pl = _tool("parse_log")
    text = CAFFE_LOG.replace(
        "I0210 13:39:26.830286", " 40%|####      | 40/100 [00:01<00:01]\nI0210 13:39:26.830286")
    text = text.replace("loss = 0.155377 (* 1", "loss = nan (* 1")
    train, test = pl.parse_lines(text.splitlines(), 2024)
    assert [r["NumIters"] for r in train] == [0, 100, 200, 300]
    assert math.isnan(train[2]["loss"])


def test_plot_training_log(minicaffe_log, tmp_path):
    out = tmp_path / "plot.png"
    r = subprocess.run([sys.executable, str(TOOLS / "plot_training_log.py"), str(minicaffe_log),
                        str(out)], capture_output=True, text=True)
    if importlib.util.find_spec("matplotlib") is None:
        assert r.returncode == 1
        assert r.stderr.strip() == ("plot_training_log.py: error: matplotlib is not installed "
                                    "(pip install matplotlib, or pip install \".[plot]\")")
    else:
        assert r.returncode == 0, r.stderr
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
