"""``minicaffe dashboard`` and ``minicaffe plot`` (subcommands of the CLI), and the
dashboard of ``minicaffe train --dashboard``.

    minicaffe dashboard RUN [--port [HOST:]PORT] [--token T]
    minicaffe plot LOG [LOG2 ...] [--out FILE] [--chart 0-7]

``dashboard`` serves the page of a finished (or still running) run from its training
log (Caffe's or minicaffe's glog text) or its TensorBoard event file/folder until
Ctrl-C; ``plot`` draws Caffe's plot_training_log.py charts (plot.py).
"""
import argparse
import sys
import time

from ..core.errors import MinicaffeError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 1 (the CLI's rule)
        raise MinicaffeError(f"{self.prog}: {message}")


def dashboard_main(argv):
    from .server import announce, parse_address, serve
    ap = _Parser(prog="minicaffe dashboard",
                 description="Serve the dashboard page of a run from its training log "
                             "(Caffe's or minicaffe's) or its TensorBoard event file.")
    ap.add_argument("run", help="a training log, or a TensorBoard event file or folder")
    ap.add_argument("--port", default="8080",
                    help="[HOST:]PORT to listen on (default 8080 on 127.0.0.1; 0 picks a "
                         "free port; a non-local HOST needs the printed token)")
    ap.add_argument("--token", default=None, help="the token to require (default: generated "
                    "when the host is not local)")
    args = ap.parse_args(argv)
    host, port = parse_address(args.port, "--port")
    d = serve(args.run, port=port, host=host, token=args.token)
    announce(d, sys.stdout)
    print("Serving until Ctrl-C (read-only).", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        d.close()
    return 0


def plot_main(argv):
    from .plot import CHARTS, plot_log
    ap = _Parser(prog="minicaffe plot",
                 description="Chart a Caffe or minicaffe training log (Caffe's "
                             "plot_training_log.py chart types).",
                 epilog="chart types: " + "; ".join(f"{k}: {a} vs. {b}"
                                                    for k, (a, b) in CHARTS.items()))
    ap.add_argument("logs", nargs="+", metavar="LOG")
    ap.add_argument("--out", default=None, help="image file, .png, .svg or .pdf "
                    "(default: LOG.png)")
    ap.add_argument("--chart", type=int, default=None,
                    help="Caffe's chart type 0-7 (default: train and test outputs)")
    args = ap.parse_args(argv)
    print(plot_log(args.logs, args.out, args.chart))
    return 0


def start_train_dashboard(address, solver, devices=None, stream=None):
    """The dashboard of ``minicaffe train --dashboard [HOST:]PORT``: served from a daemon
    thread; its URL printed once on the terminal (the log names it without the token)."""
    from ..core import log
    from .server import announce, parse_address, serve
    host, port = parse_address(address)
    d = serve(solver, port=port, host=host, devices=devices)
    announce(d, stream)
    log.info("Dashboard at http://%s:%d/%s", host, d.port,
             " (its token was printed on the terminal)" if d.token else "")
    return d


def keep_serving(dashboard, stream):
    """After training, an interactive run keeps its page up until Ctrl-C."""
    from ..core import log
    if dashboard is None or not (sys.stdin.isatty() and stream.isatty()):
        return
    log.info("Training ended; the dashboard stays up at %s until Ctrl-C",
             dashboard.url.split("?")[0])
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
