"""The GEMMs alone of minicaffe's numpy convolutions, per training step (prints figures, not
a test): how much of the CPU step is BLAS time that no numpy-side change can remove.

    OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_gemm_bound.py [--net LeNet|"CIFAR-10 quick"]
        [--repeat 10]

For each convolution of the net (benchmarks/cpu_vs_torch.py's nets and batches) the script
times, on random float32 arrays of the same shapes and memory layouts, the matrix products
kernels/conv.py runs for one step: the forward, the weight gradient and (where the layer
propagates down) the data gradient, chunk by chunk as the engine splits the batch.  The
copies around them (im2col, padding, col2im, layout changes) are not timed.  Printed
per product: ms per step (the minimum over ``--repeat`` runs) and GFLOP/s; then the sum,
and a square 2048^3 product for OpenBLAS's own single-thread rate on this machine.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (name, C, O, H=W, kernel, pad, propagates down) of the nets' convolutions (stride 1)
NETS = {"LeNet": (64, [("conv1", 1, 20, 28, 5, 0, False), ("conv2", 20, 50, 12, 5, 0, True)]),
        "CIFAR-10 quick": (100, [("conv1", 3, 32, 32, 5, 2, False),
                                 ("conv2", 32, 32, 16, 5, 2, True),
                                 ("conv3", 32, 64, 8, 5, 2, True)])}


def best(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def products(N, C, O, H, k, pad, down):
    """(label, multiply-adds, function) of one step's GEMMs of one convolution."""
    from minicaffe.kernels import conv
    OH = H + 2 * pad - k + 1
    P, K = OH * OH, C * k * k
    e = conv.ConvEngine(C, O, 1, (k, k), (pad, pad), (1, 1), (1, 1), (H, H), (OH, OH))
    step = e.chunk(N, 4, conv.COL_BUFFER_BYTES["cpu"], conv.MIN_GEMM_COLUMNS)
    chunks = [min(N, n0 + step) - n0 for n0 in range(0, N, step)]
    rs = np.random.RandomState(0)
    f32 = lambda *s: rs.rand(*s).astype(np.float32)   # noqa: E731
    out = []
    if C < conv.NHWC_MIN_CHANNELS:     # channel-major: per-image products, stacked
        ld = step * P + (16 if (step * P * 4) % 4096 == 0 else 0)   # padded rows
        w, col = f32(O, K), f32(K, ld)[:, :step * P].reshape(K, step, P)
        y, dy, dyr = f32(step, O, P), f32(step, O, P), f32(step * P, O)

        def fwd():
            for n in chunks:
                np.matmul(w, col[:, :n].transpose(1, 0, 2), out=y[:n])

        def dw():
            for n in chunks:
                if k * C >= conv.CN_DW_ROWS_RUN:    # one product against dy as rows
                    np.matmul(col[:, :n].reshape(K, n * P), dyr[:n * P])
                else:                               # the columns' transpose
                    np.matmul(dy[:n], col[:, :n].transpose(1, 2, 0))
        out += [("forward", N * P * K * O, fwd), ("weight gradient", N * P * K * O, dw)]
    else:                              # channel-last patches, one product per chunk
        col, wt, y = f32(step * P, K), f32(K, O), f32(step * P, O)
        dyr, dw_out = f32(step * P, O), f32(O, K)

        def fwd():
            for n in chunks:
                np.matmul(col[:n * P], wt, out=y[:n * P])

        def dw():
            for n in chunks:
                np.matmul(dyr[:n * P].T, col[:n * P], out=dw_out)
        out += [("forward", N * P * K * O, fwd), ("weight gradient", N * P * K * O, dw)]
    if down and e._full_conv_ok():     # a full convolution of dy
        HW = H * H
        dycol, wf, dx = f32(step * HW, k * k * O), f32(k * k * O, C), f32(step * HW, C)

        def dxf():
            for n in chunks:
                np.matmul(dycol[:n * HW], wf, out=dx[:n * HW])
        out.append(("data gradient (full convolution)", N * HW * k * k * O * C, dxf))
    elif down:                         # columns' gradient, then col2im (not timed here)
        dyr, wr, dcol = f32(step * P, O), f32(O, K), f32(step * P, K)

        def dxc():
            for n in chunks:
                np.matmul(dyr[:n * P], wr, out=dcol[:n * P])
        out.append(("data gradient (columns)", N * P * O * K, dxc))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="CIFAR-10 quick", choices=tuple(NETS))
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args(argv)
    N, layers = NETS[a.net]
    print(f"{a.net} b{N}: the numpy convolutions' GEMMs of one training step; numpy "
          f"{np.__version__}; load average {os.getloadavg()[0]:.2f} at start")
    total = 0.0
    for name, C, O, H, k, pad, down in layers:
        for label, macs, fn in products(N, C, O, H, k, pad, down):
            t = best(fn, a.repeat)
            total += t
            print(f"  {name} {label}: {t * 1e3:.2f} ms, {2 * macs / t / 1e9:.1f} GFLOP/s")
    print(f"GEMMs of the convolutions: {total * 1e3:.1f} ms per step")
    n = 2048
    x = np.random.RandomState(1).rand(n, n).astype(np.float32)
    t = best(lambda: x @ x, 3)
    print(f"reference {n}^3 product: {2 * n ** 3 / t / 1e9:.1f} GFLOP/s; load average "
          f"{os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
