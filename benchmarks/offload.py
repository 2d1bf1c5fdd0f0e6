"""Offload of feature maps (docs/offload.md): VGG-16 and ResNet-50 at batch 256 under each
offload policy, with PyTorch's ``save_on_cpu(pin_memory=True)`` as the peer, in one run.

    python benchmarks/offload.py [--nets vgg16,resnet50] [--batch 256] [--iters 5]
                                 [--budgets 0.5,0.65,0.75] [--limits 12GiB] [--json OUT.json]
                                 [--policies ALL,CONV] [--vdnn ALL,CONV,DYNAMIC]
                                 [--one-lane ALL,CONV,DYNAMIC]
                                 [--no-recompute ALL,CONV,DYNAMIC]
                                 [--no-through ALL,CONV,DYNAMIC]
                                 [--no-timeline] [--timeline-steps all|waits]

Each configuration runs in a child process of its own (a clean device: its peak is its
own), synthetic inputs on the GPU (minicaffe.synthetic, through benchmarks/gpu_step.py), SGD with
momentum, strict fp32 on both sides, the minicaffe step replayed as CUDA graphs.
Printed per net: peak device memory (measured: the allocator's high-water mark plus
the graphs' private pools; and planned), ms per iteration (median of repeats), the
slowdown against the same framework without offload, the bytes moved per iteration,
and the bound those bytes put on an iteration at the copy bandwidth measured first in
the same run: max(NONE's ms, bytes out / device->host GB/s, bytes back / host->device
GB/s) -- how close each policy comes to it.  DYNAMIC runs under budgets given as
fractions of NONE's planned peak (``--budgets``) and under budgets as the user writes them
(``--limits 12GiB``, ``--gpu_mem_limit``'s spellings); a budget even ALL cannot meet prints
the one-line error instead of a row.

Then, per configuration, its timeline (``offload.trace_iteration``: one more
forward-backward run eagerly with CUDA events): per layer and direction when the compute
stream ran it, how long it stood still for copies and for which, how busy each copy
stream was meanwhile; every copy with its start, end and rate; and the sums against the
copy bound and the timeline model's prediction (``--timeline-steps waits``: only the
steps that waited or overlapped a copy).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODELS = {"vgg16": "models/vgg16/train_val.prototxt",
          "resnet50": "models/resnet50/train_val.prototxt"}
GiB = float(1 << 30)
# a child's schedule: lives lengthened (hide_copies), vDNN's lives, one d2h stream
MODE_LABEL = {"1": "", "0": " vDNN lives", "1L1": " one d2h stream", "1R0": " no recompute",
              "1T0": " no maps made on the way"}


# -- one configuration per process ---------------------------------------------------------
def run_minicaffe(net_name, batch, policy, budget, iters, repeats, hide=True, lanes=2,
                  recompute=True, through=True):
    from gpu_step import make, synthetic
    from minicaffe.core import backend, context, log
    from minicaffe.engine import offload
    from minicaffe.gpu import options, pool
    from minicaffe.proto import caffe_pb2
    from minicaffe.core.config import parse_gpu_mem_limit
    log.init_log()
    options.set_tf32(False)
    context.set_mode_gpu()
    pool.ensure()
    budget = offload.resolve_budget(parse_gpu_mem_limit(budget))   # 12GiB, auto...
    offload.HIDE = hide            # off: the lives of vDNN's points (the schedule before)
    offload.LANES = lanes          # 1: one device->host stream (the schedule of round 2)
    offload.RECOMPUTE = recompute  # off: every offloaded map copied (the schedule before)
    offload.THROUGH = through      # off: no recompute makes recomputed inputs on the way
    net = synthetic(MODELS[net_name], batch, [3, 224, 224])
    net.offload_param.policy = caffe_pb2.OffloadParameter.Policy.Value(policy)
    net.offload_param.gpu_memory_budget = int(budget)
    backend.synchronize()
    pool.reset_peak()
    t0 = time.perf_counter()
    # the same workspace rule for every row, NONE included (an offloading net's: Find
    # tries at most OFFLOAD_FIND_LIMIT; a GiB of workspace must buy 10% of the
    # convolutions' time)
    from minicaffe.layers import cudnn_layers
    os.environ.setdefault("MINICAFFE_CUDNN_WORKSPACE_LIMIT", str(cudnn_layers.OFFLOAD_FIND_LIMIT))
    solver = make(net, True)
    cudnn_layers.share_workspace(solver.net.layers, cudnn_layers.OFFLOAD_PRICE_PER_GIB)
    try:
        solver.step(4)             # warm-up, capture (DYNAMIC: warm-up, timed, capture)
    except offload.BudgetError as e:
        return {"error": str(e)}
    backend.synchronize()
    setup = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        solver.step(iters)
        backend.synchronize()
        times.append((time.perf_counter() - t) / iters * 1e3)
    st = solver.gpu_step
    off = st.offload
    out = {"ms": statistics.median(times), "all_ms": times, "setup_s": setup,
           "peak": pool.peak_bytes() + st.private_bytes(), "planned": st.plan.peak,
           "allocator": pool.name(), "graphs": bool(st.graphs)}
    if off is not None:
        out["lengthened"] = off.oplan.info.get("lengthened", 0)
        out["lanes"] = off.oplan.info.get("lanes", 0)
        out["kept"] = off.oplan.info.get("kept", 0)
        out["recomputed"] = sum(1 for e in off.oplan.entries if e.recompute is not None)
        out["recomputed_bytes"] = off.oplan.recomputed_bytes
        out["through"] = sum(1 for v in off.oplan.through.values() if v)
        out.update(moved=off.oplan.moved_bytes, back=off.oplan.returned_bytes,
                   n=len(off.oplan.entries), host=off.oplan.host_bytes,
                   model_ms=off.oplan.info.get("total_s", 0) * 1e3,
                   compute_model_ms=off.oplan.info.get("compute_s", 0) * 1e3)
    else:
        out.update(moved=0, back=0, n=0, host=0)
    out["floor"] = offload.floor_bytes(st.plan)
    out["floor_lines"] = offload.floor_lines(st.plan)
    if os.environ.get("OFFLOAD_BENCH_TIMELINE", "1") == "1":
        out["timeline"] = offload.trace_iteration(st).as_dict()
        # the budget-aware copy bound (offload.budget_bound) over this run's measured
        # step times, at the rates measured first in this run, within the run's budget
        # (or, with none, the memory its plan took)
        from minicaffe.engine.plan import MemoryPlan
        rates = os.environ.get("OFFLOAD_BENCH_RATES", "")
        d2h, h2d = (float(x) for x in rates.split(",")) if rates else \
            (offload.D2H_BYTES_PER_S, offload.H2D_BYTES_PER_S)
        L = len(st.net.layers)
        times = [0.0] * (2 * L)
        for r in out["timeline"]["rows"]:
            times[r["step"]] = r["ms"] * 1e-3
        memory = budget if budget and policy != "NONE" else st.plan.peak
        plan = MemoryPlan(st.net, train=True, history_sets=len(solver.history_flat))
        b = offload.budget_bound(plan, times, memory, d2h, h2d)
        out["budget_bound"] = {"ms": None if b is None else b * 1e3, "memory": memory,
                               "compute_ms": sum(times) * 1e3}
    return out


def run_torch(net_name, batch, mode, iters, repeats):
    import torch
    import torch.nn as nn
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    model = (vgg16() if net_name == "vgg16" else resnet50()).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)
    lossf = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=False)
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = lossf(model(x), y)
        else:
            loss = lossf(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / iters * 1e3)
    return {"ms": statistics.median(times), "all_ms": times,
            "peak": torch.cuda.max_memory_allocated(), "torch": torch.__version__}


def vgg16():
    import torch.nn as nn
    layers, c = [], 3
    for v in [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"]:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
            c = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * 7 * 7, 4096),
                         nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(4096, 4096),
                         nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(4096, 1000))


def resnet50():
    import torch.nn as nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            cout = mid * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, stride, bias=False), nn.BatchNorm2d(mid), nn.ReLU(True),
                nn.Conv2d(mid, mid, 3, 1, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(True),
                nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.short = None if (cin == cout and stride == 1) else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            self.relu = nn.ReLU(True)

        def forward(self, x):
            s = x if self.short is None else self.short(x)
            return self.relu(self.body(x) + s)

    blocks, cin = [], 64
    for mid, n, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for k in range(n):   # Caffe's ResNet-50 strides in the first 1x1 convolution
            blocks.append(Bottleneck(cin, mid, stride if k == 0 else 1))
            cin = mid * 4
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                         nn.ReLU(True), nn.MaxPool2d(3, 2, 1), *blocks,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


def bandwidth(nbytes=1 << 30, repeats=5):
    """GB/s of pinned copies, each way alone and both at once (cudaHostAlloc'd memory)."""
    import cupy as cp
    from minicaffe.engine.offload import HostSlab
    host = HostSlab(2 * nbytes)
    dev = cp.empty(2 * nbytes, dtype=cp.uint8)
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime

    def timed(fn):
        best = None
        for _ in range(repeats):
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            fn()
            cp.cuda.Device().synchronize()
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        return best

    d2h = nbytes / timed(lambda: rt.memcpyAsync(host.ptr, dev.data.ptr, nbytes, 2, s1.ptr)) / 1e9
    h2d = nbytes / timed(lambda: rt.memcpyAsync(dev.data.ptr, host.ptr, nbytes, 1, s1.ptr)) / 1e9

    def both():
        rt.memcpyAsync(host.ptr, dev.data.ptr, nbytes, 2, s1.ptr)
        rt.memcpyAsync(dev.data.ptr + nbytes, host.ptr + nbytes, nbytes, 1, s2.ptr)
    duplex = 2 * nbytes / timed(both) / 1e9
    return {"d2h": d2h, "h2d": h2d, "both": duplex}


def child(argv):
    kind = argv[0]
    if kind == "bandwidth":
        res = bandwidth()
    elif kind == "minicaffe":
        net, batch, policy, budget, iters, repeats, hide = argv[1:]
        res = run_minicaffe(net, int(batch), policy, budget, int(iters), int(repeats),
                            hide[0] == "1", 1 if hide.endswith("L1") else 2,
                            not hide.endswith("R0"), not hide.endswith("T0"))
    else:
        net, batch, mode, iters, repeats = argv[1:]
        res = run_torch(net, int(batch), mode, int(iters), int(repeats))
    print("RESULT " + json.dumps(res), flush=True)


def spawn(*args, timeout=180):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {p.returncode}: {tail}"}
    res = json.loads(lines[-1][len("RESULT "):])
    res["wall_s"] = time.perf_counter() - t
    return res


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--nets", default="vgg16,resnet50")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budgets", default="0.5,0.65,0.75",
                    help="DYNAMIC budgets, as fractions of NONE's planned peak")
    ap.add_argument("--limits", default="",
                    help="DYNAMIC budgets as --gpu_mem_limit takes them: 12GiB,12000MiB")
    ap.add_argument("--policies", default="ALL,CONV", help="the fixed policies after NONE")
    ap.add_argument("--vdnn", default="",
                    help="policies (ALL,CONV,DYNAMIC) also run with vDNN's lives "
                         "(hide_copies off), for comparison in the same run")
    ap.add_argument("--one-lane", default="",
                    help="policies (ALL,CONV,DYNAMIC) also run with one device->host "
                         "stream (offload.LANES = 1), for comparison in the same run")
    ap.add_argument("--no-recompute", default="",
                    help="policies (ALL,CONV,DYNAMIC) also run with every offloaded map "
                         "copied (offload.RECOMPUTE = False), for comparison in the same run")
    ap.add_argument("--no-through", default="",
                    help="policies (ALL,CONV,DYNAMIC) also run with no recompute making "
                         "recomputed inputs on the way (offload.THROUGH = False), for "
                         "comparison in the same run")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-timeline", action="store_true")
    ap.add_argument("--timeline-steps", default="waits", choices=("all", "waits"))
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    os.environ["OFFLOAD_BENCH_TIMELINE"] = "0" if a.no_timeline else "1"
    report = {"bandwidth": spawn("bandwidth")}
    bw = report["bandwidth"]
    if "d2h" in bw:           # the children's budget bound at the rates measured here
        os.environ["OFFLOAD_BENCH_RATES"] = f"{bw['d2h'] * 1e9},{bw['h2d'] * 1e9}"
    print(f"pinned copies: {bw.get('d2h', 0):.1f} GB/s device->host, "
          f"{bw.get('h2d', 0):.1f} GB/s host->device, {bw.get('both', 0):.1f} GB/s both ways "
          f"{bw.get('error', '')}", flush=True)
    for name in a.nets.split(","):
        rows = []
        none = spawn("minicaffe", name, a.batch, "NONE", 0, a.iters, a.repeats, 1)
        rows.append(("minicaffe NONE", none))
        print(f"  ({name} NONE: " + (none["error"] if "error" in none else
              f"{none['ms']:.1f} ms, peak {none['peak'] / GiB:.2f} GiB") + ")", flush=True)
        from minicaffe.core.config import parse_gpu_mem_limit
        runs = [(p, 0, p) for p in a.policies.split(",") if p]
        for f in [float(x) for x in a.budgets.split(",") if x and "planned" in none]:
            budget = int(f * none["planned"])
            runs.append(("DYNAMIC", budget, f"DYNAMIC {f:g}xNONE ({budget / GiB:.1f} GiB)"))
        for text in [x for x in a.limits.split(",") if x]:
            parse_gpu_mem_limit(text)          # a mistake stops here, not in a child
            runs.append(("DYNAMIC", text, f"DYNAMIC {text}"))
        for policy, budget, label in runs:
            modes = ["1"] + (["0"] if policy in a.vdnn.split(",") else []) + \
                (["1L1"] if policy in a.one_lane.split(",") else []) + \
                (["1R0"] if policy in a.no_recompute.split(",") else []) + \
                (["1T0"] if policy in a.no_through.split(",") else [])
            for hide in modes:
                rows.append((f"minicaffe {label}{MODE_LABEL[hide]}",
                             spawn("minicaffe", name, a.batch, policy, budget, a.iters,
                                   a.repeats, hide)))
                r = rows[-1][1]            # as it comes: a run cut short keeps its rows
                print(f"  ({name} {rows[-1][0]}: " + (r["error"] if "error" in r else
                      f"{r['ms']:.1f} ms, peak {r['peak'] / GiB:.2f} GiB") + ")", flush=True)
        if not a.no_torch:
            for mode in ("none", "save_on_cpu"):
                rows.append((f"PyTorch {mode}", spawn("torch", name, a.batch, mode, a.iters,
                                                      a.repeats)))
        report[name] = {"rows": rows}
        print_table(name, a.batch, rows, bw)
        print_timelines(rows, a.timeline_steps)
        if a.json:                 # after each net: a run cut short keeps what it measured
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)


