"""hpsft_varlen's GPU path (torch's varlen flash kernel over a whole packed row) against
attention written out here from its definition, per sequence, in fp32 from the same bf16 inputs.

Runs only where torch sees a CUDA device (scripts/gpu_checks.sh runs it on a lent GPU); there
a torch without the kernel fails the test rather than skipping it. Tolerances: outputs and
gradients in bf16 (relative step 2^-8), compared at 2e-2 of the largest entry.
"""

import pytest
import torch
from torch import nn

from hpsft.models import varlen_attention
from hpsft.models.varlen_attention import runs_varlen_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LENGTHS = [5, 64, 1, 130, 37]  # one-token and longer-than-window sequences included


class CausalAttention(nn.Module):
    is_causal = True


def reference_attention(query, key, value, scaling, sliding_window):
    """One sequence, (1, H, L, D) -> (1, H, L, D): softmax over the keys j <= i (and i - j <
    window) of q.k * scaling, key/value heads shared by consecutive query heads."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    i = torch.arange(query.shape[2], device=query.device)
    distance = i[:, None] - i[None, :]
    allowed = (distance >= 0) & (distance < sliding_window if sliding_window else True)
    scores = (query @ key.transpose(2, 3) * scaling).masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ value


def packed_qkv(q_heads=8, kv_heads=2, head_dim=64):
    gen = torch.Generator("cuda").manual_seed(0)
    total = sum(LENGTHS)
    shapes = [(1, q_heads, total, head_dim), (1, kv_heads, total, head_dim), (1, kv_heads, total, head_dim)]
    return [torch.randn(s, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_() for s in shapes]


@pytest.mark.parametrize("boundaries", ["as PackedCausalLM passes them", "from position ids"])
@pytest.mark.parametrize("sliding_window", [None, 16])
def test_whole_row_kernel_matches_per_sequence_attention(sliding_window, boundaries):
    assert varlen_attention.VARLEN_KERNEL is not None, f"torch {torch.__version__} has no varlen_attn with window_size"
    query, key, value = packed_qkv()
    assert runs_varlen_kernel(query, None, None, 0.0)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda")
    if boundaries == "from position ids":
        row = {"position_ids": torch.cat([torch.arange(n, device="cuda") for n in LENGTHS])[None]}
    else:  # int32 boundaries and the longest sequence, taken by every layer as they are
        row = {"cu_seq_lens_q": offsets.to(torch.int32), "max_length_q": max(LENGTHS)}
    scaling = query.shape[-1] ** -0.5
    out, _ = varlen_attention.varlen_attention(CausalAttention(), query, key, value, None, scaling=scaling,
                                               sliding_window=sliding_window, **row)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value), upstream)

    leaves = [t.detach().float().requires_grad_() for t in (query, key, value)]
    bounds = offsets.tolist()
    expected = torch.cat([
        reference_attention(*(t[:, :, s:e] for t in leaves), scaling, sliding_window)
        for s, e in zip(bounds[:-1], bounds[1:])
    ], dim=2).transpose(1, 2)
    expected_grads = torch.autograd.grad(expected, leaves, upstream.float())
    for name, actual, reference in [("output", out, expected), *zip(("d query", "d key", "d value"), grads,
                                                                       expected_grads)]:
        scale = reference.abs().max()
        worst = (actual.float() - reference).abs().max()
        assert worst <= 2e-2 * scale, f"{name}: {worst:.3g} off (scale {scale:.3g})"
