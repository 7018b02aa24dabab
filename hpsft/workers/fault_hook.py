"""A test hook that makes a rank fail inside a worker call, as a real fault would.

HPSFT_TEST_WORKER_FAULT=<kind>:<rank>:<when>[:<once file>][,<more faults>] acts in rank
<rank> at <when>: an optimizer step number (at the start of train_batch for that step) or
`load_checkpoint`. `raise` raises RuntimeError, `hang` sleeps for good, `exit` ends the
process at once (os._exit, like a kill). With a once file a fault acts only if that file
does not exist yet, and creates it: a restarted group then runs normally.
Nothing but the tests sets it.
"""

import os
import time

from hpsft.utils import distributed

WORKER_FAULT_ENV = "HPSFT_TEST_WORKER_FAULT"


def maybe_fail(when) -> None:
    for spec in filter(None, os.environ.get(WORKER_FAULT_ENV, "").split(",")):
        kind, rank, at, *once = spec.split(":", 3)
        if int(rank) != distributed.rank() or at != str(when):
            continue
        if once:
            try:
                open(once[0], "x").close()
            except FileExistsError:
                continue
        if kind == "raise":
            raise RuntimeError(f"{WORKER_FAULT_ENV}: rank {rank} fails at {'step ' if at.isdigit() else ''}{at}")
        if kind == "hang":
            while True:
                time.sleep(60)
        if kind == "exit":
            os._exit(1)
        raise ValueError(f"{WORKER_FAULT_ENV}={spec!r}: the kind is raise, hang or exit")
