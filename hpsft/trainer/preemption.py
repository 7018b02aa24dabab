"""Preemption: SIGTERM or SIGUSR1 (Slurm's --signal, Kubernetes, spot reclaims) ends the
run after the current optimizer step with a checkpoint of that step, and the process
exits with hpsft.utils.errors.PREEMPTED_EXIT_CODE (75); re-running the same command resumes.

A signal may reach some ranks and not others, or reach them during different steps: after
every step the ranks take the maximum of their flags (one small all-reduce), so they all
save the same step, or none does. A second signal before the save is done ends the process
at once, as the signal's default action would; a save it interrupts stays a `.partial`
folder that no resume trusts. Once a rank's save is done it ignores further signals
(PreemptionWatch.saved): the launcher's SIGTERM to the ranks still alive, sent as soon as the
first rank leaves, must not turn their exit with 75 into death by signal.
"""

import os
import signal

from hpsft.utils import distributed

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    """While entered, notes the first stop signal instead of dying of it (main thread only,
    as Python's signal handlers are)."""

    def __init__(self):
        self.received = False
        self.previous = {}

    def __enter__(self) -> "PreemptionWatch":
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.signal(sig, self.note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def note(self, signum: int, frame) -> None:
        # Only a flag: the handler runs between two bytecodes of whatever the loop is doing.
        if self.received:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = True

    def saved(self) -> None:
        """The stop step's checkpoint is saved: ignore stop signals from now on, also after the
        watch is left (the process is leaving with PREEMPTED_EXIT_CODE)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        self.previous = {sig: signal.SIG_IGN for sig in STOP_SIGNALS}

    def stop_agreed(self) -> bool:
        """Whether any rank got a stop signal. A collective: every rank calls it every step."""
        return distributed.all_reduce_max(int(self.received)) > 0
