"""Exact attention for packed rows without flash-attn: causal attention run per sequence.

transformers' own sdpa/eager paths handle a packed row by building a block-diagonal mask
over the whole row: exact, but quadratic in the *row* length (a 4k-token row of 64 short
chats computes 64x the needed scores; measured 5x slower fwd+bwd for SmolLM2-4l on CPU).
Here each sequence's slice of the row runs its own causal attention, so the work is
quadratic in each sequence only. Boundaries come from `cu_seq_lens_q` (passed by
PackedCausalLM, the same keyword flash-attn's varlen path reads) or, when absent, from the
restarts of `position_ids`.

Every attention variant a family passes to its attention function is honoured, as the
family's eager code computes it: `scaling`, `sliding_window` (key j visible from query i
iff 0 <= i - j < window; per layer, as the layer passes it), `softcap` (Gemma-2's
tanh soft-capping of the scores) and `s_aux` (GPT-OSS's per-head sink logits, which take
softmax mass but carry no value). Plain and sliding-window causal attention run in SDPA;
soft-capping and sinks need the scores themselves, so those run as explicit per-sequence
matmuls.

On a GPU, in bf16/fp16, plain and sliding-window attention run the whole row in one call of
torch's varlen flash kernel (torch.nn.attention.varlen.varlen_attn, torch >= 2.11) instead:
the per-sequence loop costs a kernel launch per sequence and layer, and cuDNN's SDPA, which
torch picks for such calls on Hopper, builds a graph per new shape (1.4-1.9 ms of host time
a call, measured on an H200: 3-4 s of a 2k-token SmolLM2-135M step). Registered in
transformers under ATTN_IMPLEMENTATION (a name without "sdpa" in
it: transformers applies its SDPA support list to such names and refuses e.g. Gemma-2).
Training only: a packed row of batch 1, no KV cache.
"""

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface

ATTN_IMPLEMENTATION = "hpsft_varlen"

# Keywords transformers' layers pass that do not change the attention of a packed training row
# (flags that are None or False are ignored too).
IGNORED_KWARGS = {"position_ids", "cu_seq_lens_k", "max_length_k", "output_attentions",
                  "use_cache", "cache_position", "past_key_values", "position_embeddings", "is_causal",
                   "output_router_logits", "output_hidden_states", "return_dict"}


def _torch_varlen_kernel():
    """torch's varlen flash attention, or None where this torch lacks it. torch 2.10's first
    version (is_causal, no window_size) is not used: the per-sequence loop serves it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


VARLEN_KERNEL = _torch_varlen_kernel()
# Whether it takes fewer key/value heads itself (else they are repeated to the query heads).
VARLEN_KERNEL_TAKES_GQA = VARLEN_KERNEL is not None and "enable_gqa" in inspect.signature(VARLEN_KERNEL).parameters


def runs_varlen_kernel(query, softcap, sinks, dropout) -> bool:
    """Whether the whole row goes to torch's varlen flash kernel: CUDA, 16-bit, head size
    the kernel takes, and no variant it lacks (soft-capping, sinks, dropout)."""
    return (VARLEN_KERNEL is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256 and not softcap and sinks is None
            and not dropout)


def kernel_bounds(cu_seq_lens, max_length, position_ids, query) -> tuple[torch.Tensor, int]:
    """(int32 sequence boundaries on the query's device, longest sequence) for the whole-row
    kernel. From what PackedCausalLM passes, computed once per forward, every layer takes them as
    they are: no host synchronisation per layer. Without them, derived here (a sync)."""
    if cu_seq_lens is not None and max_length is not None:
        return cu_seq_lens.to(device=query.device, dtype=torch.int32), int(max_length)
    bounds = sequence_bounds(cu_seq_lens, position_ids, query.shape[2])
    longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    return torch.tensor(bounds, dtype=torch.int32, device=query.device), longest


def varlen_kernel_attention(query, key, value, cu_seq, longest, scaling, sliding_window):
    """(1, H, T, D) query/key/value of a packed row -> (1, T, Hq, D), one kernel call."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    gqa = {}
    if k.shape[1] != q.shape[1]:
        if VARLEN_KERNEL_TAKES_GQA:
            gqa = {"enable_gqa": True}
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # (left, right) keys visible around each query: causal, and with a window W the W - 1
    # keys before it (i - j < W, as `visible` below).
    window = (sliding_window - 1 if sliding_window else -1, 0)
    out = VARLEN_KERNEL(q, k, v, cu_seq, cu_seq, longest, longest, scale=scaling, window_size=window, **gqa)
    return out.unsqueeze(0)


def sequence_bounds(cu_seq_lens, position_ids, total: int) -> list[int]:
    if cu_seq_lens is not None:
        return cu_seq_lens.tolist()
    if position_ids is None:
        return [0, total]
    starts = torch.nonzero(position_ids[0] == 0, as_tuple=True)[0].tolist()
    return (starts if starts and starts[0] == 0 else [0, *starts]) + [total]


def visible(length: int, sliding_window: int | None, device) -> torch.Tensor:
    """(L, L) boolean: query i sees key j iff j <= i and, with a window, i - j < window."""
    distance = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None, :]
    allowed = distance >= 0
    if sliding_window:
        allowed &= distance < sliding_window
    return allowed


