"""The first hour of a new user (issue 22): install hints a clone can run, the commands'
own help, logs at three volumes, BLAS threads, and hostile flag values as one line."""
import os
import re
import subprocess
import sys

import pytest

from minicaffe.core import backend
from test_cli import REPO, SOLVER, _error_line, _messages, _setup


def test_install_hints_name_what_a_clone_can_install(cli, tmp_path, monkeypatch):
    """There is no minicaffe on PyPI: the hint names the extra of the checkout."""
    monkeypatch.setattr(backend, "cp", None)
    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    rc, out, err = cli("device_query")
    line = _error_line(err)
    assert rc == 1 and 'pip install ".[cuda12]"' in line, line
    assert "minicaffe[" not in line


def _run(code, env_drop=(), **env):
    """Run ``code`` in a fresh Python (imports from this checkout); (rc, stdout, stderr)."""
    e = {k: v for k, v in os.environ.items() if k not in env_drop}
    e.update(PYTHONPATH=str(REPO), **env)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                       timeout=120)
    return r.returncode, r.stdout, r.stderr


# -- 1. CPU threads ---------------------------------------------------------------------------
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "BLIS_NUM_THREADS")
REPORT = ("import numpy, minicaffe, threadpoolctl; "
          "print([p['num_threads'] for p in threadpoolctl.threadpool_info() "
          "if p['user_api'] == 'blas'])")


def test_import_sets_one_blas_thread_unless_the_environment_says_otherwise():
    pytest.importorskip("threadpoolctl")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: numpy's own default is one thread already")
    rc, out, err = _run(REPORT, env_drop=THREAD_VARS)   # numpy first, then minicaffe
    assert rc == 0, err
    assert out.strip() == "[1]"
    rc, out, err = _run(REPORT, env_drop=THREAD_VARS, OPENBLAS_NUM_THREADS="2")
    assert rc == 0 and out.strip() == "[2]", err      # asked: left alone


def test_threads_flag_sets_the_blas_threads_of_the_run(cli, tmp_path):
    pytest.importorskip("threadpoolctl")
    from minicaffe import get_num_threads
    before = get_num_threads()
    _setup(tmp_path)
    said = {}
    for n in ("2", "3"):
        rc, out, err = cli("time", "--model", "net.prototxt", "--iterations", "1",
                           "--threads", n)
        assert rc == 0, err
        said[n] = [m for m in _messages(err) if m.startswith("CPU threads")]
    for n in ("2", "3"):   # what threadpoolctl read back from the BLAS during the run:
        # one BLAS thread beside the convolutions' pool of n threads
        assert len(said[n]) == 1 and said[n][0].startswith("CPU threads for numpy's BLAS: 1 ")
        assert f"convolutions batch-parallel on {n} threads" in said[n][0]
        assert said[n][0].endswith("(--threads)")
    assert get_num_threads() == before                 # held for the command only
    rc, out, err = cli("time", "--model", "net.prototxt", "--iterations", "1")
    line = [m for m in _messages(err) if m.startswith("CPU threads")][0]
    assert line.startswith(f"CPU threads for numpy's BLAS: {before} ")


def test_set_num_threads_in_python():
    pytest.importorskip("threadpoolctl")
    rc, out, err = _run("import minicaffe; minicaffe.set_num_threads(2); "
                        "print(minicaffe.get_num_threads())", env_drop=THREAD_VARS)
    assert rc == 0 and out.strip() == "2", err


def test_without_threadpoolctl_the_default_holds_and_the_flag_says_why(tmp_path):
    _setup(tmp_path)
    code = ("import sys; sys.modules['threadpoolctl'] = None\n"
            "import minicaffe, os; print(os.environ.get('OPENBLAS_NUM_THREADS'))\n"
            "from minicaffe.cli import main\n"
            f"sys.exit(main(['time', '--model', {str(tmp_path / 'net.prototxt')!r}, "
            "'--threads', '2']))")
    rc, out, err = _run(code, env_drop=THREAD_VARS)
    assert out.strip() == "1"                          # set before numpy loaded OpenBLAS
    assert rc == 1 and "--threads needs threadpoolctl" in _error_line(err)


