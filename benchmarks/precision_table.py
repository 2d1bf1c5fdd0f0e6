"""Issue 20's table: minicaffe's training step in fp32, TF32, bf16 and fp16 against
PyTorch's three ways, per net, each configuration in a fresh process, in one run.

    python3 benchmarks/precision_table.py --gpu 0 [--nets lenet,cifar10_quick,alexnet,vgg16,resnet50]
        [--configs mc-fp32,mc-tf32,mc-bf16,mc-fp16,torch-fp32,torch-defaults,torch-bf16]
        [--iterations 10] [--repeats 5] [--warmup 3] [--json FILE] [--timeout 300]

``--configs`` runs only the configurations named (all by default), the others' cells
printed as "-": a change to the reduced types re-measures their rows without the fp32
ones (VGG-16 and ResNet-50 take several minutes each in full).

Nets (the model's TRAIN net on synthetic inputs, SGD momentum 0.9, as ``minicaffe
bench``): LeNet b64, CIFAR-10 quick b100, AlexNet b128, VGG-16 b64, ResNet-50 b64.
Configurations, each a process of its own (nothing cached between them but CuPy's
compiled kernels on disk):

- minicaffe ``fp32`` (strict, the default), ``tf32`` (``--tf32``), ``bf16`` and ``fp16``
  (``--precision``): ``python3 -m minicaffe bench --gpu G --model M --batch B ... --json``;
  the figure is its median ms per iteration, the peak its allocator's high-water mark
  (plus the CUDA graphs' own pools);
- PyTorch ``fp32`` (TF32 off for cuDNN and matmul), ``defaults`` (PyTorch's own settings:
  TF32 for cuDNN convolutions, not for matmul) and ``bf16`` (``torch.autocast(bfloat16)``
  + channels_last), the same net through minicaffe/torch_twin.py from the same initial
  weights, timed by minicaffe/bench.bench_torch (eager, then the whole step captured as
  one CUDA graph, the peak ``torch.cuda.max_memory_allocated`` reset between the two);
  the net is built in CPU mode for its weights only.  The table shows the graph for fp32
  and defaults, eager / graph for bf16; the JSON holds every figure.  (PyTorch's bf16
  eager and graph are one process, as in ``minicaffe bench --compare torch``.)

cuDNN autotuning is on in PyTorch (``cudnn.benchmark``).  The table is printed once
every configuration has run; a configuration that fails or runs past ``--timeout``
seconds is a cell saying so (its last error line printed above the table) and the
command exits 1.  No GPU, PyTorch or CuPy: one error line, exit 2, nothing run.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (key, name in the table, model, batch)
NETS = [("lenet", "LeNet", "models/lenet/train_val.prototxt", 64),
        ("cifar10_quick", "CIFAR-10 quick", "models/cifar10_quick/train_val.prototxt", 100),
        ("alexnet", "AlexNet", "models/bvlc_alexnet/train_val.prototxt", 128),
        ("vgg16", "VGG-16", "models/vgg16/train_val.prototxt", 64),
        ("resnet50", "ResNet-50", "models/resnet50/train_val.prototxt", 64)]
MC = ["fp32", "tf32", "bf16", "fp16"]
TORCH = ["fp32", "defaults", "bf16"]
LABEL = {"mc": "minicaffe", "torch": "PyTorch"}
CONFIGS = [f"mc-{m}" for m in MC] + [f"torch-{m}" for m in TORCH]


class UserError(Exception):
    pass


def parse_nets(text):
    keys = [k for k in text.split(",") if k]
    known = {n[0]: n for n in NETS}
    for k in keys:
        if k not in known:
            raise UserError(f"--nets: unknown net '{k}' (one of {', '.join(known)})")
    if not keys:
        raise UserError("--nets: give at least one net")
    return [known[k] for k in keys]


def parse_configs(text):
    """{(kind, mode)} of ``--configs`` (names of CONFIGS, comma-separated)."""
    names = [c for c in text.split(",") if c]
    for c in names:
        if c not in CONFIGS:
            raise UserError(f"--configs: unknown configuration '{c}' (of {', '.join(CONFIGS)})")
    if not names:
        raise UserError("--configs: give at least one configuration")
    return {tuple(c.split("-", 1)) for c in names}


def mc_command(args, model, batch, mode, out_json):
    """The ``minicaffe bench`` command line of minicaffe configuration ``mode``."""
    cmd = [sys.executable, "-m", "minicaffe", "bench", "--gpu", str(args.gpu), "--model",
           model, "--batch", str(batch), "--iterations", str(args.iterations), "--repeats",
           str(args.repeats), "--warmup", str(args.warmup), "--json", out_json]
    if mode == "tf32":
        cmd.append("--tf32")
    elif mode in ("bf16", "fp16"):
        cmd += ["--precision", mode]
    return cmd


def torch_command(args, model, batch, mode, out_json):
    """This script's worker for PyTorch configuration ``mode``."""
    return [sys.executable, os.path.abspath(__file__), "--worker", mode, "--gpu",
            str(args.gpu), "--model", model, "--batch", str(batch), "--iterations",
            str(args.iterations), "--repeats", str(args.repeats), "--warmup",
            str(args.warmup), "--json", out_json]


