"""What the dashboard costs a training run: the same LeNet run (MNIST, batch 64, Caffe's
lenet_solver settings, display every 10 iterations, a test every 100) with and without
``minicaffe.watch.serve`` and a client polling the page's data 10 times a second (ten
times what the page itself asks).  Rounds alternate (without, with, without, ...), each
on a fresh solver; the median ms/iteration of each side and the ratio are printed.

    python benchmarks/dashboard_overhead.py [--iters 300] [--rounds 3] [--gpu]
                                            [--mnist DIR] [--poll_s 0.1]

MNIST's t10k set is converted to a temporary LMDB (from --mnist, $MINICAFFE_MNIST_DIR,
data/mnist or ../shared/data/mnist).
"""
import argparse
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from minicaffe import context, log  # noqa: E402
from minicaffe.solvers import get_solver, read_solver_param  # noqa: E402

SOLVER = """net: "{net}"
test_iter: 10
test_interval: 100
test_initialization: false
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 10
max_iter: 1000000
snapshot_after_train: false
random_seed: 1701
"""


def mnist_dir(given):
    for d in (given, os.environ.get("MINICAFFE_MNIST_DIR"), os.path.join(ROOT, "data", "mnist"),
              os.path.join(ROOT, "..", "shared", "data", "mnist")):
        if d and os.path.isfile(os.path.join(d, "t10k-images-idx3-ubyte.gz")):
            return d
    sys.exit("dashboard_overhead.py: MNIST not found (give --mnist DIR holding "
             "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz)")


def prepare(tmp, mnist):
    from minicaffe.data.convert import convert_mnist
    db = os.path.join(tmp, "mnist_lmdb")
    convert_mnist(os.path.join(mnist, "t10k-images-idx3-ubyte.gz"),
                  os.path.join(mnist, "t10k-labels-idx1-ubyte.gz"), db)
    with open(os.path.join(ROOT, "examples", "mnist", "lenet_train_test.prototxt")) as f:
        net = re.sub(r"examples/mnist/mnist_(train|test)_lmdb", db, f.read())
    net_path = os.path.join(tmp, "lenet.prototxt")
    with open(net_path, "w") as f:
        f.write(net)
    solver_path = os.path.join(tmp, "solver.prototxt")
    with open(solver_path, "w") as f:
        f.write(SOLVER.format(net=net_path))
    return solver_path


def poller(url, stop, every_s, counter):
    while not stop.wait(every_s):
        with urllib.request.urlopen(url + "api/run", timeout=10) as r:
            r.read()
        counter[0] += 1


def one_round(solver_path, iters, dashboard, poll_s):
    param, _ = read_solver_param(solver_path)
    solver = get_solver(param)
    solver.step(20)                     # warm-up (first display, caches)
    stop, polls, d, t = threading.Event(), [0], None, None
    if dashboard:
        from minicaffe.watch import serve
        d = serve(solver, port=0)
        t = threading.Thread(target=poller, args=(d.url, stop, poll_s, polls), daemon=True)
        t.start()
    start = time.perf_counter()
    solver.step(iters)
    if context.is_gpu():
        from minicaffe import backend
        backend.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / iters
    stop.set()
    if t is not None:
        t.join()
        d.close()
    solver.close()
    return ms, polls[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--mnist", default=None)
    ap.add_argument("--poll_s", type=float, default=0.1)
    a = ap.parse_args()
    log.init_log(level=40)              # errors only: the same (silent) log on both sides
    if a.gpu:
        context.set_mode_gpu()
    with tempfile.TemporaryDirectory() as tmp:
        solver_path = prepare(tmp, mnist_dir(a.mnist))
        without, with_ = [], []
        for r in range(a.rounds):
            ms, _ = one_round(solver_path, a.iters, False, a.poll_s)
            without.append(ms)
            ms, polls = one_round(solver_path, a.iters, True, a.poll_s)
            with_.append(ms)
            print(f"round {r + 1}: without {without[-1]:.2f} ms/iter, with dashboard "
                  f"{with_[-1]:.2f} ms/iter ({polls} polls)", flush=True)
    a_ms, b_ms = statistics.median(without), statistics.median(with_)
    print(f"LeNet b64 {'GPU' if a.gpu else 'CPU'}, {a.iters} iterations x {a.rounds} rounds, "
          f"display every 10, polled every {a.poll_s:g} s")
    print(f"median without dashboard: {a_ms:.2f} ms/iter")
    print(f"median with dashboard:    {b_ms:.2f} ms/iter")
    print(f"overhead: {100 * (b_ms / a_ms - 1):+.2f}%")


if __name__ == "__main__":
    main()