def test_a_threadpoolctl_too_old_to_see_numpys_blas_counts_as_none(tmp_path):
    """threadpoolctl < 3.5 finds no BLAS in numpy 2's wheels and would set nothing: the
    kernel pool's threads would each run all of the BLAS's.  It is taken for none."""
    _setup(tmp_path)
    code = ("import sys, types; old = types.ModuleType('threadpoolctl')\n"
            "old.__version__ = '3.1.0'; sys.modules['threadpoolctl'] = old\n"
            "import minicaffe, os; print(os.environ.get('OPENBLAS_NUM_THREADS'))\n"
            "from minicaffe.cli import main\n"
            f"sys.exit(main(['time', '--model', {str(tmp_path / 'net.prototxt')!r}, "
            "'--threads', '2']))")
    rc, out, err = _run(code, env_drop=THREAD_VARS)
    assert out.strip() == "1"                          # the fallback's one BLAS thread
    line = _error_line(err)
    assert rc == 1 and "--threads needs threadpoolctl >= 3.5 (this one is 3.1.0" in line


@pytest.mark.parametrize("value,words", [("0", "at least 1"), ("-2", "at least 1"),
                                         ("many", "illegal value 'many'"),
                                         ("100000", "more than 4x")])
def test_bad_threads_is_one_line(cli, tmp_path, value, words):
    _setup(tmp_path)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--threads", value)
    assert rc == 1 and words in _error_line(err)


# -- 5. commands -------------------------------------------------------------------------------
def test_each_command_prints_its_own_help(cli):
    from minicaffe.cli import COMMAND_FLAGS, COMMANDS
    for command in COMMANDS:
        for spelling in ("--help", "-h", "-helpfull"):
            rc, out, err = cli(command, spelling)
            assert rc == 0 and out.startswith(f"usage: minicaffe {command} "), (command, out)
        flags = re.findall(r"^  --(\w+)", out, re.M)
        assert flags == list(COMMAND_FLAGS[command])
    rc, out, err = cli("train", "--help")
    assert "--solver FILE" in out and "--repeats" not in out and "--weights" in out
    rc, out, err = cli("--solver", "s.prototxt", "train", "--help")   # any order
    assert out.startswith("usage: minicaffe train ")
    rc, out, err = cli("--help")
    assert rc == 0 and out.startswith("minicaffe: command line brew")


@pytest.mark.parametrize("tool", ["draw", "extract_features", "upgrade_net_proto_text",
                                  "upgrade_net_proto_binary"])
def test_positional_tools_have_help_and_usage_errors(cli, tool):
    rc, out, err = cli(tool, "--help")
    assert rc == 0 and "usage:" in out
    rc, out, err = cli(tool)
    assert rc == 2 and "the following arguments are required" in err


def test_unknown_action_lists_every_action(cli):
    from minicaffe.cli import ACTIONS
    rc, out, err = cli("brew")
    line = _error_line(err)
    assert rc == 1 and "unknown action: brew" in line
    for action in ACTIONS:
        assert action in line
    assert "draw" in ACTIONS and "extract_features" in ACTIONS


def test_docs_cli_md_documents_every_action():
    from minicaffe.cli import ACTIONS
    text = (REPO / "docs" / "cli.md").read_text()
    for action in ACTIONS:
        assert re.search(rf"^#+ (.*\W)?{action}\b", text, re.M), action


# -- 6. logs at three volumes -----------------------------------------------------------------
QUIET_WORDS = ("Iteration ", "    Train net output", "    Test net output", "Test loss:",
               "Optimization Done.", "Snapshotting")


