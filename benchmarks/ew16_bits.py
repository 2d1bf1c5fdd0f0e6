"""Where the vectorised 2-byte kernels (kernels/vec16.py) and the generic ElementwiseKernels
give other bits, if anywhere: a probe of the subnormal, zero, NaN and infinite words that
CuPy's -ftz=true makes delicate.

    python3 benchmarks/ew16_bits.py

For bf16 and fp16, each body (ReLU forward/backward, add (+ReLU), bias_act (+ReLU),
from_reduced (+ReLU, accumulate)) runs on 2-byte words in which one word in eight is a
subnormal or a zero of either sign, through: the generic kernel on contiguous arrays (the
reference), the generic kernel on a strided 1-D and a strided 2-D view, vec16 at 8 wide,
vec16 at 1 wide (a view at an odd offset), and vec16 compiled with its compares pinned
(MC_CMP 1: flush-to-zero, 2: IEEE).  Prints the count of words unlike the reference and
the first few (index: input words -> outputs)."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from minicaffe.core import backend, context
    from minicaffe.core import precision as P
    from minicaffe.kernels import precision as kp, reduced, vec16
    from minicaffe.kernels._backend import raw_kernel
    context.set_mode_gpu()
    cp = backend.gpu_module()
    rs = np.random.RandomState(1701)
    n, C = 4099 * 8 + 5, 19
    base_fn = vec16._fn

    def pinned(k):
        def fn(s, v, name):
            src = (f"#define MC_BF16 {1 if s == P.BFLOAT16 else 0}\n#define MC_V {v}\n"
                   f"#define MC_CMP {k}\n" + vec16._SRC)
            return raw_kernel(src, name, "float")
        return fn

    for s in (P.BFLOAT16, P.FLOAT16):
        dt = kp.buffer_dtype(s)
        words = []
        for _ in range(3):
            w = rs.randint(0, 1 << 16, size=n).astype(np.uint16)
            sub = rs.rand(n) < 0.125
            tiny = 0x7f if s == P.BFLOAT16 else 0x3ff
            w[sub] = (rs.randint(0, tiny + 1, size=int(sub.sum())) |
                      (rs.randint(0, 2, size=int(sub.sum())) << 15)).astype(np.uint16)
            w[:8] = [0x0000, 0x8000, 0x0001, 0x8001, tiny, 0x8000 | tiny, tiny + 1, 0x3c00]
            words.append(w.view(dt))
        bias = rs.standard_normal(C).astype(np.float32)
        bias[:4] = [0.0, -0.0, 1e-40, -1e-40]
        y0 = rs.standard_normal(n).astype(np.float32)
        y0[::7] = np.float32(1e-40)

        def dev(h, off=0):
            buf = cp.zeros(h.size + off, dtype=h.dtype)
            a = buf[off:]
            a[...] = cp.asarray(h)
            return a

        def strided(h, two_d=False):
            buf = cp.zeros((h.size, 2), dtype=h.dtype)
            v = buf[:, 0]
            v[...] = cp.asarray(h)
            return v.reshape(-1, 1) if two_d else v

        b = cp.asarray(bias)
        ops = {
            "relu_f": (2, lambda a, o: reduced.relu_forward(a[0], o, s),
                       lambda a, o: reduced.generic_kernel(s, "relu_f")(a[0], o)),
            "relu_b": (2, lambda a, o: reduced.relu_backward(a[0], a[1], o, s),
                       lambda a, o: reduced.generic_kernel(s, "relu_b")(a[0], a[1], o)),
            "add": (2, lambda a, o: reduced.add(a[0], a[1], o, s),
                    lambda a, o: reduced.generic_kernel(s, "add")(a[0], a[1], np.int32(0), o)),
            "add+relu": (2, lambda a, o: reduced.add(a[0], a[1], o, s, relu=True),
                         lambda a, o: reduced.generic_kernel(s, "add")(a[0], a[1], np.int32(1),
                                                                       o)),
        }
        for mode in (2, 3):
            ops[f"bias_act mode {mode}"] = (
                0, (lambda m: lambda a, o: vec16.bias_act(o, s, b, C, 1, m))(mode),
                (lambda m: lambda a, o: reduced.generic_kernel(s, "bias_act")(b, C, 1,
                                                                                np.int32(m), o))(mode))
        for mode in (2, 3, 4, 6, 10):
            ops[f"from mode {mode}"] = (
                1, (lambda m: lambda a, o: vec16.from_reduced(a[0], o, s, b, C, 1, m))(mode),
                (lambda m: lambda a, o: kp.generic_kernel(s, "from")(a[0], b, C, 1, np.int32(m),
                                                                    o))(mode))
        for name, (kind, vec, gen) in ops.items():
            ins = words[:2]
            if kind == 0:                   # in place on words[2]
                out0 = words[2]
            elif kind == 1:                 # 2-byte in, fp32 out (accumulated into y0)
                out0 = y0
            else:
                out0 = np.zeros(n, dt)
            res = {}

            def run(label, fn, off=0, how=None):
                if how is None:
                    a = [dev(x, off) for x in ins]
                    o = dev(out0, off)
                else:
                    a = [strided(x, how == 2) for x in ins]
                    o = strided(out0, how == 2)
                fn(a, o)
                res[label] = cp.asnumpy(o).ravel()
            run("generic", gen)
            run("generic strided", gen, how=1)
            run("generic 2-D", gen, how=2)
            run("vec16", vec)
            run("vec16 1-wide", vec, off=1)
            for k in (1, 2):
                vec16._fn = pinned(k)
                try:
                    run(f"vec16 MC_CMP {k}", vec)
                finally:
                    vec16._fn = base_fn
            ref = res["generic"].view(f"u{res['generic'].dtype.itemsize}")
            shown = [x.view(f"u{x.dtype.itemsize}") for x in ins + [out0]]
            row = []
            for label, r in res.items():
                if label == "generic":
                    continue
                bad = np.nonzero(r.view(ref.dtype) != ref)[0]
                row.append(f"{label}: {bad.size}")
                for i in bad[:3]:
                    iw = " ".join(f"{int(x[i]):#06x}" for x in shown)
                    row.append(f"    [{i}] in {iw} -> ref {int(ref[i]):#x}, "
                               f"{label} {int(r.view(ref.dtype)[i]):#x}")
            print(f"{s} {name}: " + "\n  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