def worker(args):
    """One PyTorch configuration in this process; its figures into ``--json``."""
    import numpy as np
    import torch
    from minicaffe.bench import bench_torch, machine_info, set_torch_precision
    from minicaffe.core import context
    from minicaffe.synthetic import synthetic_solver
    context.set_mode_cpu()       # the net for its layers and initial weights only
    solver, info = synthetic_solver(model=args.model, batch=args.batch)
    net, sp = solver.net, info["solver_param"]
    blobs = [[np.array(b.cpu_data(), copy=True) for b in layer.blobs] for layer in net.layers]
    if args.worker == "defaults":
        torch.backends.cudnn.benchmark = True     # TF32 left as PyTorch sets it
    else:
        set_torch_precision(torch, False, args.gpu)
    tf32 = {"cudnn": torch.backends.cudnn.allow_tf32,
            "matmul": torch.backends.cuda.matmul.allow_tf32}
    eager, graph, notes = bench_torch(net, blobs, sp, args.iterations, args.repeats,
                                      args.warmup, args.gpu, True,
                                      precision="bf16" if args.worker == "bf16" else None)
    machine, versions = machine_info(args.gpu, torch)
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "versions": versions, "tf32": tf32, "notes": notes,
                   "eager": eager.as_dict(), "graph": graph.as_dict()}, f, indent=1)
    return 0


def run_one(cmd, timeout):
    """(figures dict, None) or (None, why it failed)."""
    out_json = cmd[cmd.index("--json") + 1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOG_minloglevel=os.environ.get("GLOG_minloglevel", "2"))
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"ran past --timeout {timeout} s"
    if r.returncode != 0 or not os.path.isfile(out_json):
        lines = [l for l in (r.stderr or r.stdout or "").splitlines() if l.strip()]
        return None, f"exit {r.returncode}: {lines[-1] if lines else 'no output'}"
    with open(out_json) as f:
        return json.load(f), None


def figures(kind, mode, report):
    """{'ms': ..., 'peak_mib': ..., ['eager_ms', 'eager_peak_mib']} of one run's JSON."""
    mib = 1 << 20
    if kind == "mc":
        net = report["nets"][0]
        r = net["results"][0]
        graph = (net.get("gpu_step") or {}).get("cuda_graph")
        return {"ms": r["ms_per_iter"], "peak_mib": r["peak_bytes"] / mib,
                "cuda_graph": graph}
    return {"ms": report["graph"]["ms_per_iter"], "peak_mib": report["graph"]["peak_bytes"] / mib,
            "eager_ms": report["eager"]["ms_per_iter"],
            "eager_peak_mib": report["eager"]["peak_bytes"] / mib}


SKIPPED = "skipped"     # a configuration --configs left out (its cell: "-")


def _fmt(cell, key, spec):
    """A cell's figure; minicaffe's time marked "(eager)" where its step was not replayed
    as a CUDA graph (a capture that failed falls back to the eager step: say so)."""
    if cell is None:
        return "fail"
    if cell == SKIPPED:
        return "-"
    eager = key == "ms" and cell.get("cuda_graph") is False
    return format(cell[key], spec) + (" (eager)" if eager else "")


def _rows(rows, key, spec):
    """One markdown row per net: minicaffe's four cells, then PyTorch's fp32 and defaults
    graphs and its bf16 eager / graph, each ``cell[key]`` (``eager_`` + key for eager)."""
    out = []
    for name, batch, cells in rows:
        mc = [_fmt(cells.get(("mc", m)), key, spec) for m in MC]
        bf = cells.get(("torch", "bf16"))
        bf_cell = "fail" if bf is None else "-" if bf == SKIPPED else \
            f"{format(bf['eager_' + key], spec)} / {format(bf[key], spec)}"
        out.append(f"| {name} b{batch} | " + " | ".join(mc) + " | " +
                   f"{_fmt(cells.get(('torch', 'fp32')), key, spec)} | "
                   f"{_fmt(cells.get(('torch', 'defaults')), key, spec)} | {bf_cell} |")
    return out


