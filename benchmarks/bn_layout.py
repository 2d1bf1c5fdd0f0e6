"""cuDNN's training batch norm (forward + backward) on bfloat16 maps, NCHW against NHWC
(channels-last), in SPATIAL and SPATIAL_PERSISTENT modes, and minicaffe's channels-last
kernels (kernels/reduced.bn_nhwc_*), also with the fused ReLU (issue 20's channels-last step).

    python3 benchmarks/bn_layout.py [--batch 64]

Prints ms per shape (CUDA events, median of 10) and the sums over ResNet-50's BN shapes
(each with its count in the net): each call eagerly (the host's launches included), and
ten calls captured as one CUDA graph (``graph``: the device's time, as the training step
replays it), per call."""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (C, H = W, count in ResNet-50)
SHAPES = [(64, 112, 1), (64, 56, 6), (256, 56, 4), (128, 56, 1), (128, 28, 7), (512, 28, 5),
          (256, 28, 1), (256, 14, 11), (1024, 14, 7), (512, 14, 1), (512, 7, 5), (2048, 7, 4)]


def _graph_ms(fn, reps=10):
    """ms per call of ``fn`` replayed from a CUDA graph of ``reps`` calls (median of 5)."""
    from minicaffe.core import backend
    from minicaffe.gpu import graph
    stream = backend.new_stream()
    pool = graph.private_pool()
    with stream:
        with graph.allocating_from(pool):
            fn()
        g = graph.capture(stream, pool, lambda: [fn() for _ in range(reps)])
        ts = []
        for _ in range(6):
            a, b = backend.new_event(), backend.new_event()
            a.record(stream)
            g.launch(stream)
            b.record(stream)
            b.synchronize()
            ts.append(backend.elapsed_ms(a, b) / reps)
    return float(np.median(ts[1:]))


def _time(k, fn, cnt, tot, row):
    from minicaffe.layers.cudnn_layers import _timed
    t = _timed(fn, 10)
    tot[k] = tot.get(k, 0.0) + cnt * t
    try:
        tg = _graph_ms(fn)
    except Exception as e:      # a call that cannot be captured: its eager time only
        row.append(f"{k} {t:.3f} (graph: {type(e).__name__})")
        return
    tot[k + " graph"] = tot.get(k + " graph", 0.0) + cnt * tg
    row.append(f"{k} {t:.3f} (graph {tg:.3f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args(argv)
    from minicaffe.core import backend, context
    from minicaffe.gpu import cudnn
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

                def step():
                    h = cudnn.handle()
                    cudnn.call("cudnnBatchNormalizationForwardTraining", h, mode, one, zero,
                               xd.ptr, x.data.ptr, xd.ptr, y.data.ptr, pd.ptr, p[0].data.ptr,
                               p[1].data.ptr, 1.0, p[2].data.ptr, p[3].data.ptr, 1e-5,
                               p[4].data.ptr, p[5].data.ptr)
                    cudnn.call("cudnnBatchNormalizationBackward", h, mode, one, zero, one,
                               zero, xd.ptr, x.data.ptr, xd.ptr, dy.data.ptr, xd.ptr,
                               dx.data.ptr, pd.ptr, p[0].data.ptr, p[6].data.ptr,
                               p[7].data.ptr, 1e-5, p[4].data.ptr, p[5].data.ptr)
                k = ("NHWC " if nhwc else "NCHW ") + mname
                _time(k, step, cnt, tot, row)
        from minicaffe.kernels import reduced as r16
        m = a.batch * hw * hw
        work = cp.zeros(r16.bn_work_size(m, c), np.float64)
        sums = cp.zeros(2 * c, np.float32)
        for relu in (False, True):
            def ours():
                r16.bn_nhwc_forward(x, y, c, "BFLOAT16", p[0], p[1], 1e-5, p[4], p[5], p[2],
                                    p[3], work, relu=relu)
                r16.bn_nhwc_backward(x, dy, dx, c, "BFLOAT16", p[0], p[4], p[5], p[6], p[7],
                                     True, sums, work, beta=p[1], relu=relu)
            _time("NHWC minicaffe kernels" + (" + ReLU" if relu else ""), ours, cnt, tot, row)
        print(f"{c:5d} x {hw:3d}x{hw:<3d} x{cnt:2d}: " + ", ".join(row))
    print("ResNet-50's batch norms, fwd + bwd ms per step: " +
          ", ".join(f"{k} {v:.2f}" for k, v in tot.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
