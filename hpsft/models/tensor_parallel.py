"""Which models hpsft trains under DeepSpeed's AutoTP (engine.tensor_parallel_size), checked
before DeepSpeed shards them.

AutoTP splits q/k/v/gate/up projections by output rows (column-parallel) and o/down by input
columns (row-parallel, all-reduced over the TP group); embeddings, norms and the LM head stay
replicated (docs/tensor_parallel.md). A rank's attention then sees H/TP query and K/TP key/value
heads: transformers reshapes the projections with -1 heads and keeps H/K query heads per
key/value head, so hpsft's varlen attention runs on the rank's heads unchanged. That needs
every count TP splits to divide by TP, and a family whose layers were shown to train under
TP=2 exactly as one process (tests/test_tensor_parallel.py). Families shown not to are refused
with the reason.
"""

from hpsft.utils.errors import UserInputError

TESTED_FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "mixtral")
# Measured at TP=2 against one process (docs/tensor_parallel.md).
REFUSED_FAMILIES = {
    "qwen3": "AutoTP leaves its per-head q_norm/k_norm weights whole on every TP rank, but each rank "
             "normalises only its own heads, so each holds a partial gradient of them that is never summed "
             "over the TP group (3 steps at TP=2: grad norm 3e-3 off, weights 2e-2 apart from one process)",
}


def check_tensor_parallel(config, tp_size: int) -> None:
    """Refuse (naming what to change) a model AutoTP would not shard exactly at this size."""
    if tp_size == 1:
        return
    option = f"engine.tensor_parallel_size={tp_size}"
    if config.model_type in REFUSED_FAMILIES:
        raise UserInputError(f"{option}: model type {config.model_type!r} is not supported under tensor "
                             f"parallelism: {REFUSED_FAMILIES[config.model_type]}; use engine.tensor_parallel_size=1")
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
