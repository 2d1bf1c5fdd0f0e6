"""Where a multi-thread CPU step loses against the ideal split: each kernel-pool call of
one training step, timed from inside (prints figures, not a test).

Usage::

    OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_parts.py MODEL.prototxt [--threads 2]
        [--steps 5] [--repeat 7]

Builds the TRAIN net (make one with constant data as benchmarks/cpu_step.py says), sets
``--threads`` (the kernel pool, as ``minicaffe ... --threads N``), runs ``--steps`` warm-up
steps and then ``--repeat`` measured steps, layer by layer through the Net
(``forward_layer``/``backward_layer``: its folded ReLUs as in training), and prints the one whose
wall time is the median (and every measured step's total), with ``core.threads.run_parts`` replaced
by a copy that records, for every call made by a layer's forward or backward: its parts,
its wall time, how long the pool's first thread took to start its first part after the
call began ("start"), the gap between the threads' last parts ending ("skew"), the wait
from the last part's end to the call's return ("join"), and per thread the wall time inside
its parts, the thread's CPU time inside them (``time.thread_time``) and its voluntary
context switches (``getrusage(RUSAGE_THREAD)``: a thread that waits for the GIL or for
work sleeps).  Then per layer the wall time of its forward and backward outside any pool
call ("serial").  The sum of every thread's CPU time inside the parts, against the same
layers' time on one thread (``cpu_step.py --threads 1``), shows how much more work the
parts cost when they run side by side.  The replacement runs the parts as run_parts does
(the same order and bits); its own clock reads and ``getrusage`` calls add to each
part's time (not measured).  Linux only (RUSAGE_THREAD).
"""
import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def instrumented(threads, calls):
    """A run_parts that appends one record per pooled call to ``calls``."""
    clock, rt = time.perf_counter, resource.RUSAGE_THREAD

    def run_parts(count, fn):
        pool = threads.kernel_pool()
        t = min(threads.kernel_threads(), count)
        if pool is None or t < 2 or threads.in_kernel_pool():
            return [fn(0, i) for i in range(count)]
        results = [None] * count
        parts = iter(range(count))
        start, end, busy, cpu, csw = {}, {}, {}, {}, {}
        t0 = clock()

        def worker(slot):
            threads._local.busy = True
            start[slot] = clock()
            r0 = resource.getrusage(rt).ru_nvcsw
            b = c = 0.0
            try:
                for i in parts:
                    a, ac = clock(), time.thread_time()
                    results[i] = fn(slot, i)
                    b += clock() - a
                    c += time.thread_time() - ac
            finally:
                threads._local.busy = False
                end[slot], busy[slot], cpu[slot] = clock(), b, c
                csw[slot] = resource.getrusage(rt).ru_nvcsw - r0
        futures = [pool.submit(worker, slot) for slot in range(1, t)]
        worker(0)
        for f in futures:
            f.result()
        t1 = clock()
        calls.append({"parts": count, "wall": t1 - t0,
                      "start": min(start[s] for s in start if s) - t0,
                      "skew": max(end.values()) - min(end.values()),
                      "join": t1 - max(end.values()),
                      "busy": [busy[s] for s in sorted(busy)],
                      "cpu": [cpu[s] for s in sorted(cpu)],
                      "csw": [csw[s] for s in sorted(csw)]})
        return results
    return run_parts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args(argv)
    import minicaffe
    from minicaffe.core import threads
    from minicaffe.network.net import Net, TRAIN
    minicaffe.set_num_threads(a.threads)
    minicaffe.set_mode_cpu()
    net = Net(a.model, TRAIN)
    for _ in range(a.steps):
        net.forward_prefilled()
        net.backward_from_to()
    calls = []
    threads.run_parts = instrumented(threads, calls)
    clock = time.perf_counter
    n = len(net.layers)
    order = [(i, "forward") for i in range(n)] + [(i, "backward") for i in range(n - 1, -1, -1)]
    steps = []
    for _ in range(max(a.repeat, 1)):
        rows = []
        calls.clear()
        s0 = clock()
        fused = net.begin_pass()   # through the Net, as a training step (its folded ReLUs)
        for i, what in order:
            if what == "backward" and not net.layer_need_backward[i]:
                continue
            k = len(calls)
            t0 = clock()
            if what == "forward":
                net.forward_layer(i, fused)
            else:
                net.backward_layer(i)
            rows.append((net.layer_names[i], what, clock() - t0, calls[k:]))
        net.end_pass()
        steps.append((clock() - s0, rows))
    totals = [t for t, _ in steps]
    step, rows = sorted(steps, key=lambda r: r[0])[len(steps) // 2]
    print(f"{a.model}: {a.threads} threads, {len(steps)} steps after {a.steps} warm-up (ms: "
          + ", ".join(f"{t * 1e3:.1f}" for t in totals) + "), the median one below; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'layer':>8} {'pass':>8} {'wall':>7} {'serial':>7} {'parts':>5} {'start':>6} "
          f"{'skew':>6} {'join':>6}  per thread: in parts / CPU in parts / switches")
    tot = {"serial": 0.0, "start": 0.0, "skew": 0.0, "join": 0.0, "busy": 0.0, "cpu": 0.0,
           "csw": 0}
    for name, what, wall, cs in rows:
        serial = wall - sum(c["wall"] for c in cs)
        tot["serial"] += serial
        line = f"{name:>8} {what:>8} {wall * 1e3:7.2f} {serial * 1e3:7.2f}"
        if cs:
            parts = "+".join(str(c["parts"]) for c in cs)
            st, sk, jo = (sum(c[key] for c in cs) for key in ("start", "skew", "join"))
            busy = [sum(c["busy"][s] for c in cs) for s in range(len(cs[0]["busy"]))]
            cpu = [sum(c["cpu"][s] for c in cs) for s in range(len(cs[0]["cpu"]))]
            csw = [sum(c["csw"][s] for c in cs) for s in range(len(cs[0]["csw"]))]
            tot["start"] += st
            tot["skew"] += sk
            tot["join"] += jo
            tot["busy"] += sum(busy)
            tot["cpu"] += sum(cpu)
            tot["csw"] += sum(csw)
            line += (f" {parts:>5} {st * 1e3:6.2f} {sk * 1e3:6.2f} {jo * 1e3:6.2f}  "
                     + "  ".join(f"{b * 1e3:.2f} / {c * 1e3:.2f} / {w}"
                                 for b, c, w in zip(busy, cpu, csw)))
        print(line)
    print(f"step {step * 1e3:.2f}: outside pool calls {tot['serial'] * 1e3:.2f}; pool calls' "
          f"start {tot['start'] * 1e3:.2f}, skew {tot['skew'] * 1e3:.2f}, join "
          f"{tot['join'] * 1e3:.2f}; all threads inside parts {tot['busy'] * 1e3:.2f} wall, "
          f"{tot['cpu'] * 1e3:.2f} CPU, {tot['csw']} voluntary switches")


if __name__ == "__main__":
    main()
