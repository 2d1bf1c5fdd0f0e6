"""``minicaffe plot LOG [LOG2 ...] [--out FILE] [--chart N]``: charts of training logs.

Caffe's counterpart: ``tools/extra/plot_training_log.py``, whose chart types ``--chart``
takes (one line per log, as Caffe draws several logs on one chart):

    0: Test accuracy vs. Iters      1: Test accuracy vs. Seconds
    2: Test loss vs. Iters          3: Test loss vs. Seconds
    4: Train learning rate vs. Iters  5: Train learning rate vs. Seconds
    6: Train loss vs. Iters         7: Train loss vs. Seconds

Without ``--chart`` it draws an overview of one log: the train outputs and the test
outputs against iterations.  Logs are Caffe's or minicaffe's (read by logparse.py, as
``tools/parse_log.py`` reads them); the learning rate is the one each "Iteration N, lr ="
line gives.  The image format follows ``--out``'s extension (png, svg or pdf; default
LOG.png).  matplotlib comes with the ``plot`` extra; without it the command says so in
one line.
"""
import os

from ..core.errors import MinicaffeError

CHARTS = {0: ("Test accuracy", "Iters"), 1: ("Test accuracy", "Seconds"),
          2: ("Test loss", "Iters"), 3: ("Test loss", "Seconds"),
          4: ("Train learning rate", "Iters"), 5: ("Train learning rate", "Seconds"),
          6: ("Train loss", "Iters"), 7: ("Train loss", "Seconds")}
FORMATS = ("png", "svg", "pdf")
INSTALL = 'pip install ".[plot]" (matplotlib)'


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise MinicaffeError(f"minicaffe plot needs matplotlib: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _column(rows, want):
    """The output column of ``rows`` for 'accuracy' or 'loss' (Caffe's names first)."""
    names = []
    for r in rows:
        names += [k for k in r if k not in ("NumIters", "Seconds", "LearningRate") and
                  k not in names]
    if want in names:
        return want
    return next((n for n in names if want[:3] in n.lower()), None)


def chart_series(path, chart):
    """(xs, ys) that chart ``chart`` draws for the log ``path``."""
    from .logparse import parse_log, read_log
    what, x = CHARTS[chart]
    train, test = parse_log(path)
    xkey = "NumIters" if x == "Iters" else "Seconds"
    if what == "Train learning rate":
        seconds = {int(r["NumIters"]): r["Seconds"] for r in train}
        pts = read_log(path).points("lr")
        if x == "Seconds":
            pts = [(seconds[i], v) for i, v in pts if i in seconds]
        return [p[0] for p in pts], [p[1] for p in pts]
    rows = test if what.startswith("Test") else train
    col = _column(rows, "accuracy" if what.endswith("accuracy") else "loss")
    if col is None:
        raise MinicaffeError(f"{path}: no {what.lower()} in this log (chart {chart})")
    rows = [r for r in rows if col in r]
    return [r[xkey] for r in rows], [r[col] for r in rows]


def plot_log(logs, out=None, chart=None):
    """Draw ``chart`` (0-7, or None for the overview) of ``logs`` into ``out``; returns
    the path written."""
    logs = [os.fspath(p) for p in ([logs] if isinstance(logs, (str, os.PathLike)) else logs)]
    if not logs:
        raise MinicaffeError("minicaffe plot: give a training log (minicaffe plot LOG)")
    for p in logs:
        if not os.path.isfile(p):
            raise MinicaffeError(f"{p}: no such log file")
    out = os.fspath(out) if out else logs[0] + ".png"
    ext = out.rsplit(".", 1)[-1].lower() if "." in os.path.basename(out) else ""
    if ext not in FORMATS:
        raise MinicaffeError(f"--out {out}: the image format comes from the extension "
                             f"({', '.join(FORMATS)})")
    if chart is not None and chart not in CHARTS:
        raise MinicaffeError(f"--chart {chart}: chart types are 0-7 "
                             f"({'; '.join(f'{k}: {a} vs. {b}' for k, (a, b) in CHARTS.items())})")
    plt = _matplotlib()
    if chart is None:
        fig = _overview(plt, logs[0])
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
        what, x = CHARTS[chart]
        for p in logs:
            xs, ys = chart_series(p, chart)
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=os.path.basename(p))
        ax.set_title(f"{what} vs. {x}")
        ax.set_xlabel(x)
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
        ax.legend()
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        plt.close(fig)
        raise MinicaffeError(f"--out {out}: no folder {d}")
    tmp = out + ".tmp." + ext
    try:
        fig.savefig(tmp, dpi=100, format=ext)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def _overview(plt, path):
    from .logparse import parse_log
    train, test = parse_log(path)
    if not train and not test:
        raise MinicaffeError(f"{path}: no train or test outputs in it (is it a training log?)")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, rows, title in ((axes[0], train, "train"), (axes[1], test, "test")):
        names = []
        for r in rows:
            names += [k for k in r if k not in ("NumIters", "Seconds", "LearningRate")
                      and k not in names]
        for n in names:
            xs = [r["NumIters"] for r in rows if n in r]
            ax.plot(xs, [r[n] for r in rows if n in r], marker="." if len(xs) < 50 else None,
                    label=n)
        ax.set_title(f"{title} outputs: {os.path.basename(path)}")
        ax.set_xlabel("iterations")
        ax.grid(True, alpha=0.3)
        if names:
            ax.legend()
    fig.tight_layout()
    return fig
