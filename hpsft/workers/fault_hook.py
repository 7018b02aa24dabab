"""A test hook that makes one rank fail inside train_batch, as a real fault would.

HPSFT_TEST_WORKER_FAULT=<kind>:<rank>:<step>[:<once file>] acts in rank <rank> when it
starts optimizer step <step>: `raise` raises RuntimeError, `hang` sleeps for good, `exit`
ends the process at once (os._exit, like a kill). With a once file it acts only if that
file does not exist yet, and creates it: a restarted group then runs the step normally.
Nothing but the tests sets it.
"""

import os
import time

from hpsft import distributed

WORKER_FAULT_ENV = "HPSFT_TEST_WORKER_FAULT"


def maybe_fail(step: int) -> None:
    spec = os.environ.get(WORKER_FAULT_ENV)
    if not spec:
        return
    kind, rank, at_step, *once = spec.split(":", 3)
    if int(rank) != distributed.rank() or int(at_step) != step:
        return
    if once:
        try:
            open(once[0], "x").close()
        except FileExistsError:
            return
    if kind == "raise":
        raise RuntimeError(f"{WORKER_FAULT_ENV}: rank {rank} fails at step {step}")
    if kind == "hang":
        while True:
            time.sleep(60)
    if kind == "exit":
        os._exit(1)
    raise ValueError(f"{WORKER_FAULT_ENV}={spec!r}: the kind is raise, hang or exit")
