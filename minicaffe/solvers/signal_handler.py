"""SIGINT/SIGHUP/SIGTERM as action requests (Caffe's ``util/signal_handler.cpp``).

``with SignalHandler("stop", "snapshot") as h: solver.set_action_function(h.get_action)``:
a signal only sets a flag; the solver asks once per iteration (and once per test batch)
and then stops or snapshots.  SIGTERM (``docker stop``, Slurm preemption, ``timeout``)
always stops, as a Ctrl-C whose effect is ``stop`` does, so training ends with its final
snapshot (``snapshot_after_train``).  While a stop is pending or being carried out, a
second stop signal is said in one line and waits for the snapshot; a third one aborts
at once (KeyboardInterrupt).  A stop signal that arrives while the training thread
waits for data also ends that wait (``context.stop_requested``), so a stalled read
never makes the process deaf.
"""
import signal
import threading

from ..core import context, log
from ..core.errors import MinicaffeError
from .solver import SolverAction

EFFECTS = (SolverAction.STOP, SolverAction.SNAPSHOT, SolverAction.NONE)


def check_effect(value, flag):
    value = str(value).lower()
    if value not in EFFECTS:
        raise MinicaffeError(f"invalid signal effect \"{value}\" was specified for --{flag} "
                             f"(stop, snapshot or none)")
    return value


def _signals():
    return [s for s in ("SIGINT", "SIGHUP", "SIGTERM") if hasattr(signal, s)]


class SignalHandler:
    def __init__(self, sigint_effect=SolverAction.STOP, sighup_effect=SolverAction.SNAPSHOT):
        self.effects = {"SIGINT": check_effect(sigint_effect, "sigint_effect"),
                        "SIGHUP": check_effect(sighup_effect, "sighup_effect"),
                        "SIGTERM": SolverAction.STOP}
        self.pending = []        # names of the signals not yet acted on, in arrival order
        self.stop_signals = 0    # stop signals received so far
        self.stopped_by = None   # the name of the signal whose stop was acted on
        self._previous = {}

    @property
    def sigint_effect(self):
        return self.effects["SIGINT"]

    @property
    def sighup_effect(self):
        return self.effects["SIGHUP"]

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.effects[name] == SolverAction.STOP:
            self.stop_signals += 1
            if self.stop_signals == 3:
                raise KeyboardInterrupt
            if self.stop_signals == 2:
                log.warning("Caught %s again: stopping after the snapshot is written (a third "
                            "signal aborts without it)", name)
                return
        self.pending.append(name)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only
        for name in _signals():
            s = getattr(signal, name)
            self._previous[s] = signal.signal(s, self._handle)
        context.set_stop_check(self.stop_pending)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
        context.set_stop_check(None)
        return False

    def stop_pending(self):
        """Whether a signal asking to stop has arrived and not been acted on yet."""
        return any(self.effects[n] == SolverAction.STOP for n in self.pending)

    def get_action(self):
        """The action the first pending signal asks for (consumed), else ``none``."""
        if not self.pending:
            return SolverAction.NONE
        name = self.pending.pop(0)
        effect = self.effects[name]
        log.info("Caught %s: %s", name, effect)
        if effect == SolverAction.STOP and self.stopped_by is None:
            self.stopped_by = name
        return effect
