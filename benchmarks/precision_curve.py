"""Does a reduced-precision run track its fp32 loss curve? (issue 20's accuracy target)

    python3 benchmarks/precision_curve.py [--iterations 400] [--batch 64] [--every 25]
        [--data mnist|synthetic] [--mnist DIR] [--window 20] [--plot FILE.png]

A small ResNet-style net (``resnet_prototxt``: a 3x3 stem, residual blocks of
Convolution -> BatchNorm+Scale -> ReLU -> Convolution -> BatchNorm+Scale, a 1x1 projection
where a block halves the map, Eltwise SUM, ReLU; global average pooling, InnerProduct,
SoftmaxWithLoss) is trained on the CPU with SGD momentum from the same seed, on the same
images in the same order (a MemoryData layer fed one fixed permutation of the first MNIST
training images scaled by 1/256, or a synthetic set: ten fixed random patterns plus noise),
once per precision: fp32, bf16 and fp16 (fp16 with its dynamic loss scaling).  Reduced
storage is emulated on the CPU by rounding (docs/precision.md): the three runs differ only
in the rounding of feature maps and their gradients.

Prints the loss every ``--every`` iterations per precision, then, per reduced precision,
the largest relative gap of its smoothed curve (moving average of ``--window``
iterations, Caffe's ``average_loss``) to fp32's, ``max |s_p - s_fp32| / s_fp32``, over the
iterations where the window is full, and the fp16 run's loss scale and skipped steps; then
the same gap for fp32 trained again from other initial weights (seed 1702, same batches):
the spread of two fp32 runs, against which the reduced precisions' gaps are to be read.
Each gap is given over the whole run and over its second half (where the early, steep
part of the curve, in which other initial weights differ most, is over).
``--plot FILE`` draws the three raw and smoothed curves (matplotlib, the optional ``plot``
extra; without it, one line saying so and no file).  ``run_curves`` is the function the
test calls on a tiny input.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRECISIONS = ("fp32", "bf16", "fp16")
SEED = 1701


def resnet_prototxt(batch, size, channels=(16, 32), blocks=2, classes=10):
    """A ResNet-style TRAIN net on a MemoryData input of (batch, 1, size, size): a stem,
    then per entry of ``channels`` ``blocks`` basic residual blocks (the first of every
    stage after the first halves the map through a strided 3x3 and a 1x1 projection)."""
    out = [f'name: "resnet_curve"\n'
           f'layer {{ name: "data" type: "MemoryData" top: "data" top: "label"\n'
           f'  memory_data_param {{ batch_size: {batch} channels: 1 height: {size} '
           f'width: {size} }} }}']

    def conv(name, bottom, n, k, stride=1):
        out.append(f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" '
                   f'top: "{name}"\n  convolution_param {{ num_output: {n} kernel_size: {k} '
                   f'pad: {k // 2} stride: {stride} bias_term: false '
                   f'weight_filler {{ type: "msra" }} }} }}')

    def bn(name):       # BatchNorm + Scale in place, Caffe's ResNet pair
        out.append(f'layer {{ name: "{name}_bn" type: "BatchNorm" bottom: "{name}" '
                   f'top: "{name}" }}')
        out.append(f'layer {{ name: "{name}_scale" type: "Scale" bottom: "{name}" '
                   f'top: "{name}" scale_param {{ bias_term: true }} }}')

    def relu(name):
        out.append(f'layer {{ name: "{name}_relu" type: "ReLU" bottom: "{name}" '
                   f'top: "{name}" }}')

    conv("stem", "data", channels[0], 3)
    bn("stem")
    relu("stem")
    x, width = "stem", channels[0]
    for s, n in enumerate(channels):
        for b in range(blocks):
            name = f"s{s}b{b}"
            stride = 2 if (s > 0 and b == 0) else 1
            conv(name + "a", x, n, 3, stride)
            bn(name + "a")
            relu(name + "a")
            conv(name + "b", name + "a", n, 3)
            bn(name + "b")
            short = x
            if stride != 1 or n != width:
                conv(name + "p", x, n, 1, stride)
                bn(name + "p")
                short = name + "p"
            out.append(f'layer {{ name: "{name}" type: "Eltwise" bottom: "{name}b" '
                       f'bottom: "{short}" top: "{name}" eltwise_param {{ operation: SUM }} }}')
            relu(name)
            x, width = name, n
    out.append(f'layer {{ name: "pool" type: "Pooling" bottom: "{x}" top: "pool"\n'
               f'  pooling_param {{ pool: AVE global_pooling: true }} }}')
    out.append(f'layer {{ name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"\n'
               f'  inner_product_param {{ num_output: {classes} '
               f'weight_filler {{ type: "msra" }} bias_filler {{ type: "constant" }} }} }}')
    out.append('layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" '
               'top: "loss" }')
    return "\n".join(out) + "\n"


def mnist_images(root, count, seed=SEED):
    """``count`` MNIST training images (float32 (n, 1, 28, 28) scaled by 1/256) and labels,
    one fixed permutation of the first ``count`` images."""
    from minicaffe.data.datasets import load_mnist
    m = load_mnist(root)
    if count > len(m["train_images"]):
        raise ValueError(f"{root}: {count} images asked, {len(m['train_images'])} there")
    order = np.random.RandomState(seed).permutation(count)
    x = m["train_images"][:count][order].astype(np.float32)[:, None] * np.float32(1 / 256)
    return x, m["train_labels"][:count][order].astype(np.float32)


def synthetic_images(count, size, seed=SEED, classes=10):
    """``count`` images of ``size`` x ``size``: one of ``classes`` fixed random patterns
    (values in [0, 1)) plus gaussian noise (std 0.3), labels in order 0, 1, ...,
    shuffled once with ``seed``."""
    rng = np.random.RandomState(seed)
    patterns = rng.rand(classes, 1, size, size).astype(np.float32)
    labels = rng.permutation(np.arange(count) % classes)
    x = patterns[labels] + np.float32(0.3) * rng.randn(count, 1, size, size).astype(np.float32)
    return x.astype(np.float32), labels.astype(np.float32)


def train_curve(precision, images, labels, iterations, batch, size, channels=(16, 32),
                blocks=2, base_lr=0.05, seed=SEED):
    """The per-iteration training losses of one run in ``precision`` (list of floats),
    and its solver (for the loss scaler's state).  The same ``seed`` gives every
    precision the same initial weights; the MemoryData layer the same batches."""
    from minicaffe.core import context
    from minicaffe.core.config import RunConfig
    from minicaffe.core.protoio import parse_text
    from minicaffe.proto import caffe_pb2
    from minicaffe.solvers import SGDSolver
    context.set_mode_cpu()
    context.set_random_seed(seed)
    net = resnet_prototxt(batch, size, channels, blocks)
    sp = parse_text(f"net_param {{ {net} }}\nbase_lr: {base_lr} momentum: 0.9 "
                    f"weight_decay: 0.0005 lr_policy: \"fixed\" max_iter: {iterations}\n"
                    f"display: 0 snapshot_after_train: false random_seed: {seed} "
                    f"solver_mode: CPU average_loss: 1\n", caffe_pb2.SolverParameter())
    solver = SGDSolver(sp, config=RunConfig(precision=precision))
    solver.net.layer_dict["data"].reset(images, labels)
    losses = []
    for _ in range(iterations):
        solver.step(1)
        losses.append(float(solver.smoothed_loss))
    return losses, solver


def smooth(losses, window):
    """Caffe's ``average_loss``: the mean of the last ``window`` losses (fewer at the
    start)."""
    c = np.cumsum(np.asarray(losses, dtype=np.float64))
    out = np.empty(len(c))
    for i in range(len(c)):
        lo = i - window
        out[i] = (c[i] - (c[lo] if lo >= 0 else 0.0)) / min(i + 1, window)
    return out


def run_curves(images, labels, iterations, batch, size, precisions=PRECISIONS, **kw):
    """{precision: (losses, loss scaler or None)} for each precision, on the same data."""
    res = {}
    for p in precisions:
        losses, solver = train_curve(p, images, labels, iterations, batch, size, **kw)
        res[p] = (losses, solver.loss_scaler)
        solver.close()
    return res


def max_gap(curve, ref, window, start=0):
    """The largest relative gap of the smoothed curves where the window is full, from
    iteration ``start`` on; (gap, the iteration where it is)."""
    s, r = smooth(curve, window), smooth(ref, window)
    start = min(max(window - 1, start), len(s) - 1)
    gap = np.abs(s[start:] - r[start:]) / np.abs(r[start:])
    i = int(np.argmax(gap))
    return float(gap[i]), start + i


def plot(path, curves, window, other, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    colors = {"fp32": "black", "bf16": "tab:blue", "fp16": "tab:orange"}
    for p, losses in curves.items():
        it = np.arange(len(losses))
        ax.plot(it, losses, color=colors.get(p), alpha=0.18, linewidth=0.8)
        ax.plot(it, smooth(losses, window), color=colors.get(p), linewidth=1.6,
                label=f"{p} (mean of {window})")
    ax.plot(np.arange(len(other)), smooth(other, window), color="gray", linestyle="--",
            linewidth=1.0, label=f"fp32, seed {SEED + 1} (mean of {window})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--data", choices=("mnist", "synthetic"), default="mnist")
    ap.add_argument("--mnist", default=None,
                    help="MNIST directory (default: data/mnist, else ../shared/data/mnist)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--plot", default=None, metavar="FILE")
    a = ap.parse_args(argv)
    if a.iterations < 1 or a.batch < 1 or a.every < 1 or a.window < 1:
        ap.error("--iterations, --batch, --every and --window must be positive")
    if a.plot and not os.path.isdir(os.path.dirname(os.path.abspath(a.plot))):
        ap.error(f"--plot {a.plot}: its directory does not exist")
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot: matplotlib is not installed (pip install 'minicaffe[plot]'); "
                  "no figure drawn", file=sys.stderr)
            a.plot = None
    count = a.iterations * a.batch
    if a.data == "mnist":
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        roots = [a.mnist] if a.mnist else [os.path.join(repo, "data", "mnist"),
                                             os.path.join(repo, "..", "shared", "data", "mnist")]
        from minicaffe.data.datasets import find_mnist_files
        root = next((r for r in roots if find_mnist_files(r)), None)
        if root is None:
            sys.exit(f"precision_curve: MNIST not found in {', '.join(roots)} "
                     f"(python -m minicaffe.tools.fetch_data mnist data/mnist, or --data "
                     f"synthetic)")
        count = min(count, 60000 // a.batch * a.batch)
        images, labels = mnist_images(root, count)
        size = 28
        what = f"MNIST ({count} training images from {root}, one fixed order)"
    else:
        size = 28
        images, labels = synthetic_images(count, size)
        what = f"synthetic ({count} images, 10 noisy patterns)"
    print(f"ResNet-style net (stem 16, 2 stages x 2 basic blocks, 16/32 channels), batch "
          f"{a.batch}, SGD lr {a.lr} momentum 0.9, seed {SEED}, CPU; data: {what}")
    curves, scalers = {}, {}
    for p in PRECISIONS:
        t0 = time.perf_counter()
        losses, solver = train_curve(p, images, labels, a.iterations, a.batch, size,
                                     base_lr=a.lr)
        curves[p], scalers[p] = losses, solver.loss_scaler
        solver.close()
        print(f"{p}: {a.iterations} iterations in {time.perf_counter() - t0:.1f} s",
              flush=True)
    # the noise floor: fp32 again from other initial weights (seed + 1), same batches
    t0 = time.perf_counter()
    other, solver = train_curve("fp32", images, labels, a.iterations, a.batch, size,
                                base_lr=a.lr, seed=SEED + 1)
    solver.close()
    print(f"fp32, seed {SEED + 1}: {a.iterations} iterations in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    shown = sorted(set(range(0, a.iterations, a.every)) | {a.iterations - 1})
    print("\nloss at iteration | " + " | ".join(PRECISIONS) +
          f" | smoothed ({a.window}): " + " | ".join(PRECISIONS))
    sm = {p: smooth(c, a.window) for p, c in curves.items()}
    for i in shown:
        print(f"{i:5d} | " + " | ".join(f"{curves[p][i]:.4f}" for p in PRECISIONS) + " | " +
              " | ".join(f"{sm[p][i]:.4f}" for p in PRECISIONS))
    print()
    half = a.iterations // 2
    print(f"max relative gap of the smoothed curve to fp32's (seed {SEED}), over the whole "
          f"run / over iterations {half}-{a.iterations - 1}; final smoothed loss")
    rows = [(p, curves[p]) for p in PRECISIONS[1:]] + \
        [(f"fp32 seed {SEED + 1} (other initial weights: the noise floor)", other)]
    for name, c in rows:
        g, at = max_gap(c, curves["fp32"], a.window)
        g2, at2 = max_gap(c, curves["fp32"], a.window, start=half)
        print(f"{name}: {g:.4f} (iteration {at}) / {g2:.4f} (iteration {at2}); "
              f"{smooth(c, a.window)[-1]:.4f} against {sm['fp32'][-1]:.4f}")
    sc = scalers["fp16"]
    if sc is not None:
        print(f"fp16: {sc.describe()}")
    if a.plot:
        plot(a.plot, curves, a.window, other,
             f"ResNet-style net on {a.data}, batch {a.batch}, CPU (rounded storage)")
        print(f"figure: {a.plot}")


if __name__ == "__main__":
    main()
