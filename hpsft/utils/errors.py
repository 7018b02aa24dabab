"""How a run ends other than by finishing, as the entry points report it.

UserInputError: bad input a user can fix (data, paths, settings that do not fit together),
reported as one `hpsft: error:` line without a traceback, exit status 2. Any other
exception is a bug and keeps its traceback.

Preempted: a stop signal (hpsft/trainer/preemption.py) after which the run saved a
checkpoint; exit status PREEMPTED_EXIT_CODE.
"""

import functools
import sys
from pathlib import Path

# EX_TEMPFAIL of sysexits.h ("temporary failure, try again"): unlike 128+15, which a
# process killed by SIGTERM reports, it says the run saved its state and can be resumed.
PREEMPTED_EXIT_CODE = 75


class UserInputError(ValueError):
    pass


def report_user_error(err: UserInputError) -> int:
    """Print the one line a user error ends in; return its exit status."""
    print(f"hpsft: error: {err}", file=sys.stderr, flush=True)
    return 2


def exits_2_on_user_error(main):
    """For a tool's main(argv) -> int: a UserInputError (a ConfigError is one) ends it in one
    `hpsft: error:` line and exit status 2; anything else keeps its traceback."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except UserInputError as err:
            return report_user_error(err)

    return run


class Preempted(Exception):
    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"stopped by a signal (SIGTERM/SIGUSR1) after step {step}; checkpoint saved in "
                         f"{checkpoint}: run the same command again to resume")
