"""Fused linear + cross-entropy over the supervised rows, chunked over tokens.

Host side shared by every backend: for each chunk of rows it computes the logit block with
one GEMM (bias fused), hands it to the backend's row kernel (softmax, loss and d(logits)
in place, see row_options) and turns the block into d(hidden), d(weight), d(bias) with two
more GEMMs. Only one (rows, V) block exists at a time, so full logits are never
materialised, and the three GEMMs are the same work the unfused path does.

For a reduced loss the gradients are finished in the forward pass and backward only scales
them, in place, by the upstream scalar. For reduction "none" the upstream gradient differs
per row and d(weight) sums over rows, so backward recomputes the blocks with the upstream
gradient as the row scale (one extra forward's worth of work, no (N, V) storage); so does a
second backward through a retained graph.
"""

import torch

from hpsft.ops.row_options import RowKernel, RowOptions

LOGIT_BLOCK_BYTES = 128 * 2**20  # one (rows, V) block: large enough that d(weight) is updated
# in few passes (682 rows at V=49152 fp32), small next to materialised logits


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    # Softmax and gradient accumulation run in fp32 (fp64 when asked, e.g. for gradcheck).
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_chunk_rows(vocab_size: int, dtype: torch.dtype) -> int:
    return max(1, LOGIT_BLOCK_BYTES // (vocab_size * dtype.itemsize))


def chunked_linear_cross_entropy(
    x, weight, bias, labels, row_scale, options: RowOptions, row_kernel: RowKernel, chunk_rows, need_grads
):
    """Per-row (loss, zloss, logprob) and the row_scale-weighted gradients (None where not needed)."""
    need_x, need_w, need_b = need_grads
    dtype = compute_dtype_for(x.dtype)
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    n_rows, hidden_size = x.shape
    vocab_size = w.shape[0]
    chunk_rows = chunk_rows or default_chunk_rows(vocab_size, dtype)
    outputs = [torch.empty(n_rows, dtype=dtype, device=x.device) for _ in range(3)]
    grad_x = torch.empty(n_rows, hidden_size, dtype=dtype, device=x.device) if need_x else None
    # The first chunk's GEMM overwrites d(weight) (beta=0), saving a memset of (V, H); with no
    # rows at all there is no GEMM and the gradient is zero.
    allocate_w = torch.empty if n_rows else torch.zeros
    grad_w = allocate_w(vocab_size, hidden_size, dtype=dtype, device=x.device) if need_w else None
    grad_b = torch.zeros(vocab_size, dtype=dtype, device=x.device) if need_b else None
    block_buffer = torch.empty(min(chunk_rows, n_rows), vocab_size, dtype=dtype, device=x.device)
    for start in range(0, n_rows, chunk_rows):
        stop = min(start + chunk_rows, n_rows)
        xs = x[start:stop].to(dtype)
        block = block_buffer[: stop - start]
        if b is None:
            torch.mm(xs, w.t(), out=block)
        else:
            torch.addmm(b, xs, w.t(), out=block)
        for out, value in zip(outputs, row_kernel(block, labels[start:stop], row_scale[start:stop], options, any(need_grads))):
            out[start:stop] = value
        if need_x:
            torch.mm(block, w, out=grad_x[start:stop])
        if need_w:
            grad_w.addmm_(block.t(), xs, beta=0 if start == 0 else 1)
        if need_b:
            grad_b += block.sum(dim=0)
    return (*outputs, grad_x, grad_w, grad_b)


def _rows_to_tokens(grad_rows, positions, total_tokens):
    # index_copy, not index_add (what index_select's backward uses): positions are unique, and
    # index_add on CPU is orders of magnitude slower in torch 2.13.
    grad = grad_rows.new_zeros(total_tokens, grad_rows.shape[1])
    return grad.index_copy_(0, positions, grad_rows)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(hidden, weight, bias) -> (loss, zloss rows, logprob rows) over the rows `positions` of hidden.

    loss is sum_i row_scale_i * loss_i when reduce, else the per-row losses. grad_enabled:
    torch.is_grad_enabled() at the call; inside forward it is always False, and
    ctx.needs_input_grad says True under torch.no_grad() for inputs that require grad.
    """

    @staticmethod
    def forward(ctx, hidden, positions, weight, bias, labels, row_scale, options, row_kernel, reduce, chunk_rows, grad_enabled):
        ctx.options, ctx.row_kernel, ctx.chunk_rows = options, row_kernel, chunk_rows
        ctx.total_tokens = hidden.shape[0]
        ctx.grad_dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.needs_grad = tuple(grad_enabled and needed for needed in (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:4]))
        x = hidden.index_select(0, positions)
        loss, zloss, logprob, *grads = chunked_linear_cross_entropy(
            x, weight, bias, labels, row_scale, options, row_kernel, chunk_rows, ctx.needs_grad if reduce else (False,) * 3
        )
        # Finished gradients for the first backward; not saved tensors, so that backward can
        # scale them in place and hand them over (a copy of d(weight) would double the peak
        # memory for large vocabularies).
        ctx.precomputed_grads = grads if reduce else None
        ctx.save_for_backward(positions, x, weight, bias, labels, row_scale)
        ctx.mark_non_differentiable(zloss, logprob)
        return ((loss * row_scale).sum() if reduce else loss), zloss, logprob

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_zloss, _grad_logprob):
        positions, x, weight, bias, labels, row_scale = ctx.saved_tensors
        if ctx.precomputed_grads is not None:
            grads, ctx.precomputed_grads = ctx.precomputed_grads, None
            grads = [None if g is None else g.mul_(grad_loss) for g in grads]
        else:
            # Reduction "none" (a different upstream gradient per row, while d(weight) sums over
            # rows), or a second backward through a retained graph: recompute the blocks.
            scale = row_scale * grad_loss.to(row_scale.dtype)
            grads = chunked_linear_cross_entropy(
                x, weight, bias, labels, scale, ctx.options, ctx.row_kernel, ctx.chunk_rows, ctx.needs_grad
            )[3:]
        grads = [None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.grad_dtypes)]
        if grads[0] is not None:
            grads[0] = _rows_to_tokens(grads[0], positions, ctx.total_tokens)
        grad_hidden, grad_weight, grad_bias = grads
        return grad_hidden, None, grad_weight, grad_bias, None, None, None, None, None, None, None
