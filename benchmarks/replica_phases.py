"""Where a CPU replicas step's time goes in the main process (prints figures, not a test).

    python benchmarks/replica_phases.py --replicas 2 [--net LeNet] [--steps 200]

The nets of cpu_vs_torch.py (LeNet b64, CIFAR-10 quick b100; Input layers, random inputs
set once), trained ``--steps`` steps (after 5 to warm up) with ``--replicas N``, each step
cut by perf_counter stamps around the pool's waits (engine/replicas.py) into:

- ``before``: the data layers, the copy into shared memory, the wake-ups (main process);
- ``replicas``: waiting for the workers' forward and backward;
- ``sum wait``: waiting for the workers' shares of the gradients' sum (none where the
  main process sums them itself, as before the reduce-scatter);
- ``after``: what follows the last wait in ``forward_backward`` -- the gradient sum where
  the main process does it, the add into the diffs, the outputs (main process);
- ``update``: the rest of the step: the solver's update, the smoothed loss (main
  process).

Printed: the median over the steps of each, in ms, and ``serial`` = before + after +
update, the main process's own time per step.  Stamps wrap private methods: the figures
are the step's phases, not an API.  Runs on the tree it sits in (``ROOT``).
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--net", default="LeNet")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args(argv)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_vs_torch import NETS, minicaffe_step
    import minicaffe
    from minicaffe.engine import replicas
    stamps = []
    pool_cls = replicas.ReplicaPool
    wait, fb = pool_cls._wait, pool_cls.forward_backward

    def timed_wait(self, *args):
        t0 = time.perf_counter()
        try:
            return wait(self, *args)
        finally:
            stamps.append(("wait", t0, time.perf_counter()))

    def timed_fb(self):
        t0 = time.perf_counter()
        try:
            return fb(self)
        finally:
            stamps.append(("fb", t0, time.perf_counter()))
    pool_cls._wait, pool_cls.forward_backward = timed_wait, timed_fb
    path, batch, shape = NETS[a.net]
    step, solver = minicaffe_step(path, batch, shape, a.replicas)
    print(f"minicaffe {minicaffe.__version__} ({ROOT}), {a.net} b{batch}, --replicas "
          f"{a.replicas}, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} "
          "at start")
    for _ in range(5):
        step()
    rows = []
    try:
        for _ in range(a.steps):
            del stamps[:]
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            waits = [s for s in stamps if s[0] == "wait"]
            (_, f0, f1), = [s for s in stamps if s[0] == "fb"]
            rows.append({"before": waits[0][1] - f0, "replicas": waits[0][2] - waits[0][1],
                         "sum wait": sum(e - b for _, b, e in waits[1:]),
                         "after": f1 - waits[-1][2], "update": t1 - f1 + f0 - t0,
                         "step": t1 - t0})
    finally:
        solver.close()
    for r in rows:
        r["serial"] = r["before"] + r["after"] + r["update"]
    keys = ["before", "replicas", "sum wait", "after", "update", "serial", "step"]
    print(", ".join(f"{k} {statistics.median(r[k] for r in rows) * 1e3:.3f}" for k in keys)
          + f" ms (medians of {a.steps} steps)")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