def table(rows):
    """The two markdown tables (ms per iteration; peak MiB) of ``rows``: [(name, batch,
    {('mc'|'torch', mode): figures or None})]."""
    head = ("| net, batch | minicaffe fp32 | minicaffe TF32 | minicaffe bf16 | minicaffe fp16 "
            "| PyTorch fp32 graph | PyTorch defaults (TF32 convs) graph "
            "| PyTorch bf16 autocast + channels_last, eager / graph |")
    return (["ms per training iteration (median of the repeats):", "", head,
             "|" + "---|" * 8] + _rows(rows, "ms", ".2f") +
            ["", "peak device memory (MiB):", "",
             "| net, batch | minicaffe fp32 | minicaffe TF32 | minicaffe bf16 | minicaffe fp16 "
             "| PyTorch fp32 graph | PyTorch defaults graph | PyTorch bf16 eager / graph |",
             "|" + "---|" * 8] + _rows(rows, "peak_mib", ",.1f"))


def check_environment(gpu):
    try:
        import torch
    except Exception as e:
        raise UserError(f"needs PyTorch, which cannot be imported ({type(e).__name__}: {e})")
    if not torch.cuda.is_available() or gpu >= torch.cuda.device_count():
        raise UserError(f"--gpu {gpu}: no such CUDA GPU here (this table is a GPU benchmark)")
    try:
        import cupy  # noqa: F401
    except Exception as e:
        raise UserError(f"needs CuPy for minicaffe's GPU mode ({type(e).__name__}: {e})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--nets", default=",".join(n[0] for n in NETS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", choices=TORCH, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.worker:
        return worker(args)
    try:
        nets = parse_nets(args.nets)
        configs = parse_configs(args.configs)
        for name in ("iterations", "repeats", "timeout"):
            if getattr(args, name) < 1:
                raise UserError(f"--{name} must be at least 1")
        if args.warmup < 0:
            raise UserError("--warmup must not be negative")
        if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise UserError(f"{args.json}: no such folder for the JSON")
        check_environment(args.gpu)
    except UserError as e:
        print(f"precision_table: error: {e}", file=sys.stderr)
        return 2
    rows, report, failed, header = [], [], False, {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, name, model, batch in nets:
            cells = {}
            for kind, modes, make in (("mc", MC, mc_command), ("torch", TORCH, torch_command)):
                for mode in modes:
                    if (kind, mode) not in configs:
                        cells[(kind, mode)] = SKIPPED
                        continue
                    out_json = os.path.join(tmp, f"{key}_{kind}_{mode}.json")
                    got, why = run_one(make(args, model, batch, mode, out_json), args.timeout)
                    if got is None:
                        failed = True
                        cells[(kind, mode)] = None
                        print(f"{name} b{batch}: {LABEL[kind]} {mode}: failed ({why})",
                              flush=True)
                        continue
                    if kind not in header:
                        header[kind] = (got["machine"], got["versions"])
                    cells[(kind, mode)] = figures(kind, mode, got)
                    f = cells[(kind, mode)]
                    extra = (f", eager {f['eager_ms']:.2f} ms, peak {f['eager_peak_mib']:.1f} "
                             f"MiB" if "eager_ms" in f else "")
                    how = " (graph)" if kind == "torch" else \
                        " (eager: no CUDA graph)" if f.get("cuda_graph") is False else ""
                    print(f"{name} b{batch}: {LABEL[kind]} "
                          f"{mode}: {f['ms']:.2f} ms, peak {f['peak_mib']:.1f} MiB"
                          f"{how}{extra}", flush=True)
                    report.append({"net": name, "batch": batch, "engine": kind, "mode": mode,
                                   **f})
            rows.append((name, batch, cells))
    print()
    if "mc" in header:
        m, v = header["mc"]
        tv = header["torch"][1] if "torch" in header else {}
        print(f"GPU: {m['gpu']}; CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs, load "
              f"average at the first run {' '.join(map(str, m.get('load_average', [])))}); "
              f"python {v['python']}, cupy {v['cupy']}, torch {tv.get('torch', '-')} (cuDNN "
              f"{tv.get('torch_cudnn', '-')}); timing: {args.warmup} warm-up iterations, "
              f"median of {args.repeats} repeats of {args.iterations}; each configuration a "
              "fresh process")
    for line in table(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": report}, f, indent=1)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
