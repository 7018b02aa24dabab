"""Which models hpsft trains under DeepSpeed's AutoTP (engine.tensor_parallel_size), checked
before DeepSpeed shards them.

AutoTP splits q/k/v/gate/up projections by output rows (column-parallel) and o/down by input
columns (row-parallel, all-reduced over the TP group); embeddings, norms and the LM head stay
replicated (docs/tensor_parallel.md). A rank's attention then sees H/TP query and K/TP key/value
heads: transformers reshapes the projections with -1 heads and keeps H/K query heads per
key/value head, so hpsft's varlen attention runs on the rank's heads unchanged. That needs
every count TP splits to divide by TP, and a family whose layers were shown to train under
TP=2 exactly as one process (tests/test_tensor_parallel.py). Weights AutoTP leaves whole but
applies to a rank's heads only (Qwen3's q_norm/k_norm) get their gradients summed over the TP
group (sum_partial_gradients_over_tp).
"""

import re

import torch.distributed as dist
from torch import nn

from hpsft.utils.errors import UserInputError

TESTED_FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "mixtral", "qwen3")


def check_tensor_parallel(config, tp_size: int) -> None:
    """Refuse (naming what to change) a model AutoTP would not shard exactly at this size."""
    if tp_size == 1:
        return
    option = f"engine.tensor_parallel_size={tp_size}"
    if config.model_type not in TESTED_FAMILIES:
        raise UserInputError(f"{option}: model type {config.model_type!r} is not supported under tensor "
                             f"parallelism (shown exact for {', '.join(TESTED_FAMILIES)} only); use "
                             "engine.tensor_parallel_size=1")
    counts = {"attention heads (num_attention_heads)": config.num_attention_heads,
              "key/value heads (num_key_value_heads)": config.num_key_value_heads,
              "MLP width (intermediate_size)": config.intermediate_size}
    for what, count in counts.items():
        if count % tp_size:
            valid = [size for size in range(1, count + 1) if all(c % size == 0 for c in counts.values())]
            raise UserInputError(f"{option} does not divide the model's {count} {what}: each rank must hold a "
                                 f"whole share of them; sizes dividing every count: {valid}")


def sum_partial_gradients_over_tp(module: nn.Module, group) -> None:
    """Make the gradient of each weight the model's own Hugging Face tp_plan marks
    `replicated_with_grad_allreduce` (Qwen3's per-head q_norm/k_norm) the sum over the TP group.
    AutoTP leaves such a weight whole on every rank, but each rank applies
    it to its own heads only, so its gradient there is a partial sum; DeepSpeed adds this
    all-reduce only on its tp_plan path, which it does not take for hpsft's wrapper. The hook
    runs on each backward's gradient, before DeepSpeed accumulates it."""
    lm = getattr(module, "lm", module)
    plan = getattr(lm.config, "base_model_tp_plan", None) or {}
    patterns = [re.compile(r"(^|\.)" + re.escape(key).replace(r"\*", r"\d+") + r"\.")
                for key, style in plan.items() if style == "replicated_with_grad_allreduce"]

    def summed(grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad

    for name, weight in module.named_parameters():
        if any(pattern.search(name) for pattern in patterns):
            weight.register_hook(summed)
