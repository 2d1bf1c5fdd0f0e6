"""cuDNN convolutions in bfloat16 (or float16), NCHW against NHWC (channels-last): the
fastest forward, backward-data and backward-filter algorithm cuDNN's Find times for each
layout on the same shapes (ms, Find's own timings), the question of issue 20's NHWC step.

    python3 benchmarks/conv_layout.py [--dtype bfloat16|float16] [--batch 64]

Needs a GPU with cuDNN (gpu/cudnn.py).  Prints one line per shape and the sums.
"""
import argparse

import numpy as np

# (C in, K out, H = W, kernel, pad, stride): VGG-16 and ResNet-50 layers
SHAPES = [(64, 64, 224, 3, 1, 1), (128, 128, 112, 3, 1, 1), (256, 256, 56, 3, 1, 1),
          (64, 256, 56, 1, 0, 1), (256, 64, 56, 1, 0, 1), (512, 512, 14, 3, 1, 1)]
NHWC = 1


def _desc(cudnn, shape, strides, dt):
    d = cudnn.TensorDesc.__new__(cudnn.TensorDesc)
    cudnn._Desc.__init__(d)
    d.shape = shape
    cudnn.call("cudnnSetTensorNdDescriptor", d.ptr, cudnn.data_type(dt), 4,
               cudnn._ints(shape), cudnn._ints(strides))
    return d


def _filter(cudnn, shape, fmt, dt):
    d = cudnn.FilterDesc.__new__(cudnn.FilterDesc)
    cudnn._Desc.__init__(d)
    d.shape = shape
    cudnn.call("cudnnSetFilterNdDescriptor", d.ptr, cudnn.data_type(dt), fmt, 4,
               cudnn._ints(shape))
    return d


def _strides(shape, nhwc):
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c) if nhwc else (c * h * w, h * w, w, 1)


def time_layout(cudnn, cp, n, c, k, hw, r, pad, stride, dt, nhwc):
    out = (hw + 2 * pad - r) // stride + 1
    xs, ys, ws = (n, c, hw, hw), (n, k, out, out), (k, c, r, r)
    x_d = _desc(cudnn, xs, _strides(xs, nhwc), dt)
    y_d = _desc(cudnn, ys, _strides(ys, nhwc), dt)
    w_d = _filter(cudnn, ws, NHWC if nhwc else cudnn.NCHW, dt)
    conv = cudnn.ConvDesc((pad, pad), (stride, stride), (1, 1), 1, dt)
    bt = np.uint16 if dt == "bfloat16" else np.float16
    x, y, w, dw = (cp.zeros(int(np.prod(s)), dtype=bt) for s in (xs, ys, ws, ws))
    lim = 1 << 30
    wsp = cp.empty(lim, dtype=np.uint8)
    key = ("layout", xs, ws, nhwc, dt)
    p = lambda a: a.data.ptr     # noqa: E731
    f = cudnn.find_algorithms("fwd", key, (x_d.ptr, p(x), w_d.ptr, p(w), conv.ptr, y_d.ptr,
                                           p(y)), wsp, lim, True)
    bd = cudnn.find_algorithms("bwd_data", key, (w_d.ptr, p(w), y_d.ptr, p(y), conv.ptr,
                                                 x_d.ptr, p(x)), wsp, lim, True)
    bf = cudnn.find_algorithms("bwd_filter", key, (x_d.ptr, p(x), y_d.ptr, p(y), conv.ptr,
                                                   w_d.ptr, p(dw)), wsp, lim, True)
    return f[0][2], bd[0][2], bf[0][2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args(argv)
    from minicaffe.core import backend, context
    from minicaffe.gpu import cudnn
    context.set_mode_gpu()
    cp = backend.gpu_module()
    dt = a.dtype if a.dtype == "bfloat16" else np.dtype(np.float16)
    print(f"cuDNN {cudnn.version()}, {a.dtype}, batch {a.batch}: fwd + bwd_data + bwd_filter, "
          "ms (Find's timings of the fastest algorithm each)")
    tot = [0.0, 0.0]
    for (c, k, hw, r, pad, stride) in SHAPES:
        row = []
        for j, nhwc in enumerate((False, True)):
            t = time_layout(cudnn, cp, a.batch, c, k, hw, r, pad, stride, dt, nhwc)
            tot[j] += sum(t)
            row.append(" + ".join(f"{v:.3f}" for v in t) + f" = {sum(t):.3f}")
        print(f"{c:4d}->{k:4d} {hw:3d}x{hw:<3d} {r}x{r}: NCHW {row[0]}   NHWC {row[1]}")
    print(f"sum: NCHW {tot[0]:.2f} ms, NHWC {tot[1]:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
