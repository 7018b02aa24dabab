"""DeepSpeed-Ulysses sequence parallelism around an exact varlen attention function.

A sequence-parallel (SP) group of P ranks holds one packed row cut into P slices of tokens
(data/sequence_split.py). Everything in a decoder layer except attention is per token, so
it runs on the local slice as it is; rotary embeddings are applied by the attention module
to its local query/key before it calls the attention function, with the slice's own
position ids. Attention needs whole sequences, so around the attention function:

    query/key/value (1, H, L, D) per rank --all-to-all--> (1, H/P, P*L, D): whole row, H/P heads
    inner attention on the whole row with its exact cu_seqlens (hpsft_varlen or flash-attn)
    output (1, P*L, H/P, D) --all-to-all--> (1, L, H, D): the local slice, all heads

Rank r takes query heads [r*H/P, (r+1)*H/P) and key/value heads [r*K/P, (r+1)*K/P): with
G = H/K query heads per key/value head these are exactly the key/value heads its query
heads read. When K is not divisible by P (e.g. 2 key/value heads and SP=4) the key/value
heads are repeated to H first (every query head its own copy: exact, more traffic). Per-head
parameters the layer passes with them (GPT-OSS's sink logits `s_aux`, one per query head) are
cut to the same H/P heads; each rank's slice then gets the gradient of its heads over the whole
row, and the sum over the ranks (the engine's gradient reduction) is the whole gradient.

The all-to-all exchanges equal chunks along dim 0, so its adjoint is the same exchange:
the backward pass sends the gradients back the way the activations came.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AttentionInterface, AttentionMaskInterface

from hpsft.utils.errors import UserInputError
from hpsft.models.varlen_attention import ATTN_IMPLEMENTATION, no_mask

ULYSSES_IMPLEMENTATION = "hpsft_ulysses"
# Attention functions that take cu_seqlens and run each sequence of a packed row exactly.
INNER_IMPLEMENTATIONS = (ATTN_IMPLEMENTATION, "flash_attention_2")


@dataclass(frozen=True)
class SequenceParallel:
    """The SP group of this rank and the attention function that runs on whole rows."""

    group: object  # a torch.distributed process group of `size` ranks
    size: int
    rank: int
    inner: str  # one of INNER_IMPLEMENTATIONS


def check_heads(config, sp_size: int, tp_size: int = 1) -> None:
    """Ulysses gives each SP rank whole query heads: their count must divide by SP, and under
    tensor parallelism each TP rank's share of them (H/TP: AutoTP splits the heads first)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % (sp_size * tp_size):
        divisors = [d for d in range(1, heads // tp_size + 1) if heads % (d * tp_size) == 0]
        per_tp_rank = f" per tensor-parallel rank ({heads // tp_size} of {heads})" if tp_size > 1 else ""
        raise UserInputError(
            f"engine.sequence_parallel_size={sp_size} does not divide the model's {heads} attention heads "
            f"({kv_heads} key/value heads){per_tp_rank}: each sequence-parallel rank attends with whole heads; use "
            f"one of {divisors}"
        )


class AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 goes to rank j of the group; chunk i received comes from rank i."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group), None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    # Both buffers contiguous: empty_like keeps a strided view's layout, and all_to_all_single
    # reads and writes dim-0 chunks as flat memory.
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def heads_to_sequence(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(1, H, L, D) local tokens, all heads -> (1, H/P, P*L, D) all tokens, this rank's heads."""
    _, heads, length, dim = x.shape
    chunks = AllToAll.apply(x[0].reshape(sp.size, heads // sp.size, length, dim), sp.group)
    return chunks.transpose(0, 1).reshape(heads // sp.size, sp.size * length, dim).unsqueeze(0)


def sequence_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(1, P*L, H/P, D) all tokens, this rank's heads -> (1, L, H, D) local tokens, all heads."""
    _, total, heads, dim = x.shape
    length = total // sp.size
    chunks = AllToAll.apply(x[0].reshape(sp.size, length, heads, dim), sp.group)
    return chunks.transpose(0, 1).reshape(length, sp.size * heads, dim).unsqueeze(0)


def this_ranks_heads(per_head: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(H,) one value per query head -> (H/P,) those of the heads this rank attends with."""
    heads = per_head.shape[0] // sp.size
    return per_head[sp.rank * heads:(sp.rank + 1) * heads]


def ulysses_attention(module, query, key, value, attention_mask, sequence_parallel: SequenceParallel | None = None,
                      position_ids=None, **kwargs):
    """The attention function transformers calls (registered as ULYSSES_IMPLEMENTATION):
    query (1, H, L, D), key/value (1, K, L, D) of the local slice -> (1, L, H, D)."""
    sp = sequence_parallel
    if sp is None:
        raise ValueError(f"{ULYSSES_IMPLEMENTATION} needs the sequence_parallel keyword (PackedCausalLM passes it)")
    if key.shape[1] % sp.size:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    query, key, value = (heads_to_sequence(t, sp) for t in (query, key, value))
    if kwargs.get("s_aux") is not None:
        kwargs["s_aux"] = this_ranks_heads(kwargs["s_aux"], sp)
    # The local position ids are not the gathered row's: the inner function takes the
    # boundaries from cu_seq_lens (the whole row's), never from position ids.
    out, _ = AttentionInterface()[sp.inner](module, query, key, value, attention_mask, **kwargs)
    return sequence_to_heads(out, sp), None


AttentionInterface.register(ULYSSES_IMPLEMENTATION, ulysses_attention)
AttentionMaskInterface.register(ULYSSES_IMPLEMENTATION, no_mask)
