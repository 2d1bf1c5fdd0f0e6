"""Per-kernel GPU times of one training step: minicaffe's replayed CUDA graph and the
same net in PyTorch (eager and as a CUDA graph), both recorded by CUPTI through
torch.profiler (it sees every kernel of the process, CuPy's and cuDNN's too).

    python benchmarks/profile_kernels.py models/lenet/train_val.prototxt 64

Needs PyTorch with CUDA.  Prints the kernels sorted by total time.
"""
import argparse
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")

import torch  # noqa: E402

from gpu_step import make, synthetic  # noqa: E402
from minicaffe.core import backend, context  # noqa: E402


def table(prof, title, n, steps):
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = e.name[:90]
            t, c = rows.get(k, (0.0, 0))
            rows[k] = (t + e.device_time / 1e3, c + 1)
    total = sum(t for t, _ in rows.values())
    print(f"== {title}: {total / steps:.3f} ms of kernels per step, "
          f"{sum(c for _, c in rows.values()) / steps:.1f} kernels per step")
    for k, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:n]:
        print(f"  {t / steps * 1e3:8.1f} us  x{c / steps:4.1f}  {k}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batch", type=int)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    shape = [1, 28, 28] if "lenet" in a.model else [3, 32, 32] if "cifar" in a.model \
        else [3, 227, 227] if "alexnet" in a.model else [3, 224, 224]
    context.set_mode_gpu()
    s = make(synthetic(a.model, a.batch, shape), True)
    s.step(5)
    st = s.gpu_step
    g = next(iter(st.graphs.values()))
    backend.synchronize()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            g.launch(st.stream)
        st.stream.synchronize()
    table(prof, "minicaffe graph replay", a.top, a.steps)


if __name__ == "__main__":
    main()
