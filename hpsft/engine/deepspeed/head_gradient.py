"""The LM head's weight gradient summed in fp32 straight into DeepSpeed's BF16_Optimizer.

Under bf16 ZeRO-1 DeepSpeed's BF16_Optimizer keeps an fp32 gradient of every parameter, to
which each backward adds the bf16 `param.grad`. There the fused loss sums d(lm_head.weight) in
fp32 straight into that gradient during its forward (no bf16 (V, H) gradient, and no bf16
rounding of it), when the caller says how the loss scales the module's (train_batch's
`loss_weight`); docs/ops.md, "Where d(weight) goes, and when". This reaches into the
optimizer's own lists (bf16_groups, fp32_groups_gradients, fp32_groups_has_gradients): DeepSpeed
0.19.8's.
"""

from dataclasses import dataclass

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from torch import nn


@dataclass(frozen=True)
class HeadGradient:
    """Where BF16_Optimizer keeps the head weight's fp32 gradient: as a (V, H) tensor, and its
    (group, index) in the optimizer's lists."""

    into: torch.Tensor
    group_index: int
    index: int

    @classmethod
    def of(cls, optimizer, weight: nn.Parameter) -> "HeadGradient | None":
        """The head weight's fp32 gradient when the fused loss can sum d(weight) into it
        exactly; else None.

        Exactly: DeepSpeed keeps that gradient whole on every rank (ZeRO-1 partitions the
        optimizer state, not the gradients), every backward's epilogue adds the bf16
        `param.grad` into it (a tied embedding's own gradient, after the loss's forward-time
        sum), the boundary's all-reduce averages it with the rest over the dp group, and
        step() clips, applies and zeroes it (also when it skips a non-finite step). Other
        optimizers keep `param.grad` as the only gradient until their hooks take it (the
        caller leaves tensor and sequence parallelism out: not checked for this)."""
        if not isinstance(optimizer, BF16_Optimizer) or optimizer.grad_acc_dtype != torch.float32:
            return None
        for group_index, group in enumerate(optimizer.bf16_groups):
            for index, param in enumerate(group):
                if param is weight:
                    return cls(optimizer.fp32_groups_gradients[group_index][index].view(weight.shape), group_index,
                               index)
        return None  # a frozen head (LoRA): no gradient to sum

    def mark(self, optimizer, weight: nn.Parameter) -> None:
        """Tell BF16_Optimizer that the head weight's fp32 gradient holds a gradient, as its own
        backward epilogue does for a `param.grad` it adds (an untied head now has none): else
        its gradient norm would leave it out."""
        optimizer.fp32_groups_has_gradients[self.group_index][self.index] = True
        weight._hp_grad = self.into.view(-1)
