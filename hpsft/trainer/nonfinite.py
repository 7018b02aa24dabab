"""Steps whose gradient norm is NaN or infinite.

The engine skips them (DeepSpeed's ZeRO optimizers do; without ZeRO the engine does it
itself): weights, optimizer state and LR schedule stay as they were, the step's data is
consumed. The trainer counts them (`train/skipped_steps`) and stops the run after
trainer.max_skipped_steps in a row, pointing at the last checkpoint.

Test hook: HPSFT_TEST_NONFINITE_GRADIENT_STEPS=3:inf,4:nan gives step 3 an infinite gradient
norm and step 4 NaN gradients (SPMD path only). Nothing but the tests sets it.
"""

import math
import os
from pathlib import Path

import torch

from hpsft.utils.errors import UserInputError
from hpsft.workers.training_worker import token_mean_loss

NONFINITE_GRADIENT_STEPS_ENV = "HPSFT_TEST_NONFINITE_GRADIENT_STEPS"


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


def nonfinite_gradient_steps() -> dict[int, float]:
    """The test hook's steps (1-based) and the value each puts into its gradients, e.g.
    "3:inf,4:nan" -> {3: inf, 4: nan}; empty unless the tests set the variable."""
    entries = (entry.split(":") for entry in os.environ.get(NONFINITE_GRADIENT_STEPS_ENV, "").split(",") if entry)
    return {int(step): float(value) for step, value in entries}


def nonfinite_gradient_loss(value: float, outputs, global_loss_tokens: int) -> torch.Tensor:
    """The usual loss (its value stays finite), whose backward makes the gradient norm `value`:
    NaN puts NaN into every gradient; inf puts +inf into one element of one parameter's
    gradient, the rest left as computed (an inf pushed through the backward would meet
    -inf and zeros on the way and make the norm NaN)."""
    loss = token_mean_loss(outputs, global_loss_tokens)
    if math.isnan(value):
        loss.register_hook(lambda grad: torch.full_like(grad, value))
        return loss
    handle = None

    def poison_once(grad):
        handle.remove()  # this micro-batch's backward only
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    handle = a_parameter_of(loss).register_hook(poison_once)
    return loss


def a_parameter_of(loss: torch.Tensor) -> torch.Tensor:
    """A parameter `loss` was computed from: the first leaf found walking its autograd graph."""
    nodes = [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if hasattr(node, "variable"):  # an AccumulateGrad node: its variable is a leaf that requires grad
            return node.variable
        nodes.extend(child for child, _ in node.next_functions if child is not None)
    raise ValueError("the loss depends on no parameter")
