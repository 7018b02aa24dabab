"""Steps whose gradient norm is NaN or infinite.

The engine skips them (DeepSpeed's ZeRO optimizers do; without ZeRO the engine does it
itself): weights, optimizer state and LR schedule stay as they were, the step's data is
consumed. The trainer counts them (`train/skipped_steps`) and stops the run after
trainer.max_skipped_steps in a row, pointing at the last checkpoint. (The tests make steps
non-finite with HPSFT_TEST_NONFINITE_GRADIENT_STEPS: hpsft/workers/faults.py.)
"""

import math
from pathlib import Path

from hpsft.utils.errors import UserInputError


class SkippedSteps:
    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0  # over the whole run, resumes included (kept in the checkpoint)
        self.in_a_row = 0

    def record(self, grad_norm: float) -> None:
        if math.isfinite(grad_norm):
            self.in_a_row = 0
        else:
            self.total += 1
            self.in_a_row += 1

    def check(self, step: int, last_checkpoint: Path | None) -> None:
        """Stop the run once `limit` steps in a row were skipped."""
        if self.in_a_row < self.limit:
            return
        where = (f"the last checkpoint, {last_checkpoint}, holds the weights from before them: resume from it "
                 f"(trainer.resume={last_checkpoint})" if last_checkpoint else "no checkpoint was saved yet: start over")
        raise UserInputError(
            f"steps {step - self.in_a_row + 1}-{step} all had a non-finite gradient norm and were skipped "
            f"(trainer.max_skipped_steps={self.limit}); {where} with a lower optim.lr, or check the data of these steps"
        )
