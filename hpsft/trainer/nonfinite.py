"""Steps whose gradient norm is NaN or infinite.

The engine skips them (DeepSpeed's ZeRO optimizers do; without ZeRO the engine does it
itself): weights, optimizer state and LR schedule stay as they were, the step's data is
consumed. The trainer counts them (`train/skipped_steps`) and stops the run after
trainer.max_skipped_steps in a row, pointing at the last checkpoint.

Test hook: HPSFT_TEST_NAN_GRADIENT_STEPS=3,4 makes the gradients of steps 3 and 4 NaN
(SPMD path only). Nothing but the tests sets it.
"""

import math
import os
from pathlib import Path

import torch

from hpsft.errors import UserInputError
from hpsft.workers.training_worker import token_mean_loss

NAN_GRADIENT_STEPS_ENV = "HPSFT_TEST_NAN_GRADIENT_STEPS"


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


def nan_gradient_steps() -> set[int]:
    """The test hook's steps (1-based), empty unless the tests set the variable."""
    return {int(step) for step in os.environ.get(NAN_GRADIENT_STEPS_ENV, "").split(",") if step}


def nan_gradient_loss(outputs, global_loss_tokens: int) -> torch.Tensor:
    """The usual loss, whose gradient is NaN everywhere (its value stays finite)."""
    loss = token_mean_loss(outputs, global_loss_tokens)
    loss.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    return loss
