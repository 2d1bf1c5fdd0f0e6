"""Data and ImageData read through worker processes (minicaffe/data/workers.py): the same
batches as the prefetch thread alone, whatever the number of workers (key order,
wrap-around, rand_skip, sharding, crops and mirrors drawn in the consumer); the settings
(data_param.workers, $MINICAFFE_DECODE_THREADS, `minicaffe train --data_workers`); one-line
errors naming the layer, the source and the record; a killed worker ends training with one
line; no child process and no shared-memory file is left after any ending; spawned workers
do not re-run the user's script."""
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.blob import Blob
from minicaffe.data.db import array_to_datum
from minicaffe.core.errors import LayerError
from minicaffe.proto import caffe_pb2
from test_data_layers import data_layer, image_layer, make_db, one_line, run  # noqa: F401
from test_data_layers import image_list, info_log  # noqa: F401  (fixtures)

pytest.importorskip("lmdb")
TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    """The environment for a child python: this checkout first, then the caller's path."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def shm_files():
    d = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return sorted(f for f in os.listdir(d) if f.startswith(f"minicaffe-{os.getpid()}-")) if d else []


@pytest.fixture(autouse=True)
def nothing_left_behind(monkeypatch):
    monkeypatch.delenv("MINICAFFE_DECODE_THREADS", raising=False)
    yield
    gc.collect()
    deadline = time.time() + 5
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.02)
    assert not multiprocessing.active_children(), "a data worker outlived its test"
    assert not shm_files(), "a shared-memory file outlived its test"


@pytest.fixture
def photos():
    return np.random.RandomState(0).randint(0, 256, (11, 3, 9, 10)).astype(np.uint8)


def batches(layer, n):
    top, out = run(layer, n)
    layer.close()
    return out


@pytest.mark.parametrize("encoded", [None, "png"])
def test_workers_give_the_prefetch_threads_batches(tmp_path, photos, encoded, info_log):
    """Crops and mirrors, key order, wrap-around and rand_skip: 0, 1 and 3 workers agree."""
    src = make_db(tmp_path / "db", photos, encoded=encoded)
    outs = []
    for workers in (0, 1, 3):
        context.set_random_seed(11)
        layer = data_layer(src, batch=4, extra=f"rand_skip: 5 workers: {workers}",
                           transform="crop_size: 7 mirror: true scale: 0.5 mean_value: 3")
        outs.append(batches(layer, 6))  # 24 records of 11: two wrap-arounds
    for out in outs[1:]:
        for (d0, l0), (d1, l1) in zip(outs[0], out):
            np.testing.assert_array_equal(d0, d1)
            np.testing.assert_array_equal(l0, l1)
    assert any("3 data worker processes, a ring of 3 batch slots" in l for l in info_log)
    assert sum("Restarting data prefetching from start." in l for l in info_log) >= 6


def test_workers_shard_like_the_thread(tmp_path):
    imgs = np.arange(12 * 4, dtype=np.uint8).reshape(12, 1, 2, 2)
    src = make_db(tmp_path / "db", imgs)
    seen = []
    try:
        context.set_solver_count(2)
        for r in range(2):
            context.set_solver_rank(r)
            out = batches(data_layer(src, batch=2, extra="workers: 2"), 3)
            labels = np.concatenate([l for _, l in out]).astype(int)
            assert all(i % 2 == r for i in labels)
            seen.append(set(labels))
    finally:
        context.set_solver_count(1)
        context.set_solver_rank(0)
    assert seen[0] | seen[1] == set(range(12)) and not seen[0] & seen[1]


def test_image_data_through_workers(image_list, monkeypatch):  # noqa: F811
    tmp_path, arrays = image_list
    outs = []
    for workers in ("0", "2"):
        monkeypatch.setenv("MINICAFFE_DECODE_THREADS", workers)
        context.set_random_seed(4)
        outs.append(batches(image_layer(tmp_path, "batch_size: 3 shuffle: true",
                                        "mirror: true crop_size: 5"), 5))
    for (d0, l0), (d1, l1) in zip(*outs):
        np.testing.assert_array_equal(d0, d1)
        np.testing.assert_array_equal(l0, l1)


def test_the_variable_overrides_the_field_and_a_bad_value_is_one_line(tmp_path, photos,
                                                                        monkeypatch, info_log):
    src = make_db(tmp_path / "db", photos, encoded="png")
    monkeypatch.setenv("MINICAFFE_DECODE_THREADS", "2")
    batches(data_layer(src, batch=2, extra="workers: 5"), 1)
    assert any("2 data worker processes" in l for l in info_log)
    monkeypatch.setenv("MINICAFFE_DECODE_THREADS", "four")
    with pytest.raises(LayerError) as e:
        run(data_layer(src, batch=2), 1)
    assert "MINICAFFE_DECODE_THREADS='four' is not valid: accepted values are an integer >= 0" \
        in one_line(e.value)
    monkeypatch.setenv("MINICAFFE_DECODE_THREADS", "0")  # 0: the prefetch thread alone
    info_log.clear()
    batches(data_layer(src, batch=2), 1)
    assert not any("data worker processes" in l for l in info_log)


def _expect_error(layer, n_ok, match):
    top = [Blob(), Blob()]
    layer.setup([], top)
    for _ in range(n_ok):
        layer.forward([], top)
    t0 = time.time()
    with pytest.raises(LayerError) as e:
        layer.forward([], top)
    assert time.time() - t0 < 10
    msg = one_line(e.value)
    assert msg.startswith("layer 'd' (Data): ") and match in msg, msg
    with pytest.raises(LayerError):  # the error stays: no hang on a second try
        layer.forward([], top)
    layer.close()
    return msg


def test_record_errors_name_the_key_through_workers(tmp_path, photos):
    odd = array_to_datum(np.zeros((3, 9, 7), np.uint8), 0).SerializeToString()
    src = make_db(tmp_path / "a", photos, encoded="png", values={5: odd})
    _expect_error(data_layer(src, batch=2, extra="workers: 2"), 2,
                  "a: key 00000005: Datum shape 3x9x7 differs from the first datum's 3x9x10")
    src = make_db(tmp_path / "b", photos, encoded="png", values={3: b"\xff\xfe\x00garbage"})
    _expect_error(data_layer(src, batch=2, extra="workers: 2"), 1,
                  "b: key 00000003: not a valid Datum")
    bad = caffe_pb2.Datum(data=b"\x89PNG but not really", encoded=True).SerializeToString()
    src = make_db(tmp_path / "c", photos, encoded="png", values={4: bad})
    _expect_error(data_layer(src, batch=2, extra="workers: 2"), 2,
                  "c: key 00000004: cannot decode image")


def test_a_killed_worker_ends_the_layer_with_one_line(tmp_path, photos):
    src = make_db(tmp_path / "db", photos, encoded="png")
    layer = data_layer(src, batch=4, extra="workers: 2")
    top = [Blob(), Blob()]
    layer.setup([], top)
    layer.forward([], top)
    for p in multiprocessing.active_children():
        os.kill(p.pid, signal.SIGKILL)
    t0 = time.time()
    with pytest.raises(LayerError) as e:
        for _ in range(10):  # the batches already filled come first
            layer.forward([], top)
    assert time.time() - t0 < 10
    msg = one_line(e.value)
    assert "died (killed by SIGKILL)" in msg and "db: key " in msg, msg
    layer.close()


SCRIPT = """
print("SCRIPT RAN", flush=True)
import numpy as np
import minicaffe
from minicaffe.core.blob import Blob
from minicaffe.compat.testing import make_layer
layer = make_layer('name: "d" type: "Data" top: "data" top: "label" '
                   'data_param {{ source: "{src}" batch_size: 2 backend: LMDB workers: 2 }}')
