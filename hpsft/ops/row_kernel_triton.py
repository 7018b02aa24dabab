"""Triton row kernel (contract: row_options): one program per row, online log-sum-exp over
BLOCK_V-wide vocabulary blocks, then a second sweep writing d(logits) in place. With
soft-capping the first sweep stores z' over the logits: the target logit is kept in
registers rather than read back, and a barrier orders the stores before the second sweep
(a program's elements are spread over its threads, and nothing else orders their memory).

With a 16-bit `grad_out`, d(logits) is rounded to it instead, and it may be the first half of
each row's own fp32 storage (`block.view(bf16)[:, :V]`, row stride 2V): element j of the row
then lands on bytes 2j..2j+1, inside fp32 element j/2. The gradient sweep reads a tile, waits
at a barrier until every thread of the program has read it, then writes: a tile's writes fall
on its own first half or on earlier tiles, both already read, so no value is overwritten
before it is read, and the GEMMs that follow read the 16-bit values with no second buffer.

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1, which Triton reads when
@triton.jit decorates: set it before this module is first imported. The interpreter has no
libdevice, so tanh is built from exp.
"""

import torch
import triton
import triton.language as tl

from hpsft.ops.row_options import RowOptions

BLOCK_V = 1024


@triton.jit
def _tanh(x):
    # Saturates cleanly: exp overflow gives 1, underflow gives -1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _row_statistics(row_ptr, label, vocab, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """The first sweep over a row: z' stored over the logits when soft-capping (the gradient
    sweep needs it), an online log-sum-exp (max, sum of exp(z' - max)), the finite logits' sum
    and count (label smoothing skips -inf, masked, entries) and the target logit z'_label (0
    when label is no column of the row)."""
    running_max = float("-inf")
    running_sum = 0.0
    logit_sum = 0.0
    finite_count = 0.0
    target = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < vocab
        z = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
            tl.store(row_ptr + cols, z, mask=in_vocab)
        # The target logit is picked up here, in registers: reading it back from row_ptr after
        # the soft-capping stores would race with the thread of this program that wrote it.
        target += tl.sum(tl.where(cols == label, z, 0.0), axis=0)
        new_max = tl.maximum(running_max, tl.max(tl.where(in_vocab, z, float("-inf")), axis=0))
        # While every logit so far is -inf (masked vocabulary entries), shift by 0: z - new_max
        # would be -inf - -inf = NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        block_sum = tl.sum(tl.where(in_vocab, tl.exp(z - shift), 0.0), axis=0)
        running_sum = running_sum * tl.exp(running_max - shift) + block_sum
        running_max = new_max
        finite = in_vocab & (z > float("-inf"))
        logit_sum += tl.sum(tl.where(finite, z, 0.0), axis=0)
        finite_count += tl.sum(tl.where(finite, 1.0, 0.0), axis=0)
    return running_max, running_sum, logit_sum, finite_count, target


@triton.jit
def _write_gradient(row_ptr, grad_row_ptr, label, vocab, lse, p_factor, uniform, target_coef, softcap,
                    HAS_SOFTCAP: tl.constexpr, GRAD_OVER_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The gradient sweep over a row of z': (exp(z' - lse) p_factor - uniform on finite logits
    - target_coef at the label) dz'/dz, written to grad_row_ptr in its dtype."""
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < vocab
        z = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
        if GRAD_OVER_LOGITS:
            tl.debug_barrier()  # the whole tile is read before any 16-bit write overlaps it
        grad = tl.exp(z - lse) * p_factor - tl.where(z > float("-inf"), uniform, 0.0)
        grad -= tl.where(cols == label, target_coef, 0.0)
        if HAS_SOFTCAP:
            grad = grad * (1.0 - (z / softcap) * (z / softcap))
        tl.store(grad_row_ptr + cols, grad.to(grad_row_ptr.dtype.element_ty), mask=in_vocab)


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr, row_stride, grad_ptr, grad_row_stride, labels_ptr, scale_ptr, loss_ptr, zloss_ptr, logprob_ptr,
    vocab, softcap, label_smoothing, z_loss_weight,
    HAS_SOFTCAP: tl.constexpr, COMPUTE_GRAD: tl.constexpr, GRAD_OVER_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    grad_row_ptr = grad_ptr + row * grad_row_stride
    label = tl.load(labels_ptr + row)
    running_max, running_sum, logit_sum, finite_count, target = _row_statistics(
        row_ptr, label, vocab, softcap, HAS_SOFTCAP, BLOCK_V)
    lse = running_max + tl.log(running_sum)
    zloss = z_loss_weight * lse * lse
    # Differences against lse: a large common logit offset cancels before it can round. The
    # smoothing term is selected, not multiplied by 0: in a row of only -inf it is NaN.
    smoothing = tl.where(label_smoothing > 0.0, label_smoothing * (lse - logit_sum / finite_count), 0.0)
    loss = (1.0 - label_smoothing) * (lse - target) + smoothing + zloss
    tl.store(loss_ptr + row, loss)
    tl.store(zloss_ptr + row, zloss)
    tl.store(logprob_ptr + row, target - lse)
    if COMPUTE_GRAD:
        if HAS_SOFTCAP:
            tl.debug_barrier()  # the z' stores above are visible to every thread below
        scale = tl.load(scale_ptr + row)
        p_factor = (1.0 + 2.0 * z_loss_weight * lse) * scale
        uniform = label_smoothing / finite_count * scale  # on finite logits only
        _write_gradient(row_ptr, grad_row_ptr, label, vocab, lse, p_factor, uniform, (1.0 - label_smoothing) * scale,
                        softcap, HAS_SOFTCAP, GRAD_OVER_LOGITS, BLOCK_V)


def _check_block(block, grad_out=None):
    if block.dtype != torch.float32 or block.stride(1) != 1:
        raise ValueError(f"the Triton row kernel takes fp32 blocks with contiguous rows, got {block.dtype}")
    grad = block if grad_out is None else grad_out
    if grad.shape != block.shape or grad.stride(1) != 1:
        raise ValueError(f"grad_out must be {tuple(block.shape)} with contiguous rows, got {tuple(grad.shape)}")
    return grad


def _launches(block) -> bool:
    # Meta tensors hold no data (the byte accounting): the launch has nothing to do.
    return block.shape[0] > 0 and block.device.type != "meta"


def triton_rows_forward_(block, labels, row_scale, options: RowOptions, compute_grad: bool, grad_out=None):
    grad = _check_block(block, grad_out)
    rows, vocab = block.shape
    loss, zloss, logprob = (torch.empty(rows, dtype=block.dtype, device=block.device) for _ in range(3))
    if _launches(block):
        _cross_entropy_rows_kernel[(rows,)](
            block, block.stride(0), grad, grad.stride(0), labels.contiguous(), row_scale.contiguous(), loss, zloss,
            logprob, vocab, options.softcap or 1.0, options.label_smoothing, options.z_loss_weight,
            HAS_SOFTCAP=options.softcap > 0, COMPUTE_GRAD=compute_grad,
            GRAD_OVER_LOGITS=grad_out is not None,  # the host driver's grad_out shares the block's storage
            BLOCK_V=BLOCK_V,
        )
    return loss, zloss, logprob


@triton.jit
def _shard_stats_kernel(
    logits_ptr, row_stride, labels_ptr, max_ptr, sum_ptr, target_ptr, shifted_ptr, count_ptr, vocab, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Pass 1 of the vocabulary-parallel form on a rank's block (contract: row_options): the
    first sweep of the kernel above, returning the row's statistics instead of its loss."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)  # -1: the target is another rank's
    running_max, running_sum, logit_sum, finite_count, target = _row_statistics(
        row_ptr, label, vocab, softcap, HAS_SOFTCAP, BLOCK_V)
    tl.store(max_ptr + row, running_max)
    tl.store(sum_ptr + row, running_sum)
    tl.store(target_ptr + row, target)
    tl.store(shifted_ptr + row, tl.where(finite_count > 0.0, logit_sum - running_max * finite_count, 0.0))
    tl.store(count_ptr + row, finite_count)


@triton.jit
def _shard_grad_kernel(
    logits_ptr, row_stride, grad_ptr, grad_row_stride, labels_ptr, lse_ptr, p_ptr, uniform_ptr, target_coef_ptr,
    vocab, softcap, HAS_SOFTCAP: tl.constexpr, GRAD_OVER_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Pass 2: the gradient sweep of the kernel above with the row's global statistics given."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    grad_row_ptr = grad_ptr + row * grad_row_stride
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    p_factor = tl.load(p_ptr + row)
    uniform = tl.load(uniform_ptr + row)
    target_coef = tl.load(target_coef_ptr + row)
    _write_gradient(row_ptr, grad_row_ptr, label, vocab, lse, p_factor, uniform, target_coef, softcap, HAS_SOFTCAP,
                    GRAD_OVER_LOGITS, BLOCK_V)


def triton_shard_stats_(block, local_labels, options: RowOptions):
    """Pass 1 of the vocabulary-parallel form (contract in row_options)."""
    _check_block(block)
    rows, vocab = block.shape
    stats = tuple(torch.empty(rows, dtype=block.dtype, device=block.device) for _ in range(5))
    if _launches(block):
        _shard_stats_kernel[(rows,)](
            block, block.stride(0), local_labels.contiguous(), *stats, vocab, options.softcap or 1.0,
            HAS_SOFTCAP=options.softcap > 0, BLOCK_V=BLOCK_V,
        )
    return stats


def triton_shard_grad_(block, local_labels, lse, p_factor, uniform, target_coef, options: RowOptions, grad_out=None):
    """Pass 2 of the vocabulary-parallel form (contract in row_options)."""
    grad = _check_block(block, grad_out)
    if _launches(block):
        _shard_grad_kernel[(block.shape[0],)](
            block, block.stride(0), grad, grad.stride(0), local_labels.contiguous(), lse.contiguous(),
            p_factor.contiguous(), uniform.contiguous(), target_coef.contiguous(), block.shape[1],
            options.softcap or 1.0, HAS_SOFTCAP=options.softcap > 0, GRAD_OVER_LOGITS=grad_out is not None,
            BLOCK_V=BLOCK_V,
        )


def load_triton_row_kernel():
    return triton_rows_forward_, ""
