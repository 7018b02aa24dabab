"""What a model family computes after its decoder, and the options hpsft refuses.

hpsft takes the loss on the decoder's last hidden state with its own fused op, so whatever
a family's `ForCausalLM.forward` does between the decoder and the loss must be redone here,
exactly: Gemma-2/3's final-logit soft-capping (the op's `softcap`), Cohere's `logit_scale`
and Granite's `logits_scaling` (a factor on the logits, applied to the hidden state: the
head has no bias there, so s * (h @ W.T) == (s * h) @ W.T), and an MoE model's router
load-balancing loss (transformers' own function of that family, with its coefficient),
when the model's config turns it on (`output_router_logits`, as in its own forward).

What hpsft cannot train exactly is refused here by name. Anything this list misses is
caught at start-up by `verify_packed_training`, which compares hpsft's path with the
model's own eager forward.
"""

import sys
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

from hpsft.utils.errors import UserInputError


class UnsupportedModel(UserInputError):
    """A model family or option that hpsft would train approximately: refused."""


@dataclass(frozen=True)
class OutputSide:
    hidden_scale: float = 1.0  # logits = hidden_scale * (hidden @ W.T)
    softcap: Optional[float] = None  # logits = softcap * tanh(logits / softcap)
    router_aux_loss_coef: float = 0.0  # > 0: add coef * load-balancing loss (MoE)
    # (router_logits per layer, num_experts, top_k, attention_mask) -> scalar; the family's own
    router_aux_loss: Optional[Callable] = None
    num_experts: int = 0
    experts_per_token: int = 0


def refuse(config, option: str, why: str):
    raise UnsupportedModel(
        f"model type {config.model_type!r} with {option} cannot be trained exactly by hpsft: {why}. "
        "See README 'Model families' for what is supported"
    )


def check_supported(lm: nn.Module, attn_implementation: str) -> None:
    """Refuse, naming the model type and option, what hpsft's packed path does not compute."""
    config = lm.config
    if getattr(config, "vision_config", None) is not None:
        refuse(config, "a vision tower", "the text path would drop its images; vision-language models train "
               "through hpsft/models/packed_vision_lm.py (the trainer builds it for a vision-language folder)")
    if getattr(config, "is_encoder_decoder", False):
        refuse(config, "is_encoder_decoder=True", "hpsft trains decoder-only causal LMs")
    if getattr(config, "attention_chunk_size", None):
        refuse(config, f"attention_chunk_size={config.attention_chunk_size}",
               "chunked local attention is not implemented by hpsft's varlen attention")
    if getattr(config, "use_bidirectional_attention", False):
        refuse(config, "use_bidirectional_attention=True", "the loss assumes causal attention")
    has_sinks = any(getattr(m, "sinks", None) is not None for m in lm.modules())
    if has_sinks and attn_implementation == "flash_attention_2":
        refuse(config, "attention sinks under flash_attention_2",
               "flash-attn's varlen kernels have no sink logits; use model.attn_implementation=hpsft_varlen")
    head = lm.get_output_embeddings()
    scaled = getattr(config, "logit_scale", None) not in (None, 1.0) or getattr(config, "logits_scaling", None) not in (None, 1.0)
    if scaled and getattr(head, "bias", None) is not None:
        refuse(config, "a logit scale and an LM-head bias", "the scale is applied to the hidden state")


def output_side(lm: nn.Module) -> OutputSide:
    config = lm.config
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    aux = {}
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0.0):
        loss_fn = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
        if loss_fn is None or not hasattr(lm, "num_experts_per_tok"):
            refuse(config, "output_router_logits=True", f"{type(lm).__name__} has no load-balancing loss hpsft knows")
        aux = {"router_aux_loss_coef": float(config.router_aux_loss_coef), "router_aux_loss": loss_fn,
               "num_experts": int(lm.num_experts), "experts_per_token": int(lm.num_experts_per_tok)}
    return OutputSide(hidden_scale=scale, softcap=float(softcap) if softcap else None, **aux)


def longest_sliding_window(config) -> int:
    """The longest sliding window of any layer, 0 when there is none or when it never binds:
    at least max_position_embeddings wide (Phi-3-mini-128k's is 262144)."""
    window = getattr(config, "sliding_window", None)
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(window, int) or (isinstance(positions, int) and window >= positions):
        return 0
    return window
