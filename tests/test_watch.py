"""Watching a run (minicaffe/watch): the dashboard page in a real browser while LeNet
trains, the token rule, a BVLC Caffe log in ``minicaffe dashboard``, TensorBoard event
files read back against the log, ``minicaffe plot``, and the terminal's progress line.

Every server here binds 127.0.0.1 and is closed by the test; the browser is Debian's
``chromium`` driven by its own ``--headless --dump-dom``/``--screenshot`` (the test skips,
saying how to install it, where it is missing).
"""
import html.parser
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from minicaffe.watch import RunRecord, serve
from minicaffe.watch.logparse import REGEX_LR, parse_log
from minicaffe.watch.server import parse_address, token_required
from test_cli import DUMMY_NET, REPO, _setup
from test_parse_log import CAFFE_LOG

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL_BROWSER = "apt-get update && apt-get install -y chromium"


def _get(url):
    """(status, body) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def _close(a, b, rel=1e-5):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def _log_lrs(text):
    return {int(m.group(1)): float(m.group(2)) for m in REGEX_LR.finditer(text)}


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")


# -- the page in a real browser, on a LeNet run that is still training ---------------------
class _Plotted(html.parser.HTMLParser):
    """The series the page plotted (data-series/data-values) and its status."""

    def __init__(self):
        super().__init__()
        self.series, self.status, self._in_status = {}, None, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "polyline" and "data-values" in a:
            self.series[a["data-series"]] = [
                (int(p.split(":")[0]), float(p.split(":")[1]))
                for p in a["data-values"].split(",") if p]
        self._in_status = a.get("id") == "status"
        if self._in_status:
            self.status = a.get("data-status")


def _chromium(url, *args, budget_ms=4000):
    exe = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                            "--no-first-run", "--disable-background-networking",
                            "--disable-component-update", "--disable-sync",
                            f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                            *args, url], capture_output=True, text=True, timeout=90)
    return r


LENET_SOLVER = """net: "net.prototxt"
test_iter: 5
test_interval: 20
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 10
max_iter: 100000
snapshot_prefix: "lenet"
snapshot_after_train: false
"""


def test_dashboard_page_in_a_browser_while_lenet_trains(tmp_path, mnist_dir):
    if not any(shutil.which(b) for b in BROWSERS):
        pytest.skip(f"no headless browser (chromium): install it with `{INSTALL_BROWSER}`")
    from minicaffe.data import convert
    convert.convert_mnist(mnist_dir / "t10k-images-idx3-ubyte.gz",
                          mnist_dir / "t10k-labels-idx1-ubyte.gz", tmp_path / "mnist_lmdb")
    net = (REPO / "examples" / "mnist" / "lenet_train_test.prototxt").read_text()
    net = re.sub(r"examples/mnist/mnist_(train|test)_lmdb", "mnist_lmdb", net)
    (tmp_path / "net.prototxt").write_text(net)
    (tmp_path / "solver.prototxt").write_text(LENET_SOLVER)
    err = open(tmp_path / "stderr.txt", "w")
    p = subprocess.Popen([sys.executable, "-m", "minicaffe", "train", "--solver",
                          "solver.prototxt", "--log", "run.log", "--dashboard", "0"],
                         cwd=tmp_path, env=_env(), stderr=err, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        url = None
        while time.monotonic() < deadline:
            assert p.poll() is None, (tmp_path / "stderr.txt").read_text()[-2000:]
            text = (tmp_path / "stderr.txt").read_text()
            m = re.search(r"Dashboard: (http://127\.0\.0\.1:\d+/)\s", text)
            url = m.group(1) if m else None
            logged = (tmp_path / "run.log").read_text() if (tmp_path / "run.log").exists() else ""
            if url and len(re.findall(r"Testing net", logged)) >= 2 and \
                    logged.count("Train net output") >= 4:
                break
            time.sleep(0.2)
        assert url, "the dashboard's URL was not printed"
        page = _chromium(url, "--dump-dom")
        assert page.returncode == 0, page.stderr[-2000:]
        shot = tmp_path / "dashboard.png"   # the artifact: what the page looked like
        _chromium(url, "--hide-scrollbars", "--window-size=1280,1000", f"--screenshot={shot}")
        assert p.poll() is None, "the run ended before the page was read"
    finally:
        p.send_signal(signal.SIGINT)     # stop: the default sigint_effect
        rc = p.wait(60)
        err.close()
    assert rc == 0
    assert shot.is_file() and shot.stat().st_size > 10000
    dom = _Plotted()
    dom.feed(page.stdout)
    assert dom.status == "training"
    logged = (tmp_path / "run.log").read_text()
    train, test = parse_log(tmp_path / "run.log")
    by_iter = {int(r["NumIters"]): r for r in train}
    test_by_iter = {int(r["NumIters"]): r for r in test}
    assert len(dom.series["train/loss"]) >= 4 and len(dom.series["test/accuracy"]) >= 2
    for it, v in dom.series["train/loss"]:
        assert _close(v, by_iter[it]["loss"]), (it, v, by_iter[it])
    for name in ("accuracy", "loss"):
        for it, v in dom.series[f"test/{name}"]:
            assert _close(v, test_by_iter[it][name]), (name, it, v)
    lrs = _log_lrs(logged)
    assert [it for it, _ in dom.series["lr"]] == sorted(lrs)[:len(dom.series["lr"])]
    for it, v in dom.series["lr"]:
        assert _close(v, lrs[it])
    smoothed = {int(m.group(1)): float(m.group(2)) for m in
                re.finditer(r"Iteration (\d+) \([^)]*\), loss = (\S+)", logged)}
    for it, v in dom.series["train/smoothed_loss"]:
        assert _close(v, smoothed[it])
    assert len(dom.series["speed/images_per_s"]) >= 2   # LeNet's batch: 64 per iteration
    for it, v in dom.series["speed/images_per_s"]:
        assert v > 0
    assert "Optimization stopped early." in logged


# -- the token rule --------------------------------------------------------------------------
def test_a_token_is_required_off_the_loopback_and_checked():
    assert parse_address("8080") == ("127.0.0.1", 8080)
    assert parse_address("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    assert token_required("0.0.0.0") and token_required("192.168.1.5")
    assert not token_required("127.0.0.1") and not token_required("localhost")
    rec = RunRecord({"net": "n"})
    rec.add("train/loss", 0, 2.5)
    with serve(rec, port=0, require_token=True) as d:   # as a non-local bind would be
        assert d.token and f"?token={d.token}" in d.url
        base = d.url.split("?")[0]
        status, body = _get(base)
        assert status == 403 and b"needs its token" in body
        assert _get(base + "api/run")[0] == 403
        assert _get(base + "api/run?token=wrong")[0] == 403
        status, body = _get(base + "api/run?token=" + d.token)
        assert status == 200 and json.loads(body)["series"]["train/loss"] == [[0, 2.5]]
        assert _get(d.url)[0] == 200
        version = json.loads(body)["version"]
        status, body = _get(f"{base}api/run?token={d.token}&since={version}")
        assert json.loads(body) == {"version": version, "unchanged": True}
        rec.add("train/loss", 10, 1.5)
        status, body = _get(f"{base}api/run?token={d.token}&since={version}")
        assert json.loads(body)["series"]["train/loss"] == [[0, 2.5], [10, 1.5]]
        req = urllib.request.Request(base + "api/run?token=" + d.token, data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:   # read-only
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 405
        e.value.close()
    with serve(rec, port=0) as d:     # loopback: no token
        assert d.token is None and "token" not in d.url
        assert _get(d.url + "api/run")[0] == 200


def test_bad_dashboard_address_is_one_line(cli, tmp_path):
    _setup(tmp_path)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--dashboard", "host:port")
    assert rc == 1 and "--dashboard: 'host:port' is not [HOST:]PORT" in err
    assert "Traceback" not in err and not os.listdir(tmp_path / "snap")


# -- a finished BVLC Caffe log in `minicaffe dashboard` ----------------------------------------
def test_bvlc_caffe_log_opens_in_minicaffe_dashboard(tmp_path):
    logfile = tmp_path / "caffe.log"
    logfile.write_text(CAFFE_LOG)
    p = subprocess.Popen([sys.executable, "-m", "minicaffe", "dashboard", str(logfile),
                          "--port", "0"], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        m = re.match(r"Dashboard: (http://127\.0\.0\.1:\d+/)$", line.strip())
        assert m, line + p.stderr.read() if p.poll() is not None else line
        status, body = _get(m.group(1) + "api/run")
        assert status == 200
        run = json.loads(body)
        assert _get(m.group(1))[0] == 200
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
        p.stdout.close()
        p.stderr.close()
    assert run["status"] == "finished" and run["facts"]["net"] == "LeNet"
    assert run["series"]["test/accuracy"] == [[0, 0.0997], [300, 0.9713], [400, 0.9786]]
    assert run["series"]["train/loss"][1] == [100, 0.215848]
    assert dict(map(tuple, run["series"]["lr"]))[100] == 0.00992565
    assert run["series"]["speed/iter_per_s"][0] == [100, 37.4586]
    assert run["snapshots"] == [[400, "examples/mnist/lenet_iter_400.caffemodel"]]


def test_dashboard_of_a_missing_or_foreign_file_is_one_line(cli, tmp_path):
    rc, out, err = cli("dashboard", "nope.log", "--port", "0")
    assert rc == 1 and "nope.log: No such file" in err
    (tmp_path / "notes.txt").write_text("hello\n")
    rc, out, err = cli("dashboard", "notes.txt", "--port", "0")
    assert rc == 1 and "not a Caffe or minicaffe log" in err and "Traceback" not in err
    (tmp_path / "caffe.log").write_text(CAFFE_LOG)
    with serve(tmp_path / "caffe.log", port=0) as d:   # a log that goes away while served
        assert _get(d.url + "api/run")[0] == 200
        (tmp_path / "caffe.log").unlink()
        status, body = _get(d.url + "api/run")
    assert status == 500 and b"cannot read the run" in body


# -- TensorBoard event files ---------------------------------------------------------------
TB_SOLVER = """net: "net.prototxt"
test_iter: 2
test_interval: 5
base_lr: 0.05
momentum: 0.9
lr_policy: "inv"
gamma: 0.01
power: 0.75
display: 2
max_iter: 12
snapshot: 6
snapshot_prefix: "snap/tb"
random_seed: 3
"""


def test_tensorboard_event_file_holds_the_logs_scalars(cli, tmp_path):
    pytest.importorskip("tensorboardX")
    from minicaffe.watch.tensorboard import event_files, read_events, read_records
    _setup(tmp_path, solver=TB_SOLVER)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--log", "run.log",
                       "--tensorboard", "tb")
    assert rc == 0, err
    files = event_files(tmp_path / "tb")
    assert len(files) == 1 and read_records(files[0])
    rec = read_events(tmp_path / "tb")
    logged = (tmp_path / "run.log").read_text()
    train, test = parse_log(tmp_path / "run.log")
    assert [(int(r["NumIters"]), r["loss"]) for r in train] == \
        [(i, pytest.approx(v, rel=1e-5)) for i, v in rec.points("train/loss")]
    assert [int(r["NumIters"]) for r in test] == [0, 5, 10]
    for name in ("accuracy", "loss"):
        assert [(int(r["NumIters"]), r[name]) for r in test] == \
            [(i, pytest.approx(v, rel=1e-5)) for i, v in rec.points(f"test/{name}")]
    lrs = _log_lrs(logged)
    assert [i for i, _ in rec.points("lr")] == sorted(lrs)
    assert all(_close(v, lrs[i]) for i, v in rec.points("lr"))
    assert [i for i, _ in rec.points("speed/images_per_s")] == [2, 4, 6, 8, 10]
    assert rec.facts["net"] == "dummy" and rec.status == "finished"
    assert [s[0] for s in rec.snapshots] == [6, 12]
    with serve(tmp_path / "tb", port=0) as d:    # `minicaffe dashboard` of the event folder
        run = json.loads(_get(d.url + "api/run")[1])
    assert run["series"]["lr"] == [list(p) for p in rec.points("lr")]
    assert run["status"] == "finished" and run["facts"]["batch"] == "8 images per iteration"


def test_tensorboard_corrupt_file_and_missing_writer(tmp_path, monkeypatch):
    pytest.importorskip("tensorboardX")
    from minicaffe.core.errors import MinicaffeError
    from minicaffe.watch import tensorboard
    from tensorboardX import SummaryWriter
    w = SummaryWriter(str(tmp_path))
    w.add_scalar("a", 1.5, 3)
    w.close()
    f = tensorboard.event_files(tmp_path)[0]
    assert tensorboard.read_events(f).points("a") == [(3, 1.5)]
    data = bytearray(pathlib.Path(f).read_bytes())
    data[-6] ^= 0xFF
    pathlib.Path(f).write_bytes(bytes(data))
    with pytest.raises(MinicaffeError, match="corrupt event file"):
        tensorboard.read_events(f)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(MinicaffeError, match=r"pip install \"\.\[tensorboard\]\""):
        tensorboard.TensorBoardWriter(tmp_path / "x")


def test_tensorboard_multi_gpu_only_the_root_writes(tmp_path):
    """Two CPU ranks with the fake communicator (the multi-GPU protocol): one writer."""
    pytest.importorskip("tensorboardX")
    from minicaffe.multigpu.parallel import train_threads
    from minicaffe.solvers import read_solver_param
    from minicaffe.watch.tensorboard import event_files, read_events
    _setup(tmp_path, solver=TB_SOLVER.replace("snap/tb", str(tmp_path / "snap" / "tb")))
    param, _ = read_solver_param(str(tmp_path / "solver.prototxt"))
    param.net = str(tmp_path / "net.prototxt")
    param.minicaffe_tensorboard_dir = str(tmp_path / "tb")
    train_threads(param, [None, None], str(tmp_path / "solver.prototxt"))
    files = event_files(tmp_path / "tb")
    assert len(files) == 1
    assert [i for i, _ in read_events(files[0]).points("train/smoothed_loss")] == \
        [0, 2, 4, 6, 8, 10]


# -- minicaffe plot ----------------------------------------------------------------------
def test_plot_writes_caffes_chart_types(cli, tmp_path):
    pytest.importorskip("matplotlib")
    from minicaffe.watch.plot import chart_series
    (tmp_path / "caffe.log").write_text(CAFFE_LOG)
    rc, out, err = cli("plot", "caffe.log", "--out", "lr.svg", "--chart", "4")
    assert rc == 0, err
    svg = (tmp_path / "lr.svg").read_text()
    assert "<svg" in svg and "Train learning rate vs. Iters" in svg
    assert chart_series(str(tmp_path / "caffe.log"), 4) == \
        ([0, 100, 200, 300], [0.01, 0.00992565, 0.00985258, 0.00978075])
    assert chart_series(str(tmp_path / "caffe.log"), 0)[1] == [0.0997, 0.9713, 0.9786]
    rc, out, err = cli("plot", "caffe.log")          # the overview, PNG
    assert rc == 0 and (tmp_path / "caffe.log.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out, err = cli("plot", "caffe.log", "--chart", "9")
    assert rc == 1 and "chart types are 0-7" in err
    rc, out, err = cli("plot", "caffe.log", "--out", "x.gif")
    assert rc == 1 and "png, svg, pdf" in err and not (tmp_path / "x.gif").exists()


def test_plot_without_matplotlib_says_what_to_install(tmp_path):
    (tmp_path / "caffe.log").write_text(CAFFE_LOG)
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from minicaffe.cli import main; sys.exit(main(['plot', 'caffe.log']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and 'pip install ".[plot]"' in r.stderr
    assert not list(tmp_path.glob("*.png"))


# -- the progress line ------------------------------------------------------------------------
PROGRESS_SOLVER = """net: "net.prototxt"
base_lr: 0.01
lr_policy: "fixed"
display: 500
max_iter: 3000
average_loss: 10
snapshot_prefix: "snap/p"
solver_mode: CPU
snapshot_after_train: false
"""


@pytest.mark.skipif(sys.platform != "linux", reason="needs a pseudo-terminal")
def test_progress_line_on_a_terminal_and_the_log_unchanged_elsewhere(tmp_path, on_a_tty):
    _setup(tmp_path, net=DUMMY_NET, solver=PROGRESS_SOLVER)
    status, tty = on_a_tty([sys.executable, "-m", "minicaffe", "train", "--solver",
                            "solver.prototxt", "--log", "tty.log"], tmp_path, _env())
    assert status == 0
    line = re.findall(r"it (\d+)/3000 \[[\d:]+<[\d:?]+, loss ([\d.e+-]+), lr 0\.01, "
                      r"([\d.k]+) img/s, data wait (n/a|\d+%)\]", tty)
    assert line, tty[-2000:]
    assert len({n for n, *_ in line}) >= 2 and all(int(n) <= 3000 for n, *_ in line)
    # through a pipe: only the Caffe log, the same lines as the log file holds
    r = subprocess.run([sys.executable, "-m", "minicaffe", "train", "--solver",
                        "solver.prototxt", "--log", "pipe.log"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True)
    assert r.returncode == 0 and "img/s" not in r.stderr and "\r" not in r.stderr
    msgs = [l.split("] ", 1)[1] for l in r.stderr.splitlines() if "] " in l]
    assert msgs == [l.split("] ", 1)[1] for l in (tmp_path / "pipe.log").read_text().splitlines()
                    if "] " in l]
    for name in ("tty.log", "pipe.log"):
        train, _ = parse_log(tmp_path / name)
        assert [int(r["NumIters"]) for r in train] == list(range(0, 3000, 500))
        assert "img/s" not in (tmp_path / name).read_text()


def test_progress_line_text():
    from minicaffe.watch.progress import describe

    class S:
        losses, smoothed_loss, lr, data_wait_share = [1.0], 0.25, 0.001, 0.125
    assert describe(S(), 10.0, 64) == "loss 0.25, lr 0.001, 640 img/s, data wait 12%"
    assert describe(S(), 1000.0, 64).startswith("loss 0.25, lr 0.001, 64.0k img/s")
    S.data_wait_share = None
    assert describe(S()).endswith("data wait n/a")


@pytest.mark.gpu
def test_gpu_run_records_device_memory_and_the_logs_values(cli, tmp_path):
    """On a GPU: the event file holds device memory and the same losses as the log."""
    pytest.importorskip("tensorboardX")
    from minicaffe.watch.tensorboard import read_events
    _setup(tmp_path, solver=TB_SOLVER)
    rc, out, err = cli("train", "--solver", "solver.prototxt", "--gpu", "0", "--log", "run.log",
                       "--tensorboard", "tb")
    assert rc == 0, err
    rec = read_events(tmp_path / "tb")
    train, _ = parse_log(tmp_path / "run.log")
    assert [(int(r["NumIters"]), r["loss"]) for r in train] == \
        [(i, pytest.approx(v, rel=1e-5)) for i, v in rec.points("train/loss")]
    mem = rec.points("device_memory_mib")
    assert len(mem) == len(train) and all(v > 0 for _, v in mem)
    assert rec.facts["devices"] == "GPU 0" and "fp32" in rec.facts["precision"]