top = [Blob(), Blob()]
layer.setup([], top)
layer.forward([], top)
print("LABELS", top[1].data.astype(int).tolist(), flush=True)
layer.close()
"""


def test_spawned_workers_do_not_rerun_the_users_script(tmp_path, photos):
    """No `if __name__ == "__main__"` guard: the script still runs once."""
    src = make_db(tmp_path / "db", photos, encoded="png")
    (tmp_path / "user.py").write_text(SCRIPT.format(src=src))
    r = subprocess.run([sys.executable, str(tmp_path / "user.py")], capture_output=True,
                       text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("SCRIPT RAN") == 1 and "LABELS [0, 1]" in r.stdout


NET = """name: "w"
layer {{ name: "d" type: "Data" top: "data" top: "label"
  transform_param {{ crop_size: 8 mirror: true scale: 0.01 }}
  data_param {{ source: "{src}" backend: LMDB batch_size: 4 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 64 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""
SOLVER = """net: "{net}"
base_lr: 0.01
lr_policy: "fixed"
display: 1
max_iter: {max_iter}
snapshot_prefix: "{prefix}"
solver_mode: CPU
random_seed: 3
"""


def _children(pid):
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "kill-worker"])
def test_train_ends_cleanly_with_workers(tmp_path, photos, how):
    """`minicaffe train --data_workers 2`, stopped by Ctrl-C, by SIGTERM, or by a worker
    killed with SIGKILL: the process ends (one line for the dead worker), leaving no child
    process and no shared-memory file."""
    src = make_db(tmp_path / "db", np.repeat(photos, 4, axis=0), encoded="png")
    (tmp_path / "net.prototxt").write_text(NET.format(src=src))
    (tmp_path / "solver.prototxt").write_text(SOLVER.format(
        net=tmp_path / "net.prototxt", max_iter=100000, prefix=tmp_path / "s"))
    p = subprocess.Popen([sys.executable, "-m", "minicaffe", "train", "--solver",
                          str(tmp_path / "solver.prototxt"), "--data_workers", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=_env(), cwd=str(tmp_path))
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "Iteration 3 " in line:
                break
        workers = _children(p.pid)
        assert len(workers) >= 2, "".join(lines)
        if how == "kill-worker":
            os.kill(workers[-1], signal.SIGKILL)
        else:
            p.send_signal(getattr(signal, how))
        rest, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = "".join(lines) + rest
    if how == "kill-worker":
        assert p.returncode != 0
        errors = [l for l in rest.splitlines() if "died (killed by SIGKILL)" in l]
        assert len(errors) == 1 and "Traceback" not in rest, rest[-3000:]
        assert "layer 'd' (Data)" in errors[0] and "db: key " in errors[0]
    else:
        assert f"Stopped by {how}" in text, text[-3000:]
    deadline = time.time() + 10
    while any(os.path.exists(f"/proc/{w}") for w in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}")], "a worker is still there"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"minicaffe-{p.pid}-")]


def test_display_shows_the_data_wait_and_says_once_when_input_is_the_bottleneck(tmp_path):
    """``Solver.data_wait_share`` (read by the dashboard) is the share of the last display
    interval the step waited for input, shown in the display line; the bottleneck line
    comes once, exactly when a share went over 10%.  (PNGs decoded by the prefetch thread
    alone feed a net of one small layer, so waits are likely, but nothing depends on it.)"""
    import re
    from minicaffe.solvers import get_solver
    from test_solver_nets import captured_log, messages
    big = np.random.RandomState(0).randint(0, 256, (8, 3, 96, 96)).astype(np.uint8)
    src = make_db(tmp_path / "db", big, encoded="png")
    (tmp_path / "net.prototxt").write_text(NET.format(src=src).replace(
        "backend: LMDB", "backend: LMDB workers: 0"))
    (tmp_path / "solver.prototxt").write_text(SOLVER.format(
        net=tmp_path / "net.prototxt", max_iter=12, prefix=tmp_path / "s").replace(
        "display: 1", "display: 3"))
    s = get_solver(str(tmp_path / "solver.prototxt"))
    assert s.data_wait_share is None
    try:
        with captured_log() as lines:
            s.step(12)
    finally:
        s.close()
    msgs = messages(lines)
    shown = [float(m) / 100 for m in re.findall(r"iters, data wait ([\d.]+)%\), loss = ",
                                                "\n".join(msgs))]
    assert len(shown) == 3  # the first display of a step starts the interval
    assert all(0.0 <= x <= 1.0 for x in shown)
    assert abs(s.data_wait_share - shown[-1]) < 1e-3
    said = [m for m in msgs if m.startswith("Input is the bottleneck")]
    assert len(said) == (1 if max(shown) > 0.10 else 0)
    if said:
        assert "--data_workers N" in said[0] and "MINICAFFE_DECODE_THREADS" in said[0]


def test_the_data_workers_flag(tmp_path, photos, monkeypatch, capsys):
    """`minicaffe train --data_workers N` sets the workers of every data layer for that
    command only; a negative count is one line and a non-zero exit."""
    from minicaffe.cli import main
    src = make_db(tmp_path / "db", photos, encoded="png")
    (tmp_path / "net.prototxt").write_text(NET.format(src=src).replace("batch_size: 4",
                                                                       "batch_size: 2"))
    (tmp_path / "solver.prototxt").write_text(SOLVER.format(
        net=tmp_path / "net.prototxt", max_iter=2, prefix=tmp_path / "s"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--solver", "solver.prototxt", "--data_workers", "-1"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == ("minicaffe: error: --data_workers -1: expected the "
                                            "number of data worker processes (0 reads in the "
                                            "prefetch thread)")
    assert main(["train", "--solver", "solver.prototxt", "--data_workers", "3"]) == 0
    err = capsys.readouterr().err
    assert "layer 'd': 3 data worker processes" in err
    assert "MINICAFFE_DECODE_THREADS" not in os.environ  # for that command only