def print_timelines(rows, which):
    from minicaffe.engine.offload import timeline_lines
    for label, r in rows:
        tl = r.get("timeline")
        if not tl:
            continue
        steps = tl["rows"] if which == "all" else [
            x for x in tl["rows"] if x["wait"] > 0.05 or x["out"] > 0 or x["in"] > 0]
        print(flush=True)
        for line in timeline_lines(steps, tl["summary"], tl["copies"], label):
            print(line, flush=True)
        bb = r.get("budget_bound")
        if bb and bb.get("ms"):
            print(f"  budget-aware copy bound (offload.budget_bound, these step times, "
                  f"{bb['memory'] / GiB:.2f} GiB): {bb['ms']:.1f} ms against "
                  f"{bb['compute_ms']:.1f} ms of compute (copy schedules only: a recompute "
                  f"may go under it)", flush=True)
        for line in r.get("floor_lines", ()):
            print("  " + line, flush=True)


def print_table(name, batch, rows, bw):
    print(f"\n{name} b{batch}: peak GiB measured (planned) and its change, ms/iter, slowdown "
          f"vs the same "
          f"framework without offload, GiB out/back per iteration, copy bound ms "
          f"(bound / measured)", flush=True)
    base, base_peak = {}, {}
    for label, r in rows:
        if "ms" in r and label.endswith(("NONE", "none")):
            base[label.split()[0]] = r["ms"]
            base_peak[label.split()[0]] = r["peak"]
    for label, r in rows:
        if "error" in r:
            print(f"  {label:42s} {r['error']}", flush=True)
            continue
        fw = label.split()[0]
        slow = r["ms"] / base[fw] - 1 if fw in base else float("nan")
        cut = 1 - r["peak"] / base_peak[fw] if fw in base_peak else float("nan")
        line = (f"  {label:42s} {r['peak'] / GiB:6.2f}"
                f"{' (%.2f)' % (r['planned'] / GiB) if 'planned' in r else '        '}"
                f" {-cut * 100:+6.1f}% peak"
                f" {r['ms']:9.1f} ms {slow * 100:+7.1f}%")
        if "moved" in r and fw in base and "d2h" in bw:
            bound = max(base[fw], r["moved"] / (bw["d2h"] * 1e9) * 1e3,
                        r["back"] / (bw["h2d"] * 1e9) * 1e3)
            line += (f"  {r['moved'] / GiB:6.2f}/{r['back'] / GiB:<6.2f} "
                     f"bound {bound:8.1f} ms ({bound / r['ms']:.2f})")
            if r.get("floor"):
                line += f"  floor {r['floor'] / GiB:.2f} GiB"
            if r.get("lanes") or r.get("kept"):
                line += f"  ({r.get('lanes', 0)} out on the 2nd stream, {r.get('kept', 0)} kept)"
            if r.get("recomputed"):
                line += (f"  ({r['recomputed']} recomputed, "
                         f"{r['recomputed_bytes'] / GiB:.2f} GiB"
                         + (f", {r['through']} through others" if r.get("through") else "")
                         + ")")
        bb = r.get("budget_bound")
        if bb and bb.get("ms"):
            line += (f"  budget bound {bb['ms']:.1f} ms ({bb['ms'] / r['ms']:.2f}) at "
                     f"{bb['memory'] / GiB:.2f} GiB")
        elif bb:
            line += f"  budget bound: none (floor over {bb['memory'] / GiB:.2f} GiB)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
