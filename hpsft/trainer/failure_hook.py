"""Test hook: one rank fails during a step, as a bug or a bad sequence would.

HPSFT_TEST_FAIL_RANK_AT_STEP=1:2 makes rank 1 raise during step 2 (SPMD path), while the
other ranks go into the step's collectives. Nothing but the tests sets it; they check that
the others end within seconds and that the failing rank's message is printed.
"""

import os

FAIL_RANK_AT_STEP_ENV = "HPSFT_TEST_FAIL_RANK_AT_STEP"


class InjectedFailure(RuntimeError):
    pass


def failing_step(rank: int) -> int | None:
    """The step at which this rank is to fail, or None."""
    value = os.environ.get(FAIL_RANK_AT_STEP_ENV)
    if not value:
        return None
    failing_rank, step = (int(part) for part in value.split(":"))
    return step if failing_rank == rank else None


def fail(rank: int, step: int) -> None:
    raise InjectedFailure(f"{FAIL_RANK_AT_STEP_ENV}: rank {rank} fails in step {step}")
