"""What the dashboard costs a training run: one LeNet run (MNIST, batch 64, Caffe's
lenet_solver settings, display every 10 iterations, a test every 100) timed in blocks
that alternate without and with the dashboard: with, the Solver's observer records every
display and test and a client (a process of its own, as a browser) fetches the whole
record (``api/run``, no ``since``) every ``--poll_s`` seconds (0.1: ten times what the
page asks); without, the observer is detached and the client stopped (SIGSTOP).  Each
pair of blocks gives a ratio; the median ratio, the medians and the total are printed.
Pairs of adjacent blocks cancel most of the drift of a shared machine's load.

    python benchmarks/dashboard_overhead.py [--iters 100] [--pairs 10] [--gpu]
                                            [--mnist DIR] [--poll_s 0.1]

MNIST's t10k set is converted to a temporary LMDB (from --mnist, $MINICAFFE_MNIST_DIR,
data/mnist or ../shared/data/mnist).
"""
import argparse
import os
import re
import statistics
import sys
import signal
import subprocess
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from minicaffe.core import context, log  # noqa: E402
from minicaffe.solvers import get_solver, read_solver_param  # noqa: E402

SOLVER = """net: "{net}"
test_iter: 10
test_interval: {test_interval}
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


def prepare(tmp, mnist, test_interval):
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
        f.write(SOLVER.format(net=net_path, test_interval=test_interval))
    return solver_path


POLLER = """
import sys, time, urllib.request
url, every = sys.argv[1], float(sys.argv[2])
n = 0
try:
    while True:
        time.sleep(every)
        with urllib.request.urlopen(url + "api/run", timeout=10) as r:
            r.read()
        n += 1
except KeyboardInterrupt:
    print(n)
"""


def start_poller(url, every_s):
    """A client in a process of its own, as a browser would be."""
    return subprocess.Popen([sys.executable, "-c", POLLER, url, str(every_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def poll_cost(page, n=200):
    """Seconds the server spends per /api/run of the run's record (measured in this thread)."""
    import json
    start = time.perf_counter()
    for _ in range(n):
        json.dumps(page.run.to_dict(), allow_nan=False).encode()
    return (time.perf_counter() - start) / n


def timed(solver, iters):
    start = time.perf_counter()
    solver.step(iters)
    if context.is_gpu():
        from minicaffe.core import backend
        backend.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=100, help="iterations per block")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--mnist", default=None)
    ap.add_argument("--poll_s", type=float, default=0.1)
    a = ap.parse_args()
    log.init_log(level=40)              # errors only: the same (silent) log on both sides
    if a.gpu:
        context.set_mode_gpu()
    from minicaffe.watch import serve
    with tempfile.TemporaryDirectory() as tmp:
        # one test at the start of every block: blocks of both kinds hold the same work
        param, _ = read_solver_param(prepare(tmp, mnist_dir(a.mnist), a.iters))
        solver = get_solver(param)
        solver.step(a.iters)            # warm-up (first display, test, caches)
        page = serve(solver, port=0)    # attaches its Recorder
        recorder = solver.observers[-1]
        client = start_poller(page.url, a.poll_s)
        ratios, without, with_ = [], [], []
        try:
            for k in range(a.pairs):
                # without: no observer, the client stopped (the idle server thread stays)
                solver.observers.remove(recorder)
                client.send_signal(signal.SIGSTOP)
                without.append(timed(solver, a.iters))
                solver.observers.append(recorder)
                client.send_signal(signal.SIGCONT)
                time.sleep(0.2)
                with_.append(timed(solver, a.iters))
                ratios.append(with_[-1] / without[-1])
                print(f"pair {k + 1}: without {without[-1]:.2f} ms/iter, with dashboard "
                      f"{with_[-1]:.2f} ms/iter ({100 * (ratios[-1] - 1):+.2f}%)", flush=True)
        finally:
            client.send_signal(signal.SIGCONT)
            client.send_signal(signal.SIGINT)
            polls = int(client.communicate(timeout=30)[0].strip() or 0)
            page.close()
            solver.close()
        per_poll = poll_cost(page)
    print(f"LeNet b64 {'GPU' if a.gpu else 'CPU'}, {a.pairs} pairs of {a.iters}-iteration "
          f"blocks, display every 10, the data polled every {a.poll_s:g} s ({polls} polls)")
    print(f"median without dashboard: {statistics.median(without):.2f} ms/iter")
    print(f"median with dashboard:    {statistics.median(with_):.2f} ms/iter")
    print(f"serving one poll of this run's record (to_dict + JSON, the server's work on the "
          f"GIL): {per_poll * 1e3:.3f} ms")
    print(f"overhead, median of the pairs: {100 * (statistics.median(ratios) - 1):+.2f}%  "
          f"(total time: {100 * (sum(with_) / sum(without) - 1):+.2f}%)")


if __name__ == "__main__":
    main()
