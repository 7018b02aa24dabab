"""The tiny random models and packed rows of the Megatron model tests (test_megatron_model.py
and its launch script dist_scripts/megatron_model_checks.py), built from transformers' config
classes: 2 layers, 64 wide, 4 query and 2 key/value heads, a vocabulary of 250 (padded to 256
on the Megatron side, so the padding shows), each family's own options on."""

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from tests.test_model_families import sequences

VOCAB = 250
WINDOW = 6
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# The family's router loss on, as its forward adds it (PP = 1 only: architecture.check_layout).
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)

CONFIGS = {
    # tied embeddings, as SmolLM2
    "llama": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=1),  # layer 1 slides, layer 0 does not
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=WINDOW),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, **MOE),
    "mixtral_without_router_loss": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4,
                                                                      num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=48, **MOE),
}

# Uneven sequences (the first of each row longer than WINDOW), packed 3, 2, 3 and 2 to a row.
LENGTHS = [21, 4, 14, 9, 17, 3, 12, 7, 15, 8]
PACKED_ROWS = [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]


def tiny_config(family: str):
    return CONFIGS[family]()


def hf_reference(family: str, seed: int = 0):
    """(the Hugging Face model with eager attention, fp32, train mode; the sequences). Norm
    weights and biases are drawn (a swapped or dropped one then shows), the router weights
    scaled so no two experts' scores of a token are within rounding of each other."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model.train(), sequences(seed, LENGTHS, VOCAB)


def write_hf_model(family: str, folder: Path) -> Path:
    """hf_reference(family)'s model (drawn norms, spread router weights) saved to `folder`."""
    hf_reference(family)[0].save_pretrained(folder)
    return folder
