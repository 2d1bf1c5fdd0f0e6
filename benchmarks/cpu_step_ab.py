"""minicaffe's CPU training step in two source trees, A against B, in alternating rounds
(prints figures, not a test): how a change to the CPU code was measured on a shared machine.

    git archive BASE_COMMIT | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python benchmarks/cpu_step_ab.py /tmp/base . [--net LeNet|"CIFAR-10 quick"]
        [--threads 1] [--rounds 15] [--steps 5]

Each tree runs in its own worker process (the step of benchmarks/cpu_vs_torch.py: the net's
TRAIN phase with Input layers, SGD with momentum, random inputs set once); each round times
``--steps`` steps of A, then of B, so both see the same outside load.  Printed: the median
and the minimum over the rounds of ms per step, B/A of the medians, and the load average.
``--threads N`` (N > 1) runs both with ``minicaffe.set_num_threads(N)`` (the kernel pool).
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(root, net, threads):
    """Build the step in ``root``'s tree; then for each line k on stdin time k steps."""
    root = os.path.abspath(root)
    sys.path[:0] = [root, os.path.join(root, "benchmarks")]
    os.chdir(root)
    import cpu_vs_torch
    import minicaffe
    if threads > 1:
        minicaffe.set_num_threads(threads)
    path, batch, shape = cpu_vs_torch.NETS[net]
    step = cpu_vs_torch.minicaffe_step(path, batch, shape)
    step()
    print("ready", flush=True)
    for line in sys.stdin:
        k = int(line)
        t0 = time.perf_counter()
        for _ in range(k):
            step()
        print((time.perf_counter() - t0) * 1e3 / k, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="source tree A (e.g. the base commit, unpacked)")
    ap.add_argument("b", help="source tree B (e.g. this checkout: .)")
    ap.add_argument("--net", default="CIFAR-10 quick", choices=("LeNet", "CIFAR-10 quick"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.net, a.threads)
    for tree in (a.a, a.b):
        if not os.path.isfile(os.path.join(tree, "benchmarks", "cpu_vs_torch.py")):
            sys.exit(f"cpu_step_ab.py: {tree} is not a minicaffe tree "
                     f"(no benchmarks/cpu_vs_torch.py)")
    env = dict(os.environ)
    if a.threads == 1:
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    me = os.path.abspath(__file__)
    procs = {}
    try:
        for tag, tree in (("A", a.a), ("B", a.b)):
            procs[tag] = subprocess.Popen(
                [sys.executable, me, tree, tree, "--worker", tree, "--net", a.net,
                 "--threads", str(a.threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, env=env)
        for tag, p in procs.items():
            if p.stdout.readline().strip() != "ready":
                sys.exit(f"cpu_step_ab.py: the worker for tree {tag} failed to start")
        print(f"{a.net}, {a.threads} thread(s); A = {a.a}, B = {a.b}; load average "
              f"{os.getloadavg()[0]:.2f} at start")
        times = {tag: [] for tag in procs}
        for _ in range(a.rounds):
            for tag, p in procs.items():
                p.stdin.write(f"{a.steps}\n")
                p.stdin.flush()
                times[tag].append(float(p.stdout.readline()))
    finally:
        for p in procs.values():
            if p.stdin:
                p.stdin.close()
            p.wait()
    med = {tag: statistics.median(v) for tag, v in times.items()}
    for tag, v in times.items():
        print(f"{tag}: {med[tag]:.1f} ms/step (min {min(v):.1f})")
    print(f"B/A {med['B'] / med['A']:.3f}; load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
