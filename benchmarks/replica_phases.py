"""Where a CPU replicas step's time goes, in the main process and in the workers (prints
figures, not a test).

    python benchmarks/replica_phases.py --replicas 2 [--net LeNet] [--steps 200] [--layers]
                                        [--batch 8]

The nets of cpu_vs_torch.py (LeNet b64, CIFAR-10 quick b100; Input layers, random inputs
set once), trained ``--steps`` steps (after 5 to warm up) with ``--replicas N``, each step
cut by perf_counter stamps around the pool's waits (engine/replicas.py) into:

- ``before``: the data layers, the copy into shared memory, the wake-ups (main process);
- ``replicas``: waiting for the workers' forward and backward;
- ``sum wait``: waiting for the workers' shares of the gradients' sum (none where the
  main process sums them itself, as before the reduce-scatter);
- ``after``: what follows the last wait in ``forward_backward`` -- the gradient sum where
  the main process does it, the add into the diffs, the outputs (main process);
- ``update``: the rest of the step: clearing the diffs, the solver's update (of which
  ``apply`` is ``apply_update``, where the main process runs it), the smoothed loss
  (main process).

Printed: the median over the steps of each, in ms, and ``serial`` = before + after +
update, the main process's own time per step.

The workers stamp their side too (perf_counter is CLOCK_MONOTONIC, one clock for every
process): for the forward-backward message, ``wake`` (from the main process's first send
to the worker's receive), ``input`` (copying its slice out of shared memory), ``clear``
(zeroing its diffs), ``forward``, ``backward``, ``results`` (the outputs written back)
and ``answer`` (from the last worker's send to the main process's wait returning); for
the sum message ``wake``, ``sum``, ``update`` (the solver's update of the share, where
the workers run it) and ``answer``; ``busy``: from receive to send.  Also counted
(getrusage) between receive and answer: the minor page faults (temporaries the kernel
maps afresh) and the workers preempted (an involuntary context switch: another process
took the core).  ``--spin-us`` (an experiment, no library option) makes each worker poll
its pipe without sleeping for that long before it blocks.  Each step takes the largest
of the workers' figures, and the line prints the median over the steps (so the workers'
phases do not add up to ``replicas``: the slowest worker differs from phase to phase).
``--layers`` also prints worker 0's median forward and backward time per layer.
``--independent N`` runs the same work without the pool: N processes at once, each the
whole net on batch/N images (one thread, in step: a barrier before each pass), printing
the forward-backward time (per step the largest of the N) and process 0's forward per
layer -- what the machine itself costs N busy workers (shared cores, clocks, memory),
apart from the pipes.

Stamps wrap private functions (in the workers too: the pool's worker entry point is
swapped for one that wraps it, before the workers start): the figures are the step's
phases, not an API.  Runs on the tree it sits in, or ``--tree``'s.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMPS_DIR = "REPLICA_PHASES_DIR"     # where the workers leave their stamps (this script's)
SPIN = "REPLICA_PHASES_SPIN_US"       # --spin-us, to the workers


class _StampedConn:
    """A worker's pipe that stamps each message received and each answer sent."""

    def __init__(self, conn, stamps, spin=0.0):
        self.conn, self.stamps, self.spin = conn, stamps, spin

    def recv_bytes(self):
        if self.spin:        # poll without sleeping for up to ``spin`` seconds first
            end = time.perf_counter() + self.spin
            while not self.conn.poll(0) and time.perf_counter() < end:
                pass
        msg = self.conn.recv_bytes()
        self.stamps.append(("recv:" + msg[:1].decode(errors="replace"),
                            time.perf_counter()))
        self.stamps.append(("ru0", _rusage()))
        return msg

    def send_bytes(self, msg):
        self.stamps.append(("send", time.perf_counter()))
        self.stamps.append(("ru1", _rusage()))
        return self.conn.send_bytes(msg)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def _rusage():
    """(minor page faults, involuntary context switches) of this process so far."""
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_minflt, r.ru_nivcsw)


def _stamped(stamps, name, fn):
    def wrapper(*args, **kwargs):
        stamps.append((name + "0", time.perf_counter()))
        try:
            return fn(*args, **kwargs)
        finally:
            stamps.append((name + "1", time.perf_counter()))
    return wrapper


