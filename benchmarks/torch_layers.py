"""Where PyTorch's CPU training step goes, operator by operator (prints figures, not a test):
the other side of ``benchmarks/cpu_step.py``'s per-layer minicaffe table.

    python benchmarks/torch_layers.py [--net LeNet|"CIFAR-10 quick"] [--threads 1]
        [--steps 10] [--top 20]

The step of ``benchmarks/cpu_vs_torch.py`` (the same net, batch, random inputs, SGD with
momentum), three warm-up steps, then ``--steps`` steps under ``torch.profiler``.  Printed:
each operator with its input shapes (which tell the layer: ``mkldnn_convolution`` with a
(100, 32, 16, 16) input is CIFAR-10 quick's conv2 forward, ``convolution_backward`` its
backward) and its own CPU time per step, the largest ``--top`` of them, then the sum of
all operators' own time per step and the load average.  The profiler adds a little time
per operator; compare the shares, and ``cpu_vs_torch.py`` for the step itself.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="CIFAR-10 quick")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile
    from cpu_vs_torch import NETS, torch_step
    if a.net not in NETS:
        ap.error(f"--net must be one of {', '.join(NETS)}")
    torch.set_num_threads(a.threads)
    _, batch, shape = NETS[a.net]
    step = torch_step(a.net, batch, shape)
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(a.steps):
            step()
    events = prof.key_averages(group_by_input_shape=True)
    rows = sorted(((e.self_cpu_time_total / a.steps / 1e3, e.key, e.input_shapes)
                   for e in events), key=lambda r: -r[0])
    print(f"{a.net} b{batch}, PyTorch {torch.__version__}, {a.threads} thread(s): own CPU "
          f"time per training step, ms")
    for ms, key, shapes in rows[:a.top]:
        shown = [s for s in shapes if s][:2]
        print(f"{ms:8.2f}  {key:<42} {shown}")
    print(f"{sum(r[0] for r in rows):8.2f}  all operators; load average "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
