"""Preemption: SIGTERM or SIGUSR1 (Slurm's --signal, Kubernetes, spot reclaims) ends the
run after the current optimizer step with a checkpoint of that step, and the process
exits with hpsft.utils.errors.PREEMPTED_EXIT_CODE (75); re-running the same command resumes.

A signal may reach some ranks and not others, or reach them during different steps: after
every step the ranks take the maximum of their flags (one small all-reduce, stop_agreed),
so they all save the same step, or none does. That agreement splits the run in two:

- Before it, a second stop signal ends the process at once, as the signal's default action
  would: signalling again ends a run stuck in a step. The first signal gives both signals
  their default action back in the kernel, so the second one also kills a rank blocked in
  C++ (a collective's wait), where no Python handler runs. (A first signal that comes while
  the rank is blocked is only noted once the wait returns: Python's rule.)
- From the moment a rank learns of the agreement it ignores stop signals to its exit:
  through the engine's save, both barriers of the save, rank 0's commit and the exit with
  75. That is when launchers repeat the signal: torchrun and the deepspeed launcher SIGTERM
  the ranks still running as soon as the first one leaves, srun ends the step on a task's
  non-zero exit, Slurm's time limit may fall inside the save. No launcher repeats it
  earlier, as no rank leaves before every rank has entered the save's last barrier; so
  from the agreement on there is no window left. Until 2026-12-03 hpsft ignored signals
  only once save_checkpoint had returned, and a rank still waiting in a barrier when
  another one left died of the launcher's SIGTERM (-15, not 75: CI, eb0514b).
  What this gives up: a second signal no longer abandons a save. A save that hangs ends
  by SIGKILL, which every launcher sends after its grace period (torchrun's
  --shutdown_timeout, Slurm's KillWait, `ray job stop`), or at engine.collective_timeout_s;
  a rank that fails in the save fails the others' collectives as before. A save cut by
  SIGKILL stays a `.partial` folder, which no resume trusts (hpsft/trainer/checkpoint.py).

Signal handlers belong to the main thread (Python's rule). Under Ray the watched process
is the driver, whose main thread runs the loop and waits for the workers' save; the
workers are Ray's actors and their signals Ray's (a signalled worker is a lost worker).
"""

import signal

from hpsft.utils import distributed

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def set_stop_signals(handler) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


class PreemptionWatch:
    """While entered, notes the first stop signal instead of dying of it; from the ranks'
    agreement to stop on, ignores stop signals (also after the watch is left: the process
    is leaving with PREEMPTED_EXIT_CODE)."""

    def __init__(self):
        self.received = False
        self.previous = {}

    def __enter__(self) -> "PreemptionWatch":
        self.previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        set_stop_signals(self.note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def note(self, signum: int, frame) -> None:
        # Only a flag: the handler runs between two bytecodes of whatever the loop is doing.
        self.received = True
        set_stop_signals(signal.SIG_DFL)  # a second stop signal: the default action, at once

    def stop_agreed(self) -> bool:
        """Whether any rank got a stop signal. A collective: every rank calls it every step.
        When it says yes, this rank ignores stop signals from here to its exit."""
        agreed = distributed.all_reduce_max(int(self.received)) > 0
        if agreed:
            set_stop_signals(signal.SIG_IGN)
            self.previous = {sig: signal.SIG_IGN for sig in STOP_SIGNALS}
        return agreed
