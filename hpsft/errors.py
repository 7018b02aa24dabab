"""How a run ends other than by finishing, as the entry points report it.

UserInputError: bad input a user can fix (data, paths, settings that do not fit together),
reported as one `hpsft: error:` line without a traceback, exit status 2. Any other
exception is a bug and keeps its traceback.

Preempted: a stop signal (hpsft/trainer/preemption.py) after which the run saved a
checkpoint; exit status PREEMPTED_EXIT_CODE.
"""

from pathlib import Path

# EX_TEMPFAIL of sysexits.h ("temporary failure, try again"): unlike 128+15, which a
# process killed by SIGTERM reports, it says the run saved its state and can be resumed.
PREEMPTED_EXIT_CODE = 75


class UserInputError(ValueError):
    pass


class Preempted(Exception):
    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"stopped by a signal (SIGTERM/SIGUSR1) after step {step}; checkpoint saved in "
                         f"{checkpoint}: run the same command again to resume")