def timed_worker(conn, spec):
    """The pool's worker entry point with stamps around its pieces; the stamps go to a
    file in $REPLICA_PHASES_DIR when the worker ends."""
    import pickle
    from minicaffe.engine import replicas
    from minicaffe.network.net import Net
    stamps, layers = [], []
    if not hasattr(replicas, "_clear"):       # a tree from before the gathered weights
        Net.clear_param_diffs = _stamped(stamps, "clear", Net.clear_param_diffs)
    Net.forward_prefilled = _stamped(stamps, "fwd", Net.forward_prefilled)
    Net.backward_from_to = _stamped(stamps, "bwd", Net.backward_from_to)
    if hasattr(replicas, "_share_sum"):      # the whole share's sum, gathered rows too
        replicas._share_sum = _stamped(stamps, "sum", replicas._share_sum)
    else:
        replicas.weighted_sum = _stamped(stamps, "sum", replicas.weighted_sum)
    if hasattr(replicas, "_clear"):
        replicas._clear = _stamped(stamps, "clear", replicas._clear)
    try:
        from minicaffe.solvers import shares
    except ImportError:      # a tree from before the workers' update
        shares = None
    if shares is not None:
        bind = shares.ShareUpdate.bind

        def stamped_bind(self, *args):
            apply, sumsq = bind(self, *args)
            return _stamped(stamps, "upd", apply), sumsq
        shares.ShareUpdate.bind = stamped_bind
    fl, bl = Net.forward_layer, Net.backward_layer

    def forward_layer(self, i, fused):
        t0 = time.perf_counter()
        try:
            return fl(self, i, fused)
        finally:
            layers.append(("f", i, self.layer_names[i], time.perf_counter() - t0))

    def backward_layer(self, i):
        t0 = time.perf_counter()
        try:
            return bl(self, i)
        finally:
            layers.append(("b", i, self.layer_names[i], time.perf_counter() - t0))
    Net.forward_layer, Net.backward_layer = forward_layer, backward_layer
    try:
        replicas._worker_main(_StampedConn(conn, stamps,
                                           float(os.environ.get(SPIN, 0)) * 1e-6), spec)
    finally:
        out = os.path.join(os.environ[STAMPS_DIR], f"{spec['slice'][0]}.pkl")
        with open(out, "wb") as f:
            pickle.dump((spec["slice"], stamps, layers), f)


