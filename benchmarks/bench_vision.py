"""Time the CPU convolution layers of LeNet (batch 64) and CIFAR-10 quick
(batch 100), forward and backward, one layer at a time, float32.

    /work/venv/bin/python benchmarks/bench_vision.py [--repeat 20] [--baseline] [--torch]

Prints ms per call (the minimum and the median of ``--repeat`` runs after two
warm-up calls) for forward, backward (weights, bias and bottom) and their sum,
and the totals per net.  ``--baseline`` also times the seed's engine (fresh
im2col/col2im arrays per call, one 64 MiB chunk) on the same shapes in the
same process, so the two can be compared as a ratio; ``--torch`` times
torch.nn.functional.conv2d forward+backward (PyTorch installed).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minicaffe.core import context  # noqa: E402
from minicaffe import kernels as K  # noqa: E402
from minicaffe.core.blob import Blob  # noqa: E402
from minicaffe.compat.testing import make_layer  # noqa: E402

# (net, name, batch, channels, H, W, num_output, kernel, pad, stride)
CONVS = [
    ("lenet", "conv1", 64, 1, 28, 28, 20, 5, 0, 1),
    ("lenet", "conv2", 64, 20, 12, 12, 50, 5, 0, 1),
    ("cifar10_quick", "conv1", 100, 3, 32, 32, 32, 5, 2, 1),
    ("cifar10_quick", "conv2", 100, 32, 16, 16, 32, 5, 2, 1),
    ("cifar10_quick", "conv3", 100, 32, 8, 8, 64, 5, 2, 1),
]


CLOCK = time.perf_counter


def _times_ms(fn, repeat):
    fn()
    fn()
    times = []
    for _ in range(repeat):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return 1e3 * min(times), 1e3 * float(np.median(times))


# -- the seed's engine (before this work), kept here as the reference point ---------------
def _seed_chunks(N, per_sample, budget=64 << 20):
    per = max(1, budget // per_sample)
    return [(n0, min(N, n0 + per)) for n0 in range(0, N, per)]


def seed_forward(x, w, b, k, p, s):
    N, C = x.shape[:2]
    O = w.shape[0]
    OH = (x.shape[2] + 2 * p - k) // s + 1
    OW = (x.shape[3] + 2 * p - k) // s + 1
    w2 = w.reshape(O, -1)
    y = np.empty((N, O, OH, OW), x.dtype)
    for n0, n1 in _seed_chunks(N, C * k * k * OH * OW * x.itemsize):
        col = K.im2col(x[n0:n1], k, p, s, 1)
        y[n0:n1] = (w2 @ col).reshape(O, n1 - n0, OH, OW).swapaxes(0, 1)
    y += b.reshape(1, -1, 1, 1)
    return y


def seed_backward(x, w, dy, dw, db, k, p, s):
    N, C = x.shape[:2]
    O = w.shape[0]
    OH, OW = dy.shape[2:]
    w2 = w.reshape(O, -1)
    dw2 = dw.reshape(O, -1)
    db += dy.sum(axis=(0, 2, 3))
    dx = np.empty_like(x)
    for n0, n1 in _seed_chunks(N, C * k * k * OH * OW * x.itemsize):
        n = n1 - n0
        dy2 = dy[n0:n1].swapaxes(0, 1).reshape(O, n * OH * OW)
        col = K.im2col(x[n0:n1], k, p, s, 1)
        dw2 += dy2 @ col.T
        dx[n0:n1] = K.col2im(w2.T @ dy2, x[n0:n1].shape, k, p, s, 1)
    return dx


def bench(repeat, which):
    rows = []
    for net, name, n, c, h, w, o, k, p, s in CONVS:
        rs = np.random.RandomState(0)
        if which == "torch":
            import torch
            x = torch.rand(n, c, h, w, requires_grad=True)
            wt = torch.rand(o, c, k, k, requires_grad=True)
            b = torch.rand(o, requires_grad=True)
            g = torch.rand(torch.nn.functional.conv2d(x, wt, b, s, p).shape)

            def fb():
                torch.nn.functional.conv2d(x, wt, b, s, p).backward(g)
            rows.append((net, name, None, None, _times_ms(fb, repeat)))
            continue
        layer = make_layer(f'name: "{name}" type: "Convolution" convolution_param {{ '
                           f'num_output: {o} kernel_size: {k} pad: {p} stride: {s} '
                           f'weight_filler {{ type: "xavier" }} }}')
        x = Blob((n, c, h, w), np.float32)
        x.data[...] = rs.uniform(-1, 1, x.shape)
        top = Blob(dtype=np.float32)
        layer.setup([x], [top])
        top.diff[...] = rs.uniform(-1, 1, top.shape)
        if which == "minicaffe":
            fwd = _times_ms(lambda: layer.forward([x], [top]), repeat)
            bwd = _times_ms(lambda: layer.backward([top], [True], [x]), repeat)
        else:
            xd, wd, bd, dyd = x.data, layer.blobs[0].data, layer.blobs[1].data, top.diff
            dw, db = np.zeros_like(wd), np.zeros_like(bd)
            fwd = _times_ms(lambda: seed_forward(xd, wd, bd, k, p, s), repeat)
            bwd = _times_ms(lambda: seed_backward(xd, wd, dyd, dw, db, k, p, s), repeat)
        rows.append((net, name, fwd, bwd, None))
    return rows


def report(title, rows):
    print(title)
    print(f"  {'net':<14} {'layer':<6} {'fwd min/med':>15} {'bwd min/med':>15} "
          f"{'f+b min/med':>15}")
    totals = {}
    for net, name, fwd, bwd, fb in rows:
        if fb is None:
            fb = (fwd[0] + bwd[0], fwd[1] + bwd[1])
        t = totals.setdefault(net, [0.0, 0.0])
        t[0] += fb[0]
        t[1] += fb[1]
        cell = (lambda v: f"{v[0]:7.2f}/{v[1]:7.2f}" if v else " " * 15)
        print(f"  {net:<14} {name:<6} {cell(fwd)} {cell(bwd)} {cell(fb)}")
    for net, t in totals.items():
        print(f"  {net:<14} {'total':<6} {'':>15} {'':>15} {t[0]:7.2f}/{t[1]:7.2f}")
    return totals


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--baseline", action="store_true")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--clock", choices=["wall", "process"], default="wall",
                    help="process: this process's CPU time (meaningful with one BLAS "
                         "thread, OPENBLAS_NUM_THREADS=1; steadier than wall time on a "
                         "shared machine; torch then runs one thread too)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "process" else time.perf_counter
    context.set_mode_cpu()
    print(f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')} "
          f"cpus={os.cpu_count()} loadavg={os.getloadavg()[0]:.2f} clock={args.clock}; "
          f"ms per call")
    new = report("minicaffe (this tree)", bench(args.repeat, "minicaffe"))
    if args.baseline:
        old = report("seed engine", bench(args.repeat, "seed"))
        for net in new:
            print(f"  {net}: seed/this = {old[net][0] / new[net][0]:.2f}x (min), "
                  f"{old[net][1] / new[net][1]:.2f}x (median)")
    if args.torch:
        import torch
        if args.clock == "process":  # CPU time of spinning threads is not work: one thread
            torch.set_num_threads(1)
        report(f"torch {torch.__version__} conv2d forward+backward, "
               f"threads={torch.get_num_threads()}", bench(args.repeat, "torch"))


if __name__ == "__main__":
    main()
