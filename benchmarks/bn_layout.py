"""cuDNN's training batch norm (forward + backward) on bfloat16 maps, NCHW against NHWC
(channels-last), in SPATIAL and SPATIAL_PERSISTENT modes, and minicaffe's channels-last
kernels (kernels/reduced.bn_nhwc_*) (issue 20's channels-last step).

    python3 benchmarks/bn_layout.py [--batch 64]

Prints ms per shape (CUDA events, median of 10) and the sums over ResNet-50's BN shapes
(each with its count in the net)."""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (C, H = W, count in ResNet-50)
SHAPES = [(64, 112, 1), (64, 56, 6), (256, 56, 4), (128, 56, 1), (128, 28, 7), (512, 28, 5),
          (256, 28, 1), (256, 14, 11), (1024, 14, 7), (512, 14, 1), (512, 7, 5), (2048, 7, 4)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args(argv)
    from minicaffe.core import backend, context
    from minicaffe.gpu import cudnn
    from minicaffe.layers.cudnn_layers import _timed
    context.set_mode_gpu()
    cp = backend.gpu_module()
    one, zero = cudnn.one(np.float32), cudnn.zero(np.float32)
    tot = {}
    for c, hw, cnt in SHAPES:
        shape = (a.batch, c, hw, hw)
        x = cp.zeros(int(np.prod(shape)), dtype=np.uint16)
        y, dy, dx = cp.zeros_like(x), cp.zeros_like(x), cp.zeros_like(x)
        p = [cp.ones(c, dtype=np.float32) for _ in range(8)]
        row = []
        for nhwc in (False, True):
            xd = cudnn.TensorDesc(shape, "bfloat16", nhwc=nhwc)
            for mode, mname in ((cudnn.BN_SPATIAL, "spatial"),
                                (cudnn.BN_SPATIAL_PERSISTENT, "persistent")):
                pd = cudnn.BNParamDesc(xd, mode)
                h = cudnn.handle()

                def step():
                    cudnn.call("cudnnBatchNormalizationForwardTraining", h, mode, one, zero,
                               xd.ptr, x.data.ptr, xd.ptr, y.data.ptr, pd.ptr, p[0].data.ptr,
                               p[1].data.ptr, 1.0, p[2].data.ptr, p[3].data.ptr, 1e-5,
                               p[4].data.ptr, p[5].data.ptr)
                    cudnn.call("cudnnBatchNormalizationBackward", h, mode, one, zero, one,
                               zero, xd.ptr, x.data.ptr, xd.ptr, dy.data.ptr, xd.ptr,
                               dx.data.ptr, pd.ptr, p[0].data.ptr, p[6].data.ptr,
                               p[7].data.ptr, 1e-5, p[4].data.ptr, p[5].data.ptr)
                t = _timed(step, 10)
                k = ("NHWC " if nhwc else "NCHW ") + mname
                tot[k] = tot.get(k, 0.0) + cnt * t
                row.append(f"{k} {t:.3f}")
        from minicaffe.kernels import reduced as r16
        m = a.batch * hw * hw
        n = r16.bn_partial_size(m, c)
        p1, p2 = cp.zeros(n, np.float64), cp.zeros(n, np.float64)
        sums = cp.zeros(2 * c, np.float32)

        def ours():
            r16.bn_nhwc_forward(x, y, c, "BFLOAT16", p[0], p[1], 1e-5, p[4], p[5], p[2],
                                p[3], p1, p2)
            r16.bn_nhwc_backward(x, dy, dx, c, "BFLOAT16", p[0], p[4], p[5], p[6], p[7],
                                 True, sums, p1, p2)
        t = _timed(ours, 10)
        tot["NHWC minicaffe kernels"] = tot.get("NHWC minicaffe kernels", 0.0) + cnt * t
        row.append(f"NHWC minicaffe kernels {t:.3f}")
        print(f"{c:5d} x {hw:3d}x{hw:<3d} x{cnt:2d}: " + ", ".join(row))
    print("ResNet-50's batch norms, fwd + bwd ms per step: " +
          ", ".join(f"{k} {v:.2f}" for k, v in tot.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