def test_quiet_train_keeps_progress_and_result_and_the_log_file_keeps_all(cli, tmp_path):
    _setup(tmp_path)
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    assert rc == 0, err
    full, full_lines = _messages(err), err.splitlines()
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--quiet", "--log", "q.log")
    assert rc == 0, err
    quiet = _messages(err)
    assert len(err.splitlines()) == len(quiet)              # nothing but glog lines
    assert all(m.startswith(QUIET_WORDS) for m in quiet), quiet
    expected = [m for m in full if m.startswith(QUIET_WORDS)]

    def untimed(lines):
        return [re.sub(r"\(.* iter/s.*\)", "(...)", m) for m in lines]
    assert untimed(quiet) == untimed(expected) and 10 < len(quiet) < len(full) // 3
    for words in ("Iteration 5 (", "Iteration 10, loss = ", "    Test net output #0: accuracy = ",
                  "Iteration 10, Testing net (#0)", "Optimization Done."):
        assert any(m.startswith(words) for m in quiet), words
    assert not any("Setting up" in m or "Initializing" in m for m in quiet)
    logged = (tmp_path / "q.log").read_text().splitlines()
    assert len(logged) == len(full_lines)                    # the file gets every line
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--minloglevel", "1")
    assert rc == 0 and err == ""


def test_quiet_test_and_time_print_their_results(cli, tmp_path):
    _setup(tmp_path)
    assert cli("train", "--solver", "solver.prototxt")[0] == 0
    rc, out, err = cli("test", "--model", "net.prototxt", "--weights",
                       "snap/dummy_iter_10.caffemodel", "--iterations", "3", "--quiet")
    assert rc == 0, err
    msgs = _messages(err)
    assert [re.split(r":| = ", m)[0] for m in msgs] == ["Loss", "accuracy", "loss"], msgs
    rc, out, err = cli("time", "--model", "net.prototxt", "--iterations", "2", "--quiet")
    assert [m.split(":")[0] for m in _messages(err)] == [
        "Average Forward pass", "Average Backward pass", "Average Forward-Backward",
        "Total Time"]


API_SCRIPT = """
import minicaffe as caffe
s = caffe.get_solver("solver.prototxt")
s.solve()
"""


