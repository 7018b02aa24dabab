"""Which models hpsft trains under DeepSpeed's AutoTP (engine.tensor_parallel_size), checked
before DeepSpeed shards them.

AutoTP splits q/k/v/gate/up projections by output rows (column-parallel) and o/down by input
columns (row-parallel, all-reduced over the TP group); embeddings, norms and the LM head stay
replicated (docs/tensor_parallel.md), the embedding and head unless engine.vocab_parallel_head
shards them by vocabulary rows first (vocab_parallel_head.py). A rank's attention then sees H/TP query and K/TP key/value
heads: transformers reshapes the projections with -1 heads and keeps H/K query heads per
key/value head, so hpsft's varlen attention runs on the rank's heads unchanged. That needs
every count TP splits to divide by TP, and a family whose layers were shown to train under
TP=2 exactly as one process (tests/test_tensor_parallel.py). Weights AutoTP leaves whole but
applies to a rank's heads only (Qwen3's q_norm/k_norm) get their gradients summed over the TP
group (sum_partial_gradients_over_tp). At start-up the sharded model is checked against the
whole one (ShardingCheck).
"""

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hpsft.models.families import UnsupportedModel
from hpsft.models.packed_causal_lm import check_row
from hpsft.utils.errors import UserInputError

TESTED_FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "mixtral", "qwen3")
# ShardingCheck's largest relative error of the loss or a weight's gradient norm, by the sharded
# weights' dtype (the whole model's reference is the loaded one, fp32 on the host). What it
# catches is far larger: a partial gradient left unsummed over TP=2 is 29 % off (1 - 1/sqrt(2)).
SHARDING_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


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


@dataclass
class ShardingCheck:
    """What a model computes on the start-up check's row (packed_causal_lm.check_row, fully
    supervised), taken from the whole model before AutoTP shards it: the summed loss and every
    trainable weight's shape and gradient norm. `verify(sharded)` runs the same row through the
    sharded model on every rank of the TP group and refuses it unless the loss and each weight's
    gradient norm agree within the dtype's TOLERANCE (a sharded weight's norm over the group's
    slices): a layer AutoTP splits wrongly, a partial gradient left unsummed (Qwen3's q_norm
    without sum_partial_gradients_over_tp: its norm 1/sqrt(TP) of the whole one) or a rank
    attending with heads that are not its own all show, on the family's own model.
    Costs one forward and backward of the row (33 tokens) on each
    (before sharding the whole model is on every rank anyway), and the gradients of the weights
    checked: those outside the decoder layers and of the first CHECKED_LAYERS layers (every
    layer of a family is sharded alike; two cover an alternation of sliding and global ones)."""
    loss: float
    grad_norms: dict[str, tuple[tuple[int, ...], float]]

    @classmethod
    def of(cls, packed: nn.Module) -> "ShardingCheck":
        loss, norms = probe(packed)
        return cls(loss, norms)

    def verify(self, sharded: nn.Module, group) -> float:
        """Refuse the sharded model (UnsupportedModel) or return its worst relative error."""
        loss, norms = probe(sharded)
        names = sorted(norms)
        sliced = [name for name in names if norms[name][0] != self.grad_norms[name][0]]
        squares = torch.tensor([norms[name][1] ** 2 for name in sliced], dtype=torch.float64)
        if sliced:
            dist.all_reduce(squares, group=group)
        whole = {name: norms[name][1] for name in names} | {n: math.sqrt(v) for n, v in zip(sliced, squares.tolist())}
        tolerance = SHARDING_TOLERANCE[next(sharded.parameters()).dtype]
        scale = max(norm for _, norm in self.grad_norms.values())
        errors = {"loss": abs(loss - self.loss) / max(abs(self.loss), 1e-12)}
        for name in names:  # a norm far below the largest is mostly rounding: measured against a floor
            errors[name] = abs(whole[name] - self.grad_norms[name][1]) / max(self.grad_norms[name][1], 1e-3 * scale)
        worst = max(errors, key=errors.get)
        if errors[worst] > tolerance:
            raise UnsupportedModel(
                f"engine.tensor_parallel_size: the model as DeepSpeed's AutoTP sharded it computes another "
                f"{'loss' if worst == 'loss' else 'gradient of ' + worst} than the whole model on the start-up "
                f"check's row (relative error {errors[worst]:.2e} > {tolerance:.0e}); train it with "
                "engine.tensor_parallel_size=1")
        return errors[worst]


def probe(packed: nn.Module) -> tuple[float, dict[str, tuple[tuple[int, ...], float]]]:
    """The loss (sum over the check row's tokens) and each trainable weight's (shape, gradient
    norm), fp64 norms. The gradients come from autograd.grad: nothing accumulates into .grad, so
    no engine's gradient hooks run (tensor hooks do: sum_partial_gradients_over_tp's)."""
    lm = packed.lm
    weights = {name: w for name, w in lm.named_parameters() if w.requires_grad and checked(name)}
    _, row = check_row(lm, past_window=False)  # sharding is the same past a window: no 4k-token row
    was_training = lm.training
    lm.eval()
    try:
        out = packed(row["input_ids"], row["position_ids"], row["offsets"], loss_mask=row["loss_mask"],
                     max_length=row["max_length"])
        grads = torch.autograd.grad(out["loss"], list(weights.values()), allow_unused=True)
    finally:
        lm.train(was_training)
    norms = {name: (tuple(w.shape), 0.0 if g is None else float(g.double().norm()))
             for (name, w), g in zip(weights.items(), grads)}
    return float(out["loss"]), norms


CHECKED_LAYERS = 2


def checked(name: str) -> bool:
    """Whether ShardingCheck compares this weight's gradient: outside the decoder layers, or in one
    of the first CHECKED_LAYERS."""
    layer = re.search(r"\.layers\.(\d+)\.", name)
    return layer is None or int(layer.group(1)) < CHECKED_LAYERS
