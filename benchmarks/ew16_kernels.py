"""The 2-byte element-wise kernels and casts (issue 20): the generic ElementwiseKernels
(one element per thread, main's bodies before kernels/vec16.py) against the vectorised
ones, on shapes of ResNet-50 and VGG-16 at batch 64.

    python3 benchmarks/ew16_kernels.py [--type bf16|fp16]

Prints, per kernel and shape, the device time per call (CUDA graph of 10 calls, median of
5: bn_layout.py's _graph_ms) of each body and its effective bandwidth (bytes read and
written once / time)."""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--type", default="bf16", choices=("bf16", "fp16"))
    a = ap.parse_args(argv)
    from bn_layout import _graph_ms
    from minicaffe.core import backend, context
    from minicaffe.core import precision as P
    from minicaffe.kernels import precision as kp, reduced, vec16
    context.set_mode_gpu()
    cp = backend.gpu_module()
    s = P.BFLOAT16 if a.type == "bf16" else P.FLOAT16
    dt = kp.buffer_dtype(s)
    gen = reduced.generic_kernel    # the generic bodies
    rs = np.random.RandomState(1701)

    def h16(shape):
        return cp.asarray(rs.standard_normal(shape).astype(np.float32)).astype(np.float16) \
            .view(np.uint16).view(dt)

    def row(name, nbytes, old, new):
        t0, t1 = _graph_ms(old), _graph_ms(new)
        print(f"{name:44s} generic {t0 * 1e3:8.1f} us {nbytes / t0 / 1e6:7.0f} GB/s | "
              f"vector {t1 * 1e3:8.1f} us {nbytes / t1 / 1e6:7.0f} GB/s | x{t0 / t1:5.2f}",
              flush=True)

    for shape in ((64, 256, 56, 56), (64, 512, 28, 28), (64, 2048, 7, 7), (64, 64, 224, 224)):
        n = int(np.prod(shape))
        x, y, d, o = h16(shape), h16(shape), h16(shape), h16(shape)
        tag = "x".join(map(str, shape))
        row(f"relu_f {tag}", 4 * n, lambda: gen(s, "relu_f")(x, o),
            lambda: vec16.relu_forward(x, o, s))
        row(f"relu_b {tag}", 6 * n, lambda: gen(s, "relu_b")(x, d, o),
            lambda: vec16.relu_backward(x, d, o, s))
        row(f"add+relu {tag}", 6 * n, lambda: gen(s, "add")(x, y, np.int32(1), o),
            lambda: vec16.add(x, y, o, s, relu=True))
        c = shape[1]
        b = cp.asarray(rs.standard_normal(c).astype(np.float32))
        nchw_hw = n // shape[0] // c
        row(f"bias_act+relu NCHW {tag}", 4 * n,
            lambda: gen(s, "bias_act")(b, c, nchw_hw, np.int32(3), o),
            lambda: vec16.bias_act(o, s, b, c, nchw_hw, 3))
        row(f"bias_act+relu NHWC {tag}", 4 * n,
            lambda: gen(s, "bias_act")(b, c, 1, np.int32(3), o),
            lambda: vec16.bias_act(o, s, b, c, 1, 3))

    # the casts: fc6's weights (VGG-16), a 3 x 3 conv's, transposed and back (accumulated)
    w = cp.asarray(rs.standard_normal(4096 * 25088).astype(np.float32))
    hw = cp.empty(w.size, dtype=dt)
    row("to_reduced fc6 4096x25088", 6 * w.size, lambda: kp.generic_kernel(s, "to")(w, hw),
        lambda: vec16.to_reduced(w, hw, s))
    row("from_reduced acc fc6 4096x25088", 10 * w.size,
        lambda: kp.generic_kernel(s, "from")(hw, w, 1, 1, np.int32(4), w),
        lambda: vec16.from_reduced(hw, w, s, None, 1, 1, 4))
    for k, c, r in ((512, 512, 3), (256, 256, 3), (64, 3, 7), (128, 64, 3)):
        w = cp.asarray(rs.standard_normal((k, c, r, r)).astype(np.float32))
        h = cp.empty((k, r, r, c), dtype=dt)
        tag = f"{k}x{c}x{r}x{r}"
        row(f"to_reduced KCRS->KRSC {tag}", 6 * w.size,
            lambda: kp.generic_kernel(s, "to")(w.transpose(0, 2, 3, 1), h),
            lambda: kp.to_reduced_t(w.reshape(k, c, r * r), h.reshape(k, r * r, c), s))
        row(f"from_reduced acc KRSC->KCRS {tag}", 10 * w.size,
            lambda: kp.generic_kernel(s, "from")(h.transpose(0, 3, 1, 2), w, 1, 1, np.int32(4), w),
            lambda: kp.from_reduced_t(h.reshape(k, r * r, c), w.reshape(k, c, r * r), s,
                                      accumulate=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