def independent(k, n, net, batch, steps, barrier, queue):
    """``--independent``: process k of n runs the net's forward-backward on ``batch``
    images on one thread, in step with the others (a barrier before each pass), no pool."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_vs_torch import NETS, minicaffe_step
    from minicaffe.network.net import Net
    path, _, shape = NETS[net]
    _, solver = minicaffe_step(path, batch, shape, 1)
    layers, times = {}, []
    fl = Net.forward_layer

    def forward_layer(self, i, fused):
        t0 = time.perf_counter()
        try:
            return fl(self, i, fused)
        finally:
            layers.setdefault(self.layer_names[i], []).append(time.perf_counter() - t0)
    Net.forward_layer = forward_layer
    n_net = solver.net
    for j in range(steps + 5):
        barrier.wait()
        t0 = time.perf_counter()
        n_net.clear_param_diffs()
        n_net.forward_backward()
        if j >= 5:
            times.append(time.perf_counter() - t0)
    queue.put((k, times, {name: statistics.median(v[5:]) for name, v in layers.items()}))


def _independent(a, batch):
    """The workers' work without the pool: ``a.independent`` processes at once, each a
    whole net on batch / n images, lock-stepped by a barrier: the machine's own
    slowdown under n busy cores (shared cores, clocks, memory), apart from any IPC."""
    import multiprocessing
    n = a.independent
    each = max(1, batch // n)
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=independent, args=(k, n, a.net, each, a.steps, barrier,
                                                   queue)) for k in range(n)]
    for p in procs:
        p.start()
    got = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    worst = [max(t[1][j] for t in got) for j in range(a.steps)]
    med = statistics.median(statistics.median(t[1]) for t in got)
    print(f"{n} independent processes (no pool), {a.net} b{each} each, one thread: "
          f"forward-backward {statistics.median(worst) * 1e3:.3f} ms (per step the largest "
          f"of {n}, median), {med * 1e3:.3f} (median process's median)")
    print("process 0, forward per layer (median ms): " + ", ".join(
        f"{name} {v * 1e3:.3f}" for name, v in got[0][2].items()))


def _worker_phases(stamps):
    """[(kind 'S'/'A', {phase: (start, end)})] of one worker's messages, in order."""
    out, cur = [], None
    for name, t in stamps:
        if name.startswith("recv:"):
            cur = (name[5:], {"recv": t})
        elif name == "ru1" and cur is not None:
            cur[1]["ru1"] = t
            out.append(cur)
            cur = None
        elif cur is not None:
            cur[1][name] = t
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--net", default="LeNet")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=0,
                    help="another batch than the net's (b8 at --replicas 2: the slices of "
                         "b64 at --replicas 16)")
    ap.add_argument("--tree", default=ROOT,
                    help="the minicaffe tree to measure (default: the one this file sits "
                         "in), e.g. another checkout, to compare with this script's stamps")
    ap.add_argument("--spin-us", type=float, default=0,
                    help="an experiment: each worker polls its pipe without sleeping for "
                         "up to this many microseconds before it blocks (is the wake-up "
                         "latency the kernel's?)")
    ap.add_argument("--independent", type=int, default=0,
                    help="instead: this many independent processes, each running the net "
                         "on batch/N images in step, no pool (the machine's slowdown)")
    ap.add_argument("--layers", action="store_true",
                    help="also worker 0's median forward/backward time per layer")
    a = ap.parse_args(argv)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.path.insert(0, os.path.abspath(a.tree))
    import pickle
    from cpu_vs_torch import NETS, minicaffe_step
    import replica_phases         # this file as a module the workers can import
    import minicaffe
    from minicaffe.engine import replicas
    tmp = tempfile.TemporaryDirectory(prefix="replica-phases-")
    os.environ[STAMPS_DIR] = tmp.name
    os.environ[SPIN] = str(a.spin_us)
    replicas._worker_main = replica_phases.timed_worker
    stamps = []
    pool_cls = replicas.ReplicaPool
    wait, fb, phase = pool_cls._wait, pool_cls.forward_backward, pool_cls._phase

    def timed_wait(self, *args):
        t0 = time.perf_counter()
        try:
            return wait(self, *args)
        finally:
            stamps.append(("wait", t0, time.perf_counter()))

    def timed_fb(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fb(self, *args, **kwargs)
        finally:
            stamps.append(("fb", t0, time.perf_counter()))

    def timed_phase(self, msg, *args):
        stamps.append(("phase:" + msg[:1].decode().replace("G", "A"), time.perf_counter(),
                       None))
        return phase(self, msg, *args)
    pool_cls._wait, pool_cls.forward_backward, pool_cls._phase = timed_wait, timed_fb, \
        timed_phase
    path, batch, shape = NETS[a.net]
    batch = a.batch or batch
    if a.independent:
        return _independent(a, batch)
    step, solver = minicaffe_step(path, batch, shape, a.replicas)
    solver.apply_update = _stamped_main(stamps, solver.apply_update)
    tree = os.path.dirname(minicaffe.__path__[0])
    spin = f", workers spinning {a.spin_us:g} us" if a.spin_us else ""
    print(f"minicaffe {minicaffe.__version__} ({tree}), {a.net} b{batch}, --replicas "
          f"{a.replicas}{spin}, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} "
          "at start")
    for _ in range(5):
        step()
    rows, sends = [], []
    try:
        for _ in range(a.steps):
            del stamps[:]
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            waits = [s for s in stamps if s[0] == "wait"]
            (_, f0, f1), = [s for s in stamps if s[0] == "fb"]
            apply = [e - b for n, b, e in stamps if n == "apply"]
            sends.append({n[6:]: b for n, b, _ in stamps if n.startswith("phase:")}
                         | {"end:" + n[6:]: w[2] for (n, _, _), w in zip(
                             [s for s in stamps if s[0].startswith("phase:")], waits)})
            rows.append({"before": waits[0][1] - f0, "replicas": waits[0][2] - waits[0][1],
                         "sum wait": sum(e - b for _, b, e in waits[1:]),
                         "after": f1 - waits[-1][2], "update": t1 - f1 + f0 - t0,
                         "apply": sum(apply), "step": t1 - t0})
    finally:
        solver.close()
    for r in rows:
        r["serial"] = r["before"] + r["after"] + r["update"]
    keys = ["before", "replicas", "sum wait", "after", "update", "apply", "serial", "step"]
    print(", ".join(f"{k} {statistics.median(r[k] for r in rows) * 1e3:.3f}" for k in keys)
          + f" ms (medians of {a.steps} steps; main process)")
    workers = []
    for name in sorted(os.listdir(tmp.name), key=lambda s: int(s.split(".")[0])):
        with open(os.path.join(tmp.name, name), "rb") as f:
            workers.append(pickle.load(f))
    tmp.cleanup()
    _print_workers(workers, sends, a)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


def _stamped_main(stamps, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stamps.append(("apply", t0, time.perf_counter()))
    return wrapper


def _print_workers(workers, sends, a):
    """The workers' phases of the last ``len(sends)`` steps: per step the largest over
    the workers, then the median over the steps."""
    per = []        # per worker: its messages' phases, the timed steps' only
    for _, stamps, _ in workers:
        msgs = _worker_phases(stamps)
        s_msgs = [m for m in msgs if m[0] == "S"][-len(sends):]
        a_msgs = [m for m in msgs if m[0] in "AG"][-len(sends):]
        per.append((s_msgs, a_msgs))
    n_a = min(len(x[1]) for x in per if x[1]) if any(x[1] for x in per) else 0
    s_rows, a_rows = [], []
    for j, sent in enumerate(sends):
        row = {}
        for s_msgs, _ in per:
            (_, t) = s_msgs[j]
            ph = {"wake": t["recv"] - sent["S"], "input": t["clear0"] - t["recv"],
                  "clear": t["clear1"] - t["clear0"], "forward": t["fwd1"] - t["fwd0"],
                  "backward": t["bwd1"] - t["bwd0"], "results": t["send"] - t["bwd1"],
                  "busy": t["send"] - t["recv"]}
            for k, v in ph.items():
                row[k] = max(row.get(k, 0.0), v)
            faults = t["ru1"][0] - t["ru0"][0]
            switches = t["ru1"][1] - t["ru0"][1]
            row["faults"] = max(row.get("faults", 0), faults)
            row["preempted"] = row.get("preempted", 0) + (switches > 0)
        row["answer"] = sent["end:S"] - max(m[j][1]["send"] for m, _ in per)
        s_rows.append(row)
        if "A" in sent and n_a:
            row = {}
            for _, a_msgs in per:
                if not a_msgs:
                    continue
                (_, t) = a_msgs[j - len(sends) + n_a] if j >= len(sends) - n_a else \
                    (None, None)
                if t is None:
                    continue
                ph = {"wake": t["recv"] - sent["A"], "sum": t["sum1"] - t["sum0"],
                      "update": t["upd1"] - t["upd0"] if "upd1" in t else 0.0}
                for k, v in ph.items():
                    row[k] = max(row.get(k, 0.0), v)
                row["last"] = max(row.get("last", 0.0), t["send"])
            if row:
                row["answer"] = sent["end:A"] - row.pop("last")
                a_rows.append(row)

    def line(rows):
        return ", ".join(f"{k} {statistics.median(r[k] for r in rows) * 1e3:.3f}"
                         for k in rows[0] if k not in ("faults", "preempted"))
    print(f"workers, forward-backward: {line(s_rows)} ms (per step the largest of "
          f"{len(workers)} workers, medians)")
    faults = statistics.median(r["faults"] for r in s_rows)
    print(f"workers, forward-backward: page faults {faults:.0f} "
          f"(median over the steps of the most in one worker); preempted "
          f"{sum(r['preempted'] for r in s_rows) / len(s_rows):.2f} workers per step "
          "(mean; an involuntary context switch between receive and answer)")
    if a_rows:
        print(f"workers, gradient sum: {line(a_rows)} ms")
    if a.layers:
        times = {}
        for kind, i, name, dt in workers[0][2]:
            times.setdefault((i, kind, name), []).append(dt)
        fwd = sorted((i, n, statistics.median(v)) for (i, k, n), v in times.items()
                     if k == "f")
        bwd = {i: statistics.median(v) for (i, k, n), v in times.items() if k == "b"}
        print("worker 0, per layer (median ms, forward / backward): " + ", ".join(
            f"{n} {f * 1e3:.3f}/{bwd.get(i, 0) * 1e3:.3f}" for i, n, f in fwd))


if __name__ == "__main__":
    main()
