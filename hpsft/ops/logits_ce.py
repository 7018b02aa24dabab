"""Cross-entropy on given logits (T, V): the row kernel on the supervised rows, no GEMM.

Without a GEMM after the row kernel, d(logits) of a row is linear in its upstream gradient,
so one forward pass serves every reduction: backward scales the stored block per row
(reduction "none") or by the scalar upstream gradient (reduced losses).
"""

import torch

from hpsft.ops.fused_linear_ce import compute_dtype_for


class CrossEntropyRowsFunction(torch.autograd.Function):
    """(logits, rows) -> (loss, zloss rows, logprob rows); rows index the supervised positions."""

    @staticmethod
    def forward(ctx, logits, positions, labels, row_scale, options, row_kernel, reduce, grad_enabled):
        # grad_enabled: torch.is_grad_enabled() at the call (see LinearCrossEntropyFunction).
        dtype = compute_dtype_for(logits.dtype)
        # index_select copies, so the row kernel may overwrite the block in place.
        block = logits.index_select(0, positions).to(dtype)
        scale = row_scale if reduce else torch.ones_like(row_scale)
        loss, zloss, logprob = row_kernel(block, labels, scale, options, grad_enabled and ctx.needs_input_grad[0])
        ctx.reduce, ctx.logits_shape, ctx.logits_dtype = reduce, logits.shape, logits.dtype
        ctx.save_for_backward(block, positions)
        if reduce:
            loss = (loss * row_scale).sum()
        ctx.mark_non_differentiable(zloss, logprob)
        return loss, zloss, logprob

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_zloss, _grad_logprob):
        block, positions = ctx.saved_tensors
        grad_rows = block * (grad_loss if ctx.reduce else grad_loss[:, None])
        grad_logits = torch.zeros(ctx.logits_shape, dtype=ctx.logits_dtype, device=block.device)
        grad_logits.index_copy_(0, positions, grad_rows.to(ctx.logits_dtype))
        return grad_logits, None, None, None, None, None, None, None
