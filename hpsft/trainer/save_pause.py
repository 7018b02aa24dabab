"""Test hook: a rank pauses at a named point of a checkpoint save, so that a test can signal
the other ranks while they wait for it in the save's barrier, or while the launcher signals
them (tests/test_fault_tolerance.py).

HPSFT_TEST_PAUSE_IN_SAVE=<rank>:<point>:<folder>. Points, in SFTTrainer.save_checkpoint's
order: `written` (this rank's files written, before the first barrier), `committed` (after
the first barrier; rank 0 has committed and pruned), `saved` (after the last barrier). At
<point> every rank writes its pid to <folder>/<point>.<rank>; rank <rank> then waits until
<folder>/<point>.go exists. Nothing but the tests sets it.
"""

import os
import time
from pathlib import Path

PAUSE_IN_SAVE_ENV = "HPSFT_TEST_PAUSE_IN_SAVE"


def pause_in_save(point: str, rank: int) -> None:
    value = os.environ.get(PAUSE_IN_SAVE_ENV)
    if not value:
        return
    paused_rank, paused_point, folder = value.split(":", 2)
    if point != paused_point:
        return
    written = Path(folder) / f"{point}.{rank}.tmp"
    written.write_text(str(os.getpid()))
    written.replace(Path(folder) / f"{point}.{rank}")  # whole, for a test polling the folder
    go = Path(folder) / f"{point}.go"
    while int(paused_rank) == rank and not go.exists():
        time.sleep(0.05)
