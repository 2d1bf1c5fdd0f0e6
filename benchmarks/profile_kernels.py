"""Per-kernel GPU times of one training step: minicaffe's replayed CUDA graph and, with
``--torch``, the same net's PyTorch twin as one CUDA graph (in bf16/fp16 under
torch.autocast + channels_last, as ``minicaffe bench --compare torch`` times it), both
recorded by CUPTI through torch.profiler (it sees every kernel of the process, CuPy's
and cuDNN's too).

    python benchmarks/profile_kernels.py models/vgg16/train_val.prototxt 64 \
        --precision bf16 --torch

Needs PyTorch with CUDA.  Prints, for each side, the kernels sorted by total time and
the same times summed by kind (convolution, GEMM, batch norm, element-wise...);
``--timeline``: the last step's kernels in launch order with the GPU's idle time before
each (what a short net's step loses between kernels).
"""
import argparse
import collections
import re
import sys

sys.path.insert(0, ".")

import torch  # noqa: E402

from minicaffe.core import backend, context  # noqa: E402
from minicaffe.core.config import RunConfig  # noqa: E402

KINDS = [  # (kind, pattern on the kernel's name), first match wins
    ("conv wgrad", r"wgrad|dgrad.*filter|bwd_filter|BackwardFilter|convolve_sgemm.*wgrad"),
    ("conv dgrad", r"dgrad|bwd_data|BackwardData"),
    ("conv fprop", r"fprop|conv2d|implicit_gemm|convolve|winograd|xmma_fprop|sm90_xmma"),
    ("gemm", r"gemm|cutlass|Kernel2|matmul|nvjet"),
    ("batch norm", r"(?i)bn_|batchnorm|batch_norm"),
    ("pool", r"(?i)pool"),
    ("cast/transpose", r"(?i)cast|transpose|nchw|nhwc|copy|convert"),
    ("reduce", r"(?i)reduce|sum"),
    ("optimizer", r"(?i)sgd|momentum|foreach|multi_tensor|update"),
]


def kind_of(name):
    for k, pat in KINDS:
        if re.search(pat, name):
            return k
    return "element-wise/other"


def table(prof, title, n, steps):
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = e.name[:110]
            t, c = rows.get(k, (0.0, 0))
            rows[k] = (t + e.device_time / 1e3, c + 1)
    total = sum(t for t, _ in rows.values())
    print(f"== {title}: {total / steps:.3f} ms of kernels per step, "
          f"{sum(c for _, c in rows.values()) / steps:.1f} kernels per step")
    kinds = collections.Counter()
    counts = collections.Counter()
    for k, (t, c) in rows.items():
        kinds[kind_of(k)] += t
        counts[kind_of(k)] += c
    for k, t in kinds.most_common():
        print(f"  {k:20s} {t / steps:8.3f} ms  x{counts[k] / steps:6.1f}")
    for k, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:n]:
        print(f"  {t / steps * 1e3:9.1f} us  x{c / steps:5.1f}  {k}")
    sys.stdout.flush()


def timeline(prof, steps):
    """The last replayed step's kernels in the order they ran: start (us from the step's
    first kernel), duration, the idle time before each; the step's span and its idle
    sum."""
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    n = len(ev) // steps
    last = ev[len(ev) - n:]
    t0 = last[0].time_range.start
    idle, end = 0.0, t0
    for e in last:
        gap = max(0.0, e.time_range.start - end)
        idle += gap
        print(f"  {e.time_range.start - t0:8.1f} us  {e.device_time:7.1f} us  gap {gap:5.1f}"
              f"  {e.name[:90]}")
        end = max(end, e.time_range.end)
    print(f"== last step: {n} kernels over {end - t0:.1f} us, {idle:.1f} us of it idle")


def profile_replay(replay, sync, steps):
    from torch.profiler import profile, ProfilerActivity
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        sync()
    return prof


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batch", type=int)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--timeline", action="store_true",
                    help="also print the last step's kernels in order, with the gaps")
    ap.add_argument("--torch", action="store_true",
                    help="also profile the PyTorch twin's CUDA graph")
    a = ap.parse_args()
    from minicaffe.synthetic import synthetic_solver
    context.set_mode_gpu()
    config = RunConfig.from_environment().replace(precision=a.precision)
    solver, info = synthetic_solver(model=a.model, batch=a.batch, config=config)
    net = solver.net
    blobs = [[b.cpu_data().copy() for b in layer.blobs] for layer in net.layers]
    solver.step(5)
    st = solver.gpu_step
    graphs = list(st.graphs.values())
    backend.synchronize()

    def replay():
        for g in graphs:
            g.launch(st.stream)
    prof = profile_replay(replay, st.stream.synchronize, a.steps)
    table(prof, f"minicaffe {a.precision} graph replay", a.top, a.steps)
    if a.timeline:
        timeline(prof, a.steps)
    if not a.torch:
        return
    from minicaffe.bench import capture_cuda_graph
    from minicaffe.torch_twin import TorchTwin
    sp = info["solver_param"]
    twin = TorchTwin(net, "cuda:0", blobs=blobs)
    twin.train(True)
    inputs = twin.inputs_from(net)
    if a.precision in ("bf16", "fp16"):
        twin.autocast = torch.bfloat16 if a.precision == "bf16" else torch.float16
        twin.to_channels_last()
        inputs = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v
                  for k, v in inputs.items()}
    elif a.precision == "fp32":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    run = capture_cuda_graph(twin, inputs, sp, 3)
    prof = profile_replay(run, torch.cuda.synchronize, a.steps)
    table(prof, f"PyTorch {a.precision} graph replay", a.top, a.steps)
    if a.timeline:
        timeline(prof, a.steps)


if __name__ == "__main__":
    main()
