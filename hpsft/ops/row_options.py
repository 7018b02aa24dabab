"""The per-row loss options every backend's row kernel implements, and their contract.

A row kernel gets a block of logits (R, V) (bias already added, fp32 or fp64, rows
contiguous) and, in place and per row i with label y and scale s_i:
    z'      = softcap * tanh(z / softcap)            (when softcap > 0, else z' = z)
    lse     = logsumexp_j z'_j
    loss_i  = lse - (1 - eps) z'_y - eps * mean_j z'_j + lam * lse^2
    zloss_i = lam * lse^2,  logprob_i = z'_y - lse
and, when asked for the gradient, overwrites the block with
    s_i * d loss_i / d z_ij = s_i * (p_j (1 + 2 lam lse) - (1 - eps) [j == y] - eps / V) * dz'/dz
where p = softmax(z') and dz'/dz = 1 - (z'/softcap)^2. It returns (loss, zloss, logprob), each (R,).

With grad_out (a 16-bit (R, V) tensor; the host driver passes the first half of each row's
own fp32 storage, block.view(bf16)[:, :V]) the gradient is written there instead, rounded
once to its dtype, and the block's fp32 values are not needed afterwards. Kernels that only
write fp32 do so over the block and then round it into grad_out (round_into).

The vocabulary-parallel form (vocab_parallel.py) splits that work in two passes around the
all-reduces, on a rank's block (R, Vs) of its own vocabulary columns; `local_labels` (R,)
int64 is the target's column in this block, or -1 where the target is another rank's:
    shard_stats_(block, local_labels, options) -> (m, s, t, c, n), each (R,):
        z' written over the block (soft-cap), m = max_j z'_j (-inf for an empty or all -inf
        row), s = sum_j exp(z'_j - m) (0 then), t = z'_y where the target is local (else 0),
        c = sum over finite z'_j of (z'_j - m) (0 when there is none), n = their count
    shard_grad_(block, local_labels, lse, p_factor, uniform, target_coef, options, grad_out=None):
        over the z' block (or into grad_out, as above), per row with the global lse:
        d_ij = (exp(z'_ij - lse_i) p_factor_i - uniform_i [z'_ij finite] - target_coef_i [j == y]) dz'/dz
    (the host makes p_factor = s_i (1 + 2 lam lse), uniform = s_i eps / n_global, target_coef = s_i (1 - eps)).
"""

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RowOptions:
    softcap: float = 0.0  # 0 disables logit soft-capping
    label_smoothing: float = 0.0
    z_loss_weight: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.z_loss_weight < 0.0:
            raise ValueError(f"z_loss_weight must be >= 0, got {self.z_loss_weight}")
        if self.softcap < 0.0:
            raise ValueError(f"softcap must be > 0 (or None to disable), got {self.softcap}")


# (block, labels, row_scale, options, compute_grad, grad_out=None) -> (loss, zloss, logprob)
RowKernel = Callable[..., tuple]


@dataclass(frozen=True)
class ShardKernels:
    """One backend's two passes of the vocabulary-parallel form (contract above)."""
    stats_: Callable[..., tuple]
    grad_: Callable[..., None]


def round_into(block: torch.Tensor, grad_out: torch.Tensor | None) -> None:
    """grad_out = block rounded to grad_out's dtype, for a kernel that wrote fp32 d(logits) over
    the block. grad_out may overlap the block's storage: the rounded copy is made first (a
    temporary of grad_out's size; the CPU kernels' price, the Triton kernel writes it directly)."""
    if grad_out is not None:
        grad_out.copy_(block.to(grad_out.dtype))
