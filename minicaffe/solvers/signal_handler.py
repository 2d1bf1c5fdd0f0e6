"""SIGINT/SIGHUP as action requests (Caffe's ``util/signal_handler.cpp``).

``with SignalHandler("stop", "snapshot") as h: solver.set_action_function(h.get_action)``:
a signal only sets a flag; the solver asks once per iteration (and once per
test batch) and then stops or snapshots.  After a SIGINT whose effect is
``stop`` has been acted on, a second Ctrl-C interrupts at once.
"""
import signal
import threading

from .. import log
from ..errors import MinicaffeError
from .solver import SolverAction

EFFECTS = (SolverAction.STOP, SolverAction.SNAPSHOT, SolverAction.NONE)


def check_effect(value, flag):
    value = str(value).lower()
    if value not in EFFECTS:
        raise MinicaffeError(f"invalid signal effect \"{value}\" was specified for --{flag} "
                             f"(stop, snapshot or none)")
    return value


class SignalHandler:
    def __init__(self, sigint_effect=SolverAction.STOP, sighup_effect=SolverAction.SNAPSHOT):
        self.sigint_effect = check_effect(sigint_effect, "sigint_effect")
        self.sighup_effect = check_effect(sighup_effect, "sighup_effect")
        self.got_sigint = False
        self.got_sighup = False
        self._previous = {}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            self.got_sigint = True
        else:
            self.got_sighup = True

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only
        sigs = [signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
        for s in sigs:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
        return False

    def get_action(self):
        """The action one pending signal asks for (consumed), else ``none``."""
        if self.got_sigint:
            self.got_sigint = False
            log.info("Caught SIGINT: %s", self.sigint_effect)
            if self.sigint_effect == SolverAction.STOP and signal.SIGINT in self._previous:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            return self.sigint_effect
        if self.got_sighup:
            self.got_sighup = False
            log.info("Caught SIGHUP: %s", self.sighup_effect)
            return self.sighup_effect
        return SolverAction.NONE
