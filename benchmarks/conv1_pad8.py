"""A first convolution's 3 input channels, channels-last bf16/fp16, as they are and padded
with zeros to 8 (x N, H, W, 8 and the filter K, R, S, 8): cuDNN's Find times (ms) of the
fastest forward and filter-gradient algorithm of each, within 1 GiB of workspace, on
ResNet-50's conv1 (7x7/2), VGG-16's conv1_1 (3x3) and AlexNet's conv1 (11x11/4).

    python benchmarks/conv1_pad8.py [--precision bf16|fp16] [--batch 64]
"""
import argparse
import sys

import numpy as np

sys.path.insert(0, ".")

from minicaffe.core import backend, context  # noqa: E402
from minicaffe.core import precision as P  # noqa: E402
from minicaffe.gpu import cudnn  # noqa: E402

LAYERS = [("resnet50 conv1", 224, 64, 7, 2, 3), ("vgg16 conv1_1", 224, 64, 3, 1, 1),
          ("alexnet conv1", 227, 96, 11, 4, 0)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    context.set_mode_gpu()
    cp = backend.gpu_module()
    kind = P.BFLOAT16 if args.precision == "bf16" else P.FLOAT16
    dt = cudnn.storage_dtype(kind)
    bt = P.buffer_dtype(kind)
    lim = 1 << 30
    ws = cp.empty(lim, dtype=np.uint8)
    print(f"channels-last {args.precision}, batch {args.batch}: Find's fastest (ms, algo)")
    for name, H, K, R, S, pad in LAYERS:
        for C in (3, 8):
            n = args.batch
            xs, ws_ = (n, C, H, H), (K, C, R, R)
            conv = cudnn.ConvDesc((pad, pad), (S, S), (1, 1), 1, dt)
            xd = cudnn.TensorDesc(xs, dt, nhwc=True)
            wd = cudnn.FilterDesc(ws_, dt, nhwc=True)
            ys = conv.output_dims(xd, wd)
            yd = cudnn.TensorDesc(ys, dt, nhwc=True)
            rs = cp.random.RandomState(1)
            x, w, y = (P.narrow(cp, rs.standard_normal(s, dtype=cp.float32),
                                cp.empty(s, bt), kind) for s in (xs, ws_, ys))
            dw = cp.empty_like(w)
            key = ("pad8", xs, ws_, ys, args.precision)
            f = cudnn.find_algorithms("fwd", key, (xd.ptr, x.data.ptr, wd.ptr, w.data.ptr,
                                                   conv.ptr, yd.ptr, y.data.ptr), ws, lim, True)
            b = cudnn.find_algorithms("bwd_filter", key, (xd.ptr, x.data.ptr, yd.ptr,
                                                          y.data.ptr, conv.ptr, wd.ptr,
                                                          dw.data.ptr), ws, lim, True)
            print(f"{name:>15} C={C}: fwd {f[0][2]:.3f} (algo {f[0][0]}, {f[0][1] >> 20} MiB)"
                  f"  wgrad {b[0][2]:.3f} (algo {b[0][0]}, {b[0][1] >> 20} MiB)")


if __name__ == "__main__":
    main()
