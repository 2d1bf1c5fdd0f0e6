"""Real 16-bit storage against the emulation, on a GPU (issue 20): (1) cuDNN's batch norm on
float16/bfloat16 buffers against its float32 one on the same rounded inputs (Scale and bias
gradients against a float64 reference); (2) tests/test_storage16_gpu.py's ResNet block, real
2-byte storage against the emulation, with MAX pooling (how many windows took another argmax)
and with AVE pooling: the parameter gradients' distances, relative to each largest.

    python3 benchmarks/storage16_vs_emulation.py      # on a GPU machine, from the repo root
"""
import sys, numpy as np
sys.path.insert(0, ".")
import cupy as cp
from minicaffe.gpu import cudnn
from minicaffe.core import context

context.set_mode_gpu()
rs = np.random.RandomState(0)
N, C, H, W = 16, 8, 8, 8
for scale_dy in (1.0, 1e-3, 1e-5):
    x = rs.standard_normal((N, C, H, W)).astype(np.float16).astype(np.float32) * 2 + 0.5
    x = x.astype(np.float16).astype(np.float32)
    dy = (rs.standard_normal((N, C, H, W)) * scale_dy).astype(np.float16).astype(np.float32)
    gamma = (1 + 0.1 * rs.standard_normal(C)).astype(np.float32)
    beta = (0.1 * rs.standard_normal(C)).astype(np.float32)
    out = {}
    for name, dt in (("fp32", np.float32), ("fp16", np.float16), ("bf16", "bfloat16")):
        if dt == "bfloat16":
            def to(a):
                u = a.view(np.uint32); r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
                return cp.asarray(r)
            def back(a):
                return (cp.asnumpy(a).astype(np.uint32) << 16).view(np.float32)
        else:
            to = lambda a, dt=dt: cp.asarray(a.astype(dt))
            back = lambda a: cp.asnumpy(a).astype(np.float32)
        xd = cudnn.TensorDesc((N, C, H, W), dt)
        pd = cudnn.BNParamDesc(xd, cudnn.BN_SPATIAL)
        gx, gdy = to(x), to(dy)
        gy, gdx = cp.empty_like(gx), cp.empty_like(gx)
        g, b = cp.asarray(gamma), cp.asarray(beta)
        rm, rv = cp.zeros(C, np.float32), cp.zeros(C, np.float32)
        sm, si = cp.zeros(C, np.float32), cp.zeros(C, np.float32)
        dg, db = cp.zeros(C, np.float32), cp.zeros(C, np.float32)
        h = cudnn.handle(); one = cudnn.one(np.float32); zero = cudnn.zero(np.float32)
        P = lambda a: a.data.ptr
        cudnn.call("cudnnBatchNormalizationForwardTraining", h, cudnn.BN_SPATIAL, one, zero,
                   xd.ptr, P(gx), xd.ptr, P(gy), pd.ptr, P(g), P(b), 1.0, P(rm), P(rv), 1e-5, P(sm), P(si))
        cudnn.call("cudnnBatchNormalizationBackward", h, cudnn.BN_SPATIAL, one, zero, one, zero,
                   xd.ptr, P(gx), xd.ptr, P(gdy), xd.ptr, P(gdx), pd.ptr, P(g), P(dg), P(db), 1e-5, P(sm), P(si))
        cp.cuda.Device().synchronize()
        out[name] = dict(y=back(gy), dx=back(gdx), dg=cp.asnumpy(dg), db=cp.asnumpy(db),
                         sm=cp.asnumpy(sm), si=cp.asnumpy(si))
    # float64 reference on the same (rounded) inputs
    m = x.mean((0, 2, 3), keepdims=True, dtype=np.float64); v = x.astype(np.float64).var((0, 2, 3), keepdims=True)
    xh = (x - m) / np.sqrt(v + 1e-5)
    dg_ref = (dy * xh).sum((0, 2, 3)); db_ref = dy.astype(np.float64).sum((0, 2, 3))
    for name, o in out.items():
        e = lambda a, r: float(np.abs(a - r).max() / (np.abs(r).max() + 1e-30))
        print(f"dy scale {scale_dy:g} {name}: dgamma rel err {e(o['dg'], dg_ref):.3g}  dbeta {e(o['db'], db_ref):.3g}  "
              f"dx vs fp32 {e(o['dx'], out['fp32']['dx']):.3g}  y vs fp32 {e(o['y'], out['fp32']['y']):.3g}  "
              f"save_mean {e(o['sm'], m.ravel()):.3g}  save_inv {e(o['si'], 1/np.sqrt(v.ravel()+1e-5)):.3g}")


# (2) the ResNet block of tests/test_storage16_gpu.py: real 2-byte storage against the emulation
import importlib.util
spec = importlib.util.spec_from_file_location("t", "tests/test_storage16_gpu.py"); t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)

def windows_argmax(a):
    n, c, h, w = a.shape
    v = a.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, h // 2, w // 2, 4)
    return v.argmax(-1), v

for pool in ("MAX", "AVE"):
    text = t.BLOCK.replace("pool: MAX", f"pool: {pool}")
    for prec in ("fp16", "bf16"):
        emu, real, f32, plan = t._pair(prec, text, fp32=True)
        emu.forward(); real.forward(); f32.forward()
        if pool == "MAX":
            ae, v = windows_argmax(emu.blobs["sum"].data); ar, _ = windows_argmax(real.blobs["sum"].data)
            flips = int((ae != ar).sum())
            print(f"{pool} {prec}: argmax flips between real and emulation: {flips} of {ae.size} windows")
        for n in (emu, real, f32): n.backward()
        for name in emu.params:
            for k, (a, b, f) in enumerate(zip(emu.params[name], real.params[name], f32.params[name])):
                big = np.abs(f.diff).max() + 1e-30
                if big < 1e-20: continue
                print(f"{pool} {prec} {name}[{k}] diff rel: |real-emu| {np.abs(a.diff-b.diff).max()/big:.3g} |emu-f32| {np.abs(a.diff-f.diff).max()/big:.3g} |real-f32| {np.abs(b.diff-f.diff).max()/big:.3g}")
        plan.release()
