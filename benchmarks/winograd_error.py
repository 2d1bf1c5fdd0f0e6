"""The float32 error of the CPU engine's Winograd F(4x4, 5x5) against the direct im2col +
GEMM method (prints figures, not a test).

    python benchmarks/winograd_error.py [--seed 0]

For CIFAR-10 quick's conv2 and conv3 (batch 100) and LeNet's conv2 (batch 64), with
Gaussian inputs, weights (std 0.1, as the fillers' scale) and output gradients: each
method's forward, weight, data and bias gradients in float32 against the direct method
in float64, as the largest absolute error over the largest absolute value of each
result.  The engine is kernels/conv.py's ConvEngine (``winograd=True`` is what a
Convolution layer with ``engine: DEFAULT`` takes on the CPU; ``engine: CAFFE``, False).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [  # name, N, C, O, H, pad
    ("CIFAR-10 quick conv2", 100, 32, 32, 16, 2),
    ("CIFAR-10 quick conv3", 100, 32, 64, 8, 2),
    ("LeNet conv2", 64, 20, 50, 12, 0),
]


def passes(engine, x, w, dy, b):
    y = np.empty(dy.shape, x.dtype)
    engine.forward(np, x, w, y, 1 << 20, bias=b, keep=True)
    dw, db, dx = np.zeros_like(w), np.zeros_like(b), np.empty_like(x)
    engine.backward(np, x, w, dy, 1 << 20, dw=dw, dx=dx, db=db)
    return {"y": y, "dw": dw, "dx": dx, "db": db}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from minicaffe.kernels.conv import ConvEngine
    print("relative error (max |error| / max |value|) against the direct method in float64")
    for name, N, C, O, H, pad in SHAPES:
        OH = H + 2 * pad - 4
        rs = np.random.RandomState(a.seed)
        data = (rs.randn(N, C, H, H), rs.randn(O, C, 5, 5) * 0.1, rs.randn(N, O, OH, OH),
                rs.randn(O))

        def make(wino):
            return ConvEngine(C, O, 1, (5, 5), (pad, pad), (1, 1), (1, 1), (H, H), (OH, OH),
                              winograd=wino)
        ref = passes(make(False), *data)
        f32 = [d.astype(np.float32) for d in data]
        for label, wino in (("Winograd", True), ("direct", False)):
            got = passes(make(wino), *f32)
            errs = "  ".join(f"{k} {np.abs(got[k] - ref[k]).max() / np.abs(ref[k]).max():.1e}"
                             for k in ("y", "dw", "dx", "db"))
            print(f"{name:22s} float32 {label:9s} {errs}")


if __name__ == "__main__":
    main()