@pytest.mark.parametrize("verbose", [None, "1", "quiet"])
def test_python_api_logs_progress_and_the_net_report_at_verbose_1(tmp_path, verbose):
    _setup(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("GLOG_minloglevel", None)
    env.pop("GLOG_v", None)
    script = API_SCRIPT
    if verbose == "quiet":
        script = script.replace("\ns = ", "\ncaffe.init_log(volume='quiet')\ns = ")
    elif verbose:
        env["GLOG_v"] = verbose
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    msgs = _messages(r.stderr)
    progress = [m for m in msgs if m.startswith(QUIET_WORDS)]
    assert any(m.startswith("Iteration 10, loss = ") for m in progress)
    assert sum(m.startswith("    Test net output") for m in progress) == 6   # 3 tests (0, 5, 10) x 2
    setup = [m for m in msgs if m.startswith(("Setting up", "Top shape", "Creating Layer",
                                              "Initializing net from parameters"))]
    if verbose == "quiet":
        assert msgs == progress and len(msgs) == 21, msgs
    elif verbose:
        assert len(setup) > 20
    else:
        assert setup == [] and len(progress) < len(msgs) < 40, msgs


# -- 7. small ------------------------------------------------------------------------------------
def test_relative_snapshot_prefix_names_the_working_directory(cli, tmp_path):
    _setup(tmp_path, solver=SOLVER.replace('snapshot_prefix: "snap/dummy"',
                                           'snapshot_prefix: "nofolder/dummy"'))
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    line = _error_line(err)
    assert rc == 1 and f"relative to the working directory {tmp_path}" in line


def test_docs_name_no_developer_machine_path():
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        assert "/work/venv" not in path.read_text(), path


def test_license_file_is_bsd_2_clause():
    text = (REPO / "LICENSE").read_text()
    assert "Redistribution and use in source and binary forms" in text
    assert "the minicaffe authors" in text
    assert 'license = {text = "BSD-2-Clause"}' in (REPO / "pyproject.toml").read_text()


def test_memory_on_the_cpu_prints_host_memory(cli, tmp_path):
    if backend.gpu_count():
        pytest.skip("a GPU is present")
    rc, out, err = cli("memory", "--model", REPO / "models" / "lenet" / "train_val.prototxt",
                       "--batch", "8")
    assert rc == 0, err
    assert out.startswith("host memory of LeNet in CPU mode: batch 8")
    assert "cuBLAS" not in out and "cuDNN" not in out and "offload" not in out
    peak = float(re.search(r"peak ([\d.]+) MiB", out).group(1))
    assert peak > 1.0


def test_upgrade_net_proto_text_and_binary(cli, tmp_path):
    from minicaffe.core import protoio
    from minicaffe.proto import caffe_pb2
    src = REPO / "tests" / "data" / "caffe"
    rc, out, err = cli("upgrade_net_proto_text", src / "lenet_v1_train_test.prototxt",
                       "new.prototxt")
    assert rc == 0, err
    net = protoio.read_text(str(tmp_path / "new.prototxt"), caffe_pb2.NetParameter())
    assert len(net.layers) == 0 and [l.type for l in net.layer][:3] == ["Data", "Data",
                                                                          "Convolution"]
    assert "Wrote upgraded NetParameter text proto to new.prototxt" in _messages(err)
    rc, out, err = cli("upgrade_net_proto_text", "new.prototxt", "again.prototxt")
    assert rc == 0 and any(l.startswith("E") and "already in latest proto format" in l
                           for l in err.splitlines())
    rc, out, err = cli("upgrade_net_proto_binary", src / "lenet_v1_iter_10000.caffemodel",
                       "new.caffemodel")
    assert rc == 0, err
    w = protoio.read_binary(str(tmp_path / "new.caffemodel"), caffe_pb2.NetParameter())
    assert len(w.layers) == 0 and "conv1" in [l.name for l in w.layer]
    rc, out, err = cli("upgrade_net_proto_binary", "nothere.caffemodel", "x.caffemodel")
    assert rc == 1 and "nothere.caffemodel: no such file" in err
    assert not (tmp_path / "x.caffemodel").exists()


FEATURE_NET = """
name: "feat"
layer { name: "data" type: "DummyData" top: "data"
  dummy_data_param { shape { dim: 3 dim: 2 dim: 2 dim: 2 }
    data_filler { type: "constant" value: 0.5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 1 }
    bias_filler { type: "constant" value: 0.25 } } }
"""


def test_extract_features_writes_one_datum_per_image(cli, tmp_path):
    pytest.importorskip("lmdb")
    import numpy as np
    from minicaffe.data.db import open_db
    from minicaffe.network.net import Net, TEST
    from minicaffe.proto import caffe_pb2
    (tmp_path / "feat.prototxt").write_text(FEATURE_NET)
    net = Net(str(tmp_path / "feat.prototxt"), TEST)
    net.save(str(tmp_path / "feat.caffemodel"))
    net.forward_prefilled()
    expected = np.array(net.blobs["ip"].data, dtype=np.float32)
    rc, out, err = cli("extract_features", "feat.caffemodel", "feat.prototxt", "ip,data",
                       "ip_db,data_db", "2", "lmdb")
    assert rc == 0, err
    assert "Extracted features of 6 query images for feature blob ip" in _messages(err)
    with open_db(str(tmp_path / "ip_db")) as db:
        records = list(db)
    assert [k for k, _ in records] == [b"%010d" % i for i in range(6)]
    d = caffe_pb2.Datum.FromString(records[4][1])
    assert (d.channels, d.height, d.width) == (4, 1, 1)
    np.testing.assert_array_equal(np.array(d.float_data, np.float32), expected[1])
    with open_db(str(tmp_path / "data_db")) as db:
        d = caffe_pb2.Datum.FromString(next(iter(db))[1])
    assert (d.channels, d.height, d.width) == (2, 2, 2) and set(d.float_data) == {0.5}
    rc, out, err = cli("extract_features", "feat.caffemodel", "feat.prototxt", "nope",
                       "nope_db", "1", "lmdb")
    assert rc == 1 and "Unknown feature blob name nope" in err
    assert not (tmp_path / "nope_db").exists()
    rc, out, err = cli("extract_features", "feat.caffemodel", "feat.prototxt", "ip,data",
                       "one_db", "1", "lmdb")
    assert rc == 1 and "must be equal" in err


# -- 8. hostile inputs ------------------------------------------------------------------------
LENET = str(REPO / "models" / "lenet" / "train_val.prototxt")


@pytest.mark.parametrize("args,words", [
    (["memory", "--model", LENET, "--batch", "99999999999"], "--batch 99999999999 is too large"),
    (["bench", "--model", LENET, "--batch", "100000000", "--iterations", "1", "--repeats", "1",
      "--warmup", "0"], "out of host memory"),
    (["bench", "--model", LENET, "--batch", "0"], "--batch must be at least 1"),
    (["memory", "--model", LENET, "--batch", "-3"], "--batch must be at least 1"),
    (["train", "--solver", "solver.prototxt", "--parallel", "sideways"],
     "--parallel must be thread or process (got 'sideways')"),
    (["test", "--model", "net.prototxt", "--weights", "w", "--iterations", "0"],
     "--iterations must be at least 1"),
    (["test", "--model", "net.prototxt", "--solver", "solver.prototxt"],
     "--solver is not a flag of 'test'"),
    (["train", "--solver", "solver.prototxt", "--quiet=maybe"],
     "illegal value 'maybe' specified for bool flag 'quiet'"),
    (["train", "--solver", "solver.prototxt", "--minloglevel", "7"], "--minloglevel must be"),
    (["memory", "--model", LENET, "--offload", "sideways"], "unknown offload policy"),
    (["memory", "--model", LENET, "--input_shape", "1,0,28"], "--input_shape '1,0,28'"),
    (["train", "--solver", "solver.prototxt", "--gpu", "first"], "illegal value 'first'"),
    (["bench", "--model", LENET, "--repeats", "0"], "--repeats must be at least 1"),
    (["train", "--solver", "solver.prototxt", "--gpu_mem_limit", "-1"],
     "--gpu_mem_limit must be at least 0"),
    (["train", "--solver", "nosolver.prototxt"], "nosolver.prototxt: no such file"),
    (["train", "--solver", "solver.prototxt", "--weights", "net.prototxt,gone.caffemodel"],
     "gone.caffemodel: no such file (--weights)"),
    (["test", "--model", "net.prototxt", "--weights", "gone.caffemodel"],
     "gone.caffemodel: no such file (--weights)"),
    (["time", "--model", "nonet.prototxt"], "nonet.prototxt: no such file"),
])
def test_hostile_flags_are_one_line_and_write_nothing(cli, tmp_path, args, words):
    _setup(tmp_path)
    rc, out, err = cli(*args, "--log", "run.log")
    assert rc == 1 and words in _error_line(err), err
    assert "Traceback" not in err
    if "out of host memory" not in words:     # refused before the log was opened
        assert not (tmp_path / "run.log").exists()
    assert sorted(os.listdir(tmp_path / "snap")) == []


@pytest.mark.parametrize("var,value", [("GLOG_minloglevel", "lots"), ("GLOG_v", "-1")])
def test_bad_glog_variables_are_one_line(cli, tmp_path, monkeypatch, var, value):
    _setup(tmp_path)
    monkeypatch.setenv(var, value)
    rc, out, err = cli("train", "--solver", "solver.prototxt")
    assert rc == 1 and f"{var}={value!r}" in _error_line(err)
