"""The engine's optimizer and LR schedule: AdamW over two weight-decay groups, linear warmup
then constant or cosine."""

import math

import torch
from torch import nn


def lr_lambda(total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float):
    """Linear warmup to the peak, then constant or cosine down to `min_lr_ratio`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def warmup_steps(optim_config, total_steps: int) -> int:
    """The first optim.warmup_ratio of `total_steps` (every engine's warmup)."""
    # Rounded before the floor: in floats 0.29 * 100 is 28.999999999999996, and a user who asks
    # for 29% of 100 steps means 29.
    return math.floor(round(optim_config.warmup_ratio * total_steps, 9))


def lr_scheduler(optimizer: torch.optim.Optimizer, optim_config, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """optim.lr_scheduler over `total_steps`, the first optim.warmup_ratio of them warming up."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(
        total_steps, warmup_steps(optim_config, total_steps), optim_config.lr_scheduler, optim_config.min_lr_ratio))


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D parameters)."""
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            ndim = len(getattr(param, "ds_shape", param.shape))  # a ZeRO-3 partitioned parameter is 1-D
            (decay if ndim >= 2 else no_decay).append(param)
    # An empty group is left out: DeepSpeed's ZeRO optimizer drops it, and the LR scheduler,
    # built on the torch optimizer's groups, would then count one group too many (LoRA adapters
    # are all 2-D: no group without decay; DoRA's magnitudes are 1-D, not decayed).
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def adamw(module: nn.Module, optim_config, cpu_adam: bool) -> torch.optim.Optimizer:
    """AdamW over `module`'s param_groups: DeepSpeed's CPU Adam when `cpu_adam` (ZeRO-Offload
    on a GPU machine: the optimizer states and step live on the host), torch's fused AdamW
    otherwise."""
    groups = param_groups(module, optim_config.weight_decay)
    kwargs = {"lr": optim_config.lr, "betas": tuple(optim_config.betas), "eps": optim_config.eps}
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    # torch's fused AdamW, the same update on both devices: on CUDA one kernel launch per
    # group of tensors (torch's default there, foreach, is a chain of launches per step);
    # on CPU one vectorised pass per tensor, 5-14x faster than the default single-tensor
    # chain of passes on SmolLM2-135M (docs/packing.md).
    return torch.optim.AdamW(groups, fused=True, **kwargs)
