"""1x1 stride-1 convolutions (ResNet-50's 30) in bfloat16 as cuBLAS GEMMs, NCHW against
NHWC, against cuDNN's Find-best legacy algorithms in both layouts (issue 20).

    python3 benchmarks/conv1x1_gemm.py [--batch 64] [--reps 20]

NHWC: Y[NHW, K] = X[NHW, C] W^T, dX = dY W, dW = dY^T X (three GEMMs).  NCHW: the forward
and the data gradient are strided-batched GEMMs over the images (W shared), the filter
gradient has no single GEMM in NCHW (its sum runs over images and pixels, which NCHW does
not keep adjacent), so that column takes cuDNN's.  ms per shape, CUDA events, median.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (C in, K out, H = W) of ResNet-50's stride-1 1x1 convolutions, with their counts
SHAPES = [(64, 64, 56, 1), (64, 256, 56, 4), (256, 64, 56, 2), (128, 512, 28, 4),
          (512, 128, 28, 3), (256, 1024, 14, 7), (1024, 256, 14, 5), (512, 2048, 7, 4),
          (2048, 512, 7, 2)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    from minicaffe.core import backend, context
    from minicaffe.gpu import cublas, cudnn
    import conv_layout
    from minicaffe.layers.cudnn_layers import _timed

    def timed(backend, fn, reps):
        return _timed(fn, reps)
    context.set_mode_gpu()
    cp = backend.gpu_module()
    n = a.batch
    tot = {"nhwc_gemm": 0.0, "nchw_gemm_fd": 0.0, "cudnn_nchw": 0.0,
                             "cudnn_nhwc": 0.0}
    print(f"batch {n}, bfloat16, ms fwd + bwd_data + bwd_filter (x count in ResNet-50)")
    for c, k, hw, cnt in SHAPES:
        m = n * hw * hw
        x = cp.zeros((m, c), dtype=np.uint16)
        dy = cp.zeros((m, k), dtype=np.uint16)
        y = cp.zeros((m, k), dtype=np.uint16)
        dx = cp.zeros((m, c), dtype=np.uint16)
        w = cp.zeros((k, c), dtype=np.uint16)
        dw = cp.zeros((k, c), dtype=np.float32)
        f = timed(backend, lambda: cublas.matmul_ex(x, w, y, trans_b=True), a.reps)
        d = timed(backend, lambda: cublas.matmul_ex(dy, w, dx), a.reps)
        g = timed(backend, lambda: cublas.matmul_ex(dy, x, dw, trans_a=True, beta=1.0), a.reps)
        x3, y3 = x.reshape(n, c, hw * hw), y.reshape(n, k, hw * hw)
        dx3, dy3 = dx.reshape(n, c, hw * hw), dy.reshape(n, k, hw * hw)
        fb = timed(backend, lambda: cublas.matmul_ex_batched(w, x3, y3), a.reps)
        db = timed(backend, lambda: cublas.matmul_ex_batched(w, dy3, dx3, trans_a=True), a.reps)
        cn = conv_layout.time_layout(cudnn, cp, n, c, k, hw, 1, 0, 1, "bfloat16", False)
        ch = conv_layout.time_layout(cudnn, cp, n, c, k, hw, 1, 0, 1, "bfloat16", True)
        print(f"{c:5d}->{k:5d} {hw:3d}x{hw:<3d} x{cnt}: NHWC GEMMs {f:.3f} + {d:.3f} + {g:.3f} "
              f"= {f + d + g:.3f}; NCHW batched {fb:.3f} + {db:.3f} (+ cuDNN wgrad "
              f"{cn[2]:.3f}) = {fb + db + cn[2]:.3f}; cuDNN NCHW {sum(cn):.3f} "
              f"({' + '.join(f'{v:.3f}' for v in cn)}); cuDNN NHWC {sum(ch):.3f} "
              f"({' + '.join(f'{v:.3f}' for v in ch)})")
        tot["nhwc_gemm"] += cnt * (f + d + g)
        tot["nchw_gemm_fd"] += cnt * (fb + db + cn[2])
        tot["cudnn_nchw"] += cnt * sum(cn)
        tot["cudnn_nhwc"] += cnt * sum(ch)
    print("ResNet-50's 30 stride-1 1x1 convolutions, ms per step: " +
          ", ".join(f"{k} {v:.2f}" for k, v in tot.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
