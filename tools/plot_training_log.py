#!/usr/bin/env python3
"""Plot a Caffe or minicaffe training log: train outputs (loss) and test outputs
(accuracy, loss) against iterations or seconds.

    python tools/plot_training_log.py LOGFILE [OUT.png] [--x iters|seconds]

Needs matplotlib (pip install matplotlib, or pip install ".[plot]" in the minicaffe checkout); without it the script
says so in one line and exits 1.  The log is read by tools/parse_log.py.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parse_log import parse_log  # noqa: E402


def _series(rows, xkey):
    names = []
    for r in rows:
        names += [k for k in r if k not in ("NumIters", "Seconds", "LearningRate")
                  and k not in names]
    return {n: ([r[xkey] for r in rows if n in r], [r[n] for r in rows if n in r]) for n in names}


def plot(logfile, out, x="iters"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train, test = parse_log(logfile)
    if not train and not test:
        raise ValueError(f"{logfile}: no train or test outputs found (is it a training log?)")
    xkey = "NumIters" if x == "iters" else "Seconds"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, rows, title in ((axes[0], train, "train"), (axes[1], test, "test")):
        for name, (xs, ys) in _series(rows, xkey).items():
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=name)
        ax.set_title(f"{title} outputs: {os.path.basename(logfile)}")
        ax.set_xlabel("iterations" if x == "iters" else "seconds")
        ax.grid(True, alpha=0.3)
        if rows:
            ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Plot loss/accuracy from a training log.")
    ap.add_argument("logfile")
    ap.add_argument("out", nargs="?", help="image file (default: LOGFILE.png)")
    ap.add_argument("--x", choices=("iters", "seconds"), default="iters")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_training_log.py: error: matplotlib is not installed "
              "(pip install matplotlib, or pip install \".[plot]\")", file=sys.stderr)
        return 1
    try:
        out = plot(args.logfile, args.out or args.logfile + ".png", args.x)
    except (OSError, ValueError) as e:
        print(f"plot_training_log.py: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
