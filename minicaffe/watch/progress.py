"""The progress line of ``minicaffe train`` on a terminal.

No Caffe counterpart (Caffe prints its glog lines only).  ``ProgressLine(bar, solver)``
wraps the CLI's tqdm bar: besides the bar, iteration of max_iter, elapsed and time left,
it says the loss smoothed as Caffe's display line smooths it (``average_loss``), the
learning rate, images/s and the share of the iteration spent waiting for data
(``solver.data_wait_share``; "n/a" where the solver does not measure it).  The CLI
shows it only when stderr is a terminal; the log lines are unchanged either way, so
``parse_log.py`` reads the log of a run watched this way.
"""
import time

from .record import _images_per_iteration

BAR_FORMAT = "{l_bar}{bar}| it {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
NARROW_FORMAT = "{percentage:3.0f}% it {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def describe(solver, iter_per_s=None, images=None):
    """'loss 0.2139, lr 0.00993, 1234 img/s, data wait 3%' for the solver's state now."""
    parts = []
    if solver.losses:   # the smoothed loss exists once an iteration has run
        parts.append(f"loss {float(solver.smoothed_loss):.4g}")
    parts.append(f"lr {solver.lr:.3g}")
    if iter_per_s:
        parts.append(f"{_si(iter_per_s * images)} img/s" if images else
                     f"{iter_per_s:.3g} it/s")
    wait = getattr(solver, "data_wait_share", None)
    parts.append("data wait n/a" if wait is None else f"data wait {100 * float(wait):.0f}%")
    return ", ".join(parts)


def _si(x):
    return f"{x / 1000:.1f}k" if x >= 10000 else f"{x:.0f}"


class ProgressLine:
    """A tqdm bar that also tells the loss, lr, images/s and data wait (``update(n)``)."""

    def __init__(self, bar, solver, every_s=0.1):
        self.bar = bar
        self.solver = solver
        self.every_s = every_s
        self._images = _images_per_iteration(solver)
        self._last = (time.monotonic(), bar.n)
        wide = (getattr(bar, "ncols", None) or 80) >= 110   # room for the bar itself
        bar.bar_format = BAR_FORMAT if wide else NARROW_FORMAT
        bar.set_postfix_str(describe(solver), refresh=False)

    def update(self, n=1):
        now = time.monotonic()
        then, done = self._last
        if now - then >= self.every_s:   # the rate since the last refresh, as tqdm's bar
            rate = (self.bar.n + n - done) / (now - then)
            self._last = (now, self.bar.n + n)
            self.bar.set_postfix_str(describe(self.solver, rate, self._images), refresh=False)
        self.bar.update(n)

    def close(self):
        self.bar.close()

    def write(self, *args, **kw):
        return self.bar.write(*args, **kw)
