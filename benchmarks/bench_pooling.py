"""numpy pooling kernels, fast paths against the general path.

Usage::

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_pooling.py [--repeat 10]

For the pooling shapes of CIFAR-10 quick (batch 100) and LeNet (batch 64),
prints the minimum CPU time of the process over ``--repeat`` calls, in ms, of
MAX forward, MAX backward, AVE forward and AVE backward, with
``kernels.pooling.FAST_PATH`` off ("general") and on ("fast"), on random
normal float32 inputs.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from minicaffe.kernels import pooling as pl  # noqa: E402

SHAPES = [  # (x shape, kernel, stride, pad, where)
    ((100, 32, 32, 32), 3, 2, 0, "CIFAR-10 pool1"),
    ((100, 32, 16, 16), 3, 2, 0, "CIFAR-10 pool2"),
    ((100, 64, 8, 8), 3, 2, 0, "CIFAR-10 pool3"),
    ((64, 20, 24, 24), 2, 2, 0, "LeNet pool1"),
    ((64, 50, 8, 8), 2, 2, 0, "LeNet pool2"),
]


def best(f, n):
    b = float("inf")
    for _ in range(n):
        t0 = time.process_time()
        f()
        b = min(b, time.process_time() - t0)
    return b * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args(argv)
    rng = np.random.RandomState(0)
    print(f"{'shape':<34} {'path':<8} {'max fw':>7} {'max bw':>7} {'ave fw':>7} {'ave bw':>7}")
    for shape, k, s, p, where in SHAPES:
        x = rng.randn(*shape).astype(np.float32)
        for fast in (False, True):
            pl.FAST_PATH = fast
            y, m = pl.max_pool_forward(x, k, s, p)
            dy = rng.randn(*y.shape).astype(np.float32)
            r = [best(lambda: pl.max_pool_forward(x, k, s, p), a.repeat),
                 best(lambda: pl.max_pool_backward(dy, m, x.shape, k, s, p), a.repeat),
                 best(lambda: pl.ave_pool_forward(x, k, s, p), a.repeat),
                 best(lambda: pl.ave_pool_backward(dy, x.shape, k, s, p), a.repeat)]
            label = f"{where} {k}x{k} s{s}"
            print(f"{label:<34} {'fast' if fast else 'general':<8} "
                  + " ".join(f"{v:7.2f}" for v in r))
    pl.FAST_PATH = True


if __name__ == "__main__":
    main()
