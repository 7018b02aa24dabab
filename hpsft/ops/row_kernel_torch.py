"""Pure-torch row kernel: the fallback when no native kernel is built (contract in row_options)."""

import torch

from hpsft.ops.row_options import RowOptions, round_into


def torch_rows_forward_(block, labels, row_scale, options: RowOptions, compute_grad: bool, grad_out=None):
    cap, eps, lam = options.softcap, options.label_smoothing, options.z_loss_weight
    if cap > 0:
        block.div_(cap).tanh_().mul_(cap)
    lse = torch.logsumexp(block, dim=1)
    target = block.gather(1, labels[:, None]).squeeze(1)
    zloss = lam * lse * lse
    # Differences against lse, as in the native kernels. Label smoothing spreads eps over the
    # finite logits only: a -inf one (masked vocabulary entry) is not a choice of the row.
    loss = (1 - eps) * (lse - target) + zloss
    finite = block > float("-inf") if eps > 0 else None
    if eps > 0:
        finite_count = finite.sum(dim=1)
        mean_logit = torch.where(finite, block, 0.0).sum(dim=1) / finite_count
        loss = loss + eps * (lse - mean_logit)
    logprob = target - lse
    if compute_grad:
        # The softcap derivative needs z' after the block has turned into probabilities.
        cap_slope = 1 - (block / cap).square() if cap > 0 else None
        block.sub_(lse[:, None]).exp_().mul_((1 + 2 * lam * lse)[:, None])
        if eps > 0:
            block.sub_(finite * (eps / finite_count)[:, None])
        rows = torch.arange(block.shape[0], device=block.device)
        block[rows, labels] -= 1 - eps
        if cap_slope is not None:
            block.mul_(cap_slope)
        block.mul_(row_scale[:, None])
        round_into(block, grad_out)
    return loss, zloss, logprob


def torch_shard_stats_(block, local_labels, options: RowOptions):
    """Pass 1 of the vocabulary-parallel form (contract in row_options)."""
    cap = options.softcap
    if cap > 0:
        block.div_(cap).tanh_().mul_(cap)
    row_max = block.amax(dim=1)
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)[:, None]  # an all -inf row: exp(-inf) = 0, not NaN
    finite = block > float("-inf")
    sum_exp = (block - shift).exp_().sum(dim=1)
    owned = local_labels >= 0
    target = torch.where(owned, block.gather(1, local_labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    shifted_sum = torch.where(finite, block - shift, 0.0).sum(dim=1)
    return row_max, sum_exp, target, shifted_sum, finite.sum(dim=1).to(block.dtype)


def torch_shard_grad_(block, local_labels, lse, p_factor, uniform, target_coef, options: RowOptions, grad_out=None):
    """Pass 2 of the vocabulary-parallel form (contract in row_options)."""
    cap = options.softcap
    cap_slope = 1 - (block / cap).square() if cap > 0 else None
    finite = block > float("-inf")
    block.sub_(lse[:, None]).exp_().mul_(p_factor[:, None]).sub_(finite * uniform[:, None])
    owned = torch.nonzero(local_labels >= 0, as_tuple=True)[0]
    block[owned, local_labels[owned]] -= target_coef[owned]
    if cap_slope is not None:
        block.mul_(cap_slope)
    round_into(block, grad_out)
