"""Multi-GPU scaling of `minicaffe train`: images/s on 1, 2 and 4 GPUs, thread and process
modes, for AlexNet (models/bvlc_alexnet, 128 images per GPU) and CIFAR-10 quick (100 per
GPU), both on synthetic data (DummyData, constant) so that no dataset is needed.

    python benchmarks/multi_gpu_scaling.py [--nets alexnet,cifar10_quick] [--gpus 1,2,4]
        [--modes thread,process] [--iters 100] [--warmup 30] [--out DIR]

Weak scaling: the prototxt's batch is the per-GPU batch times the GPU count, and
`minicaffe train` divides it among the GPUs again.  Every configuration is one
`minicaffe train` run in a subprocess (its log is kept in --out); 1 GPU is the plain
single-GPU path (`--gpu 0`).

- images/s: the root's display rate (Caffe's "Iteration N (x iter/s, ...)" lines, one every
  10 iterations; the median of those after --warmup iterations) times the global batch;
- scaling: images/s over the 1-GPU images/s of the same net;
- all-reduce ms: the P2PManager's "all-reduce not hidden under backward" (per iteration,
  mean over ranks: the time from the end of backward to the end of the last bucket's
  all-reduce, measured with CUDA events).

Configurations with more GPUs than the machine has are skipped.  Prints a Markdown table.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NETS = {  # name: (train_val prototxt, per-GPU batch, C, H, W)
    "alexnet": ("models/bvlc_alexnet/train_val.prototxt", 128, 3, 227, 227),
    "cifar10_quick": ("examples/cifar10/cifar10_quick_train_test.prototxt", 100, 3, 32, 32),
}
SOLVER = """net: "{net}"
base_lr: 0.001 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed"
max_iter: {iters} display: 10 snapshot: 0 snapshot_after_train: false
random_seed: 1701 solver_mode: GPU
"""
RATE = re.compile(r"Iteration (\d+) \(([0-9.e+-]+) iter/s")
EXPOSED = re.compile(r"all-reduce not hidden under backward: ([0-9.]+) ms")


def synthetic_net(src, dst, batch, c, h, w):
    """``src`` with its Data layers replaced by DummyData of ``batch`` x c x h x w and labels
    (zeros), TRAIN phase only.  The data filler is constant, so DummyData fills it once at
    setup (a gaussian one is drawn on the host every forward, which would dominate a small
    net's iteration and measure the host rather than the GPUs)."""
    from google.protobuf import text_format
    from minicaffe.network.net import read_net_param
    from minicaffe.proto import caffe_pb2
    p = read_net_param(src)
    keep = []
    for layer in p.layer:
        if any(r.phase == caffe_pb2.TEST for r in layer.include):
            continue
        if layer.type in ("Data", "ImageData", "HDF5Data", "MemoryData"):
            tops = list(layer.top)
            for f in ("data_param", "image_data_param", "hdf5_data_param",
                      "memory_data_param", "transform_param"):
                layer.ClearField(f)
            layer.ClearField("include")
            layer.type = "DummyData"
            d = layer.dummy_data_param
            d.shape.add().dim.extend([batch, c, h, w])
            d.data_filler.add(type="constant", value=0.5)
            if len(tops) > 1:
                d.shape.add().dim.append(batch)
                d.data_filler.add(type="constant", value=0)
        if layer.type == "Accuracy":
            continue
        keep.append(layer)
    del p.layer[:]
    p.layer.extend(keep)
    with open(dst, "w") as f:
        f.write(text_format.MessageToString(p))


def run(name, n, mode, args):
    src, per_gpu, c, h, w = NETS[name]
    tag = f"{name}_{n}gpu_{mode}"
    net = os.path.join(args.out, tag + ".prototxt")
    synthetic_net(os.path.join(ROOT, src), net, per_gpu * n, c, h, w)
    solver = os.path.join(args.out, tag + "_solver.prototxt")
    with open(solver, "w") as f:
        f.write(SOLVER.format(net=net, iters=args.iters))
    log_file = os.path.join(args.out, tag + ".log")
    cmd = [sys.executable, "-m", "minicaffe", "train", "--solver", solver,
           "--gpu", ",".join(str(g) for g in range(n)), "--log", log_file]
    if n > 1:
        cmd += ["--parallel", mode]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        stderr, code = r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:     # a row says so; the table goes on
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        code = f"timed out after {args.timeout} s"
    wall = time.time() - t0
    with open(log_file + ".stderr", "w") as f:
        f.write(stderr)
    if code:
        tail = stderr.strip().splitlines()[-1:] or ["?"]
        return {"error": f"{code}: {tail[0]}" if isinstance(code, str) else tail[0],
                "wall": wall}
    text = open(log_file).read() + stderr
    rates = [float(v) for it, v in RATE.findall(text) if int(it) > args.warmup]
    exposed = EXPOSED.findall(text)
    if not rates:
        return {"error": "no display lines after the warm-up", "wall": wall}
    return {"images_s": statistics.median(rates) * per_gpu * n,
            "exposed_ms": float(exposed[-1]) if exposed else None, "wall": wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="alexnet,cifar10_quick")
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--modes", default="thread,process")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default="multi_gpu_scaling_out")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from minicaffe.core import backend
    have = backend.gpu_count()
    name = "?"
    if have:
        props = backend.cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"# multi-GPU scaling: {have} x {name}, {args.iters} iterations "
          f"(rates after iteration {args.warmup})\n")
    print("| net | GPUs | mode | batch/GPU | images/s | scaling | all-reduce not hidden (ms/iter) |")
    print("|---|---|---|---|---|---|---|")
    for net in args.nets.split(","):
        base = None
        for n in [int(g) for g in args.gpus.split(",")]:
            if n > have:
                print(f"| {net} | {n} | - | {NETS[net][1]} | skipped: {have} GPU(s) here | | |")
                continue
            for mode in (["single"] if n == 1 else args.modes.split(",")):
                res = run(net, n, mode, args)
                if "error" in res:
                    print(f"| {net} | {n} | {mode} | {NETS[net][1]} | error: {res['error']} | | |")
                    continue
                if n == 1:
                    base = res["images_s"]
                scaling = f"{res['images_s'] / base:.2f}x" if base else "-"
                exp = f"{res['exposed_ms']:.3f}" if res["exposed_ms"] is not None else "-"
                print(f"| {net} | {n} | {mode} | {NETS[net][1]} | {res['images_s']:.0f} | "
                      f"{scaling} | {exp} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