def explicit_attention(query, key, value, scaling, sliding_window, softcap, sinks, dropout):
    """One sequence's attention from its scores, as the eager code of Gemma-2/GPT-OSS does it:
    scores -> soft-cap -> mask -> softmax over [scores, sink] in fp32 -> drop the sink."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible(query.shape[2], sliding_window, query.device), float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], dim=-1)
        # Subtracting the row max (finite: the diagonal and the sink are always present) keeps
        # the softmax stable; the eager code does the same.
        scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, value)


def sequence_attention(query, key, value, scaling, sliding_window, softcap, sinks, dropout):
    if softcap or sinks is not None:
        return explicit_attention(query, key, value, scaling, sliding_window, softcap, sinks, dropout)
    if sliding_window and query.shape[2] > sliding_window:
        mask = visible(query.shape[2], sliding_window, query.device)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, dropout_p=dropout,
                                              enable_gqa=True)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, dropout_p=dropout,
                                          enable_gqa=True)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, s_aux=None, cu_seq_lens_q=None, max_length_q=None, position_ids=None, **kwargs):
    """query (1, Hq, T, D), key/value (1, Hkv, T, D) -> (1, T, Hq, D), as transformers expects."""
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{ATTN_IMPLEMENTATION} runs packed training rows (batch 1, no KV cache), got query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}; use attn_implementation='sdpa' otherwise"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{ATTN_IMPLEMENTATION}: {type(module).__name__} is not causal attention")
    unknown = {k for k, v in kwargs.items() if v is not None and v is not False and k not in IGNORED_KWARGS}
    if unknown:
        # A variant this function does not implement would otherwise be silently dropped.
        raise ValueError(f"{ATTN_IMPLEMENTATION}: {type(module).__name__} passes attention options "
                         f"{sorted(unknown)} that hpsft does not implement")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    dropout = dropout if module.training else 0.0
    if runs_varlen_kernel(query, softcap, s_aux, dropout):
        cu_seq, longest = kernel_bounds(cu_seq_lens_q, max_length_q, position_ids, query)
        return varlen_kernel_attention(query, key, value, cu_seq, longest, scaling, sliding_window), None
    bounds = sequence_bounds(cu_seq_lens_q, position_ids, query.shape[2])
    outputs = [
        sequence_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scaling, sliding_window, softcap,
                           s_aux, dropout)
        for s, e in zip(bounds[:-1], bounds[1:]) if e > s
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs):
    """The attention function builds its own per-sequence masks."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_mask)
