"""MAX pooling of channels-last 2-byte maps: our kernels (kernels/pool16.py) against
cuDNN's channels-last pooling (the layer's descriptors), forward and backward, on VGG-16's
five 2x2/2 pools at batch 64, each call timed alone as ten calls replayed from one CUDA
graph (the device's time; median of 5 replays).  Also checks, once per shape, that both
give the same bits on random maps, and says where cuDNN sends the gradient of a window
holding NaNs.

    python benchmarks/pool16.py [--precision bf16|fp16] [--batch 64]
"""
import argparse
import sys

import numpy as np

sys.path.insert(0, ".")

from minicaffe.core import backend, context  # noqa: E402
from minicaffe.core import precision as P  # noqa: E402
from minicaffe.gpu import cudnn  # noqa: E402
from minicaffe.kernels import pool16  # noqa: E402
from bn_layout import _graph_ms as timed  # noqa: E402  (this folder: ms per call, graph)

VGG = [(64, 224), (128, 112), (256, 56), (512, 28), (512, 14)]   # C, H = W of each input


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
    h = cudnn.handle()
    one, zero = cudnn.one(np.float32), cudnn.zero(np.float32)
    pd = cudnn.PoolDesc(cudnn.POOL_MAX, (2, 2), (0, 0), (2, 2))
    print(f"MAX 2x2/2, channels-last {args.precision}, batch {args.batch}, "
          "ms per call (CUDA graph)")
    print(f"{'input N,C,H,W':>22} {'cuDNN fwd':>10} {'ours fwd':>9} {'cuDNN bwd':>10} "
          f"{'ours bwd':>9}  same bits")
    tot = np.zeros(4)
    for C, H in VGG:
        shape = (args.batch, C, H, H)
        PH = H // 2
        rs = cp.random.RandomState(C + H)
        f = (rs.randint(-8, 8, size=(args.batch, H, H, C)).astype(cp.float32) * 0.25)
        x = P.narrow(cp, f, cp.empty(f.shape, bt), kind)
        g = rs.standard_normal((args.batch, PH, PH, C), dtype=cp.float32)
        dy = P.narrow(cp, g, cp.empty(g.shape, bt), kind)
        y = cp.empty((args.batch, PH, PH, C), bt)
        yc = cp.empty_like(y)
        dx = cp.empty_like(x)
        dxc = cp.empty_like(x)
        xd = cudnn.TensorDesc(shape, dt, nhwc=True)
        yd = cudnn.TensorDesc((args.batch, C, PH, PH), dt, nhwc=True)

        def cf():       # the handle on the current (capturing) stream
            cudnn.call("cudnnPoolingForward", cudnn.handle(), pd.ptr, one, xd.ptr, x.data.ptr, zero,
                       yd.ptr, yc.data.ptr)

        def cb():
            cudnn.call("cudnnPoolingBackward", cudnn.handle(), pd.ptr, one, yd.ptr, yc.data.ptr, yd.ptr,
                       dy.data.ptr, xd.ptr, x.data.ptr, zero, xd.ptr, dxc.data.ptr)

        def of():
            pool16.max_pool_forward(x, y, shape, 2, 2, 0, kind)

        def ob():
            pool16.max_pool_backward(x, dy, dx, shape, 2, 2, 0, kind)

        t = np.array([timed(cf), timed(of), timed(cb), timed(ob)])
        tot += t
        same = bool((y.view(cp.uint16) == yc.view(cp.uint16)).all()) and \
            bool((dx.view(cp.uint16) == dxc.view(cp.uint16)).all())
        print(f"{str(shape):>22} {t[0]:10.3f} {t[1]:9.3f} {t[2]:10.3f} {t[3]:9.3f}  {same}")
    print(f"{'sum':>22} {tot[0]:10.3f} {tot[1]:9.3f} {tot[2]:10.3f} {tot[3]:9.3f}")
    # where cuDNN sends the gradient of a window with NaNs (ours: its first NaN)
    v = np.array([1.0, np.nan, 5.0, np.nan], np.float32).reshape(1, 2, 2, 1)
    x = P.narrow(cp, cp.asarray(np.repeat(v, 8, axis=3)), cp.empty((1, 2, 2, 8), bt), kind)
    dy = P.narrow(cp, cp.full((1, 1, 1, 8), 2.0, cp.float32), cp.empty((1, 1, 1, 8), bt), kind)
    xd = cudnn.TensorDesc((1, 8, 2, 2), dt, nhwc=True)
    yd = cudnn.TensorDesc((1, 8, 1, 1), dt, nhwc=True)
    yc, dxc, dx = cp.empty_like(dy), cp.empty_like(x), cp.empty_like(x)
    h = cudnn.handle()      # again: the captures above left the handle on their stream
    cudnn.call("cudnnPoolingForward", h, pd.ptr, one, xd.ptr, x.data.ptr, zero, yd.ptr,
               yc.data.ptr)
    cudnn.call("cudnnPoolingBackward", h, pd.ptr, one, yd.ptr, yc.data.ptr, yd.ptr,
               dy.data.ptr, xd.ptr, x.data.ptr, zero, xd.ptr, dxc.data.ptr)
    pool16.max_pool_backward(x, dy, dx, (1, 8, 2, 2), 2, 2, 0, kind)
    w = P.widen(cp, dxc, cp.empty(dxc.shape, cp.float32), kind)[0, :, :, 0]
    o = P.widen(cp, dx, cp.empty(dx.shape, cp.float32), kind)[0, :, :, 0]
    print(f"window [[1, nan], [5, nan]], dy 2: cuDNN's y "
          f"{float(P.widen(cp, yc, cp.empty(yc.shape, cp.float32), kind)[0, 0, 0, 0])}, "
          f"dx {cp.asnumpy(w).tolist()}; ours {cp.asnumpy(o).tolist()}")


if __name__ == "__main__":
    main()
