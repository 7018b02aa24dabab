"""Public API: varlen (packed-sequence) cross-entropy on hidden states or on logits.

Inputs describe packed sequences: rows (T, ...) of `hidden` or `logits` (or a jagged nested
tensor, whose values()/offsets() are used), `offsets` = cu_seqlens (B+1,), and either
  - input_ids (T,) + loss_mask (T,): loss_mask[t] == 1 means token t is a supervised target;
    position t predicts token t+1 of the same sequence, never the next sequence's first token;
  - labels (T,) already aligned with the predicting rows, ignore_index where there is none.
Only supervised rows reach the row kernel (and the LM-head GEMM): prompt tokens cost nothing.

Reductions: "none" (per-row losses, 0 on rows without a label), "sum", "mean" (sum divided by
`denominator`, default the local token count: pass the global count for exact normalisation
over micro-batches and ranks) and "seq_mean" (mean over sequences of each sequence's mean
token loss; `denominator` defaults to the number of sequences with a supervised token).

Under tensor parallelism (tp_group of size > 1) the weight is this rank's vocabulary shard
(vocab_parallel.py): every output is the whole vocabulary's and equal on every rank, d(weight)
and d(bias) are the shard's, and d(hidden) is this rank's partial sum, which the caller's
region must sum over the group (vocab_parallel.sum_grad_over_tp).
"""

from dataclasses import dataclass

import torch

from hpsft.ops import varlen_targets
from hpsft.ops.backends import select_row_kernel, shard_kernels
from hpsft.ops.fused_linear_ce import (LinearCrossEntropyFunction, compute_dtype_for, default_chunk_rows, gemm_dtype_for,
                                       gemm_dtypes_for)
from hpsft.ops.logits_ce import CrossEntropyRowsFunction
from hpsft.ops.row_options import RowOptions
from hpsft.ops.vocab_parallel import VocabParallelRows, VocabShard, vocab_shard, with_argmax_hits

REDUCTIONS = ("none", "sum", "mean", "seq_mean")


@dataclass
class VarlenCEOutput:
    loss: torch.Tensor  # reduced scalar, or (T,) per row for "none"; includes the z-loss term
    n_tokens: torch.Tensor  # int64 scalar: number of supervised target tokens
    z_loss: torch.Tensor  # the z-loss part of `loss`, same reduction, detached (for logging)
    logprobs: torch.Tensor | None  # (T,) log p(target) per row (0 without a label), detached; when asked
    backend: str  # which kernel ran: "cpp", "triton" or "torch"
    # (T,) bool: the row's argmax over the (whole) vocabulary is its label (False without one); when asked
    correct: torch.Tensor | None = None


def _values_and_offsets(rows, offsets, name):
    """Unpack a jagged nested tensor; its offsets must agree with explicit ones."""
    if not (isinstance(rows, torch.Tensor) and rows.is_nested):
        return rows, offsets
    nested_offsets = rows.offsets()
    if offsets is not None and not torch.equal(offsets.long().cpu(), nested_offsets.long().cpu()):
        raise ValueError(f"offsets disagree with the offsets() of the nested {name}")
    return rows.values(), nested_offsets


def _flat(tensor):
    return tensor.values() if isinstance(tensor, torch.Tensor) and tensor.is_nested else tensor


def _supervised_positions(total_tokens, vocab_size, input_ids, loss_mask, labels, ignore_index, offsets):
    if labels is not None:
        if input_ids is not None or loss_mask is not None:
            raise ValueError("pass either labels (+ ignore_index) or input_ids + loss_mask, not both")
        return varlen_targets.from_labels(_flat(labels), ignore_index, offsets, total_tokens, vocab_size)
    if input_ids is None or loss_mask is None:
        raise ValueError("pass input_ids and loss_mask (with offsets), or labels")
    return varlen_targets.from_input_ids(_flat(input_ids), _flat(loss_mask), offsets, total_tokens, vocab_size)


def _row_scale(reduction, denominator, targets: varlen_targets.SupervisedPositions, dtype, device):
    """Weight of each supervised row in the reduced loss."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if denominator is not None and reduction not in ("mean", "seq_mean"):
        raise ValueError(f"denominator only applies to reduction 'mean' or 'seq_mean', not {reduction!r}")
    if isinstance(denominator, (int, float)) and denominator <= 0:
        raise ValueError(f"denominator must be positive, got {denominator}")
    ones = torch.ones(targets.labels.numel(), dtype=dtype, device=device)
    if reduction in ("none", "sum"):
        return ones
    if reduction == "mean":
        # An empty batch has no loss to normalise: divide by 1 rather than produce NaN.
        return ones / (denominator if denominator is not None else max(targets.labels.numel(), 1))
    tokens_per_sequence = torch.bincount(targets.sequence_ids, minlength=targets.num_sequences).to(dtype)
    if denominator is None:
        denominator = max(int((tokens_per_sequence > 0).sum().item()), 1)
    return ones / tokens_per_sequence[targets.sequence_ids] / denominator


def _gemm_dtype(requested, hidden, weight):
    if requested is None:
        return gemm_dtype_for(hidden, weight)
    allowed = gemm_dtypes_for(hidden, weight)
    if requested not in allowed:
        raise ValueError(
            f"gemm_dtype must be None or one of {[str(d) for d in allowed]} for {hidden.dtype} hidden and "
            f"{weight.dtype} weight on {hidden.device}, got {requested}"
        )
    return requested


def _output(loss, zloss, logprob, targets, row_scale, total_tokens, reduction, return_logprobs, backend, hits=None):
    def per_row(values):
        # index_copy (positions are unique): index_add is very slow on CPU in torch 2.13.
        return values.new_zeros(total_tokens).index_copy(0, targets.positions, values)

    if reduction == "none":
        loss, z_loss = per_row(loss), per_row(zloss)
    else:
        z_loss = (zloss * row_scale).sum()
    n_tokens = torch.tensor(targets.labels.numel(), dtype=torch.int64, device=loss.device)
    logprobs = per_row(logprob) if return_logprobs else None
    return VarlenCEOutput(loss, n_tokens, z_loss.detach(), logprobs, backend, per_row(hits) if hits is not None else None)


def _options(label_smoothing, z_loss_weight, softcap):
    return RowOptions(softcap=float(softcap or 0.0), label_smoothing=float(label_smoothing), z_loss_weight=float(z_loss_weight))


def varlen_linear_cross_entropy(
    hidden,
    weight,
    bias=None,
    *,
    input_ids=None,
    offsets=None,
    loss_mask=None,
    labels=None,
    ignore_index=-100,
    reduction="sum",
    denominator=None,
    label_smoothing=0.0,
    z_loss_weight=0.0,
    softcap=None,
    return_logprobs=False,
    backend="auto",
    chunk_rows=None,
    gemm_dtype=None,
    grad_scale=None,
    grad_weight_into=None,
    return_correct=False,
    tp_group=None,
    vocab_start=None,
    vocab_size=None,
) -> VarlenCEOutput:
    """Cross-entropy of softcap(hidden @ weight.T + bias) without materialising the logits.

    hidden (T, H) or nested jagged; weight (V, H); bias (V,) or None. chunk_rows: rows per
    logit block (default: chunk_rows.py; a 128 MiB block on CPU, at least 1024 rows; on CUDA
    sized so the op's extra memory stays within Liger-Kernel's at the same shape).
    gemm_dtype: operand dtype of the three GEMMs, None for the default (the inputs' bf16/fp16
    on CUDA, tensor cores with fp32 accumulation; fp32 elsewhere), else fp32 or the inputs'
    16-bit dtype (see fused_linear_ce). Differentiable w.r.t. hidden, weight and bias.
    grad_scale (reduced losses): the gradient backward will receive for `loss`, e.g.
    1 / the optimizer step's loss tokens when the caller divides by that: the gradients are
    made already multiplied by it, backward has no pass over them, and it fails (without
    waiting for the device) if the upstream gradient is another. grad_weight_into (needs
    grad_scale): an fp32 (V, H) tensor, e.g. the engine's fp32 gradient of the weight, into
    which d(weight) is added instead of being returned (no (V, H) buffer of the op's own).
    return_correct: also out.correct, per row whether the argmax of the raw logits (before the
    soft-cap, which keeps the order; ties: the first index) is the label.

    Vocabulary parallelism (vocab_parallel.py): with tp_group (a process group of size > 1),
    weight (and bias) are this rank's rows [vocab_start, vocab_start + weight.shape[0]) of the
    LM head (vocab_start default: rank x weight.shape[0]), hidden and the labels the same on
    every rank of the group, every rank calling with the same options. Rows at or past
    vocab_size (the real vocabulary, default: all rows of all ranks; Megatron pads V to a
    multiple of TP x 128) are padding: never used, gradient 0. Loss, z-loss, log-probs and
    correct are the whole vocabulary's, equal on every rank; d(weight), d(bias) and
    grad_weight_into are this shard's. THE CALLER SUMS d(hidden): the op returns this rank's
    partial d(hidden) (its vocabulary rows' share), so hidden must come through a region whose
    backward sums the gradient over tp_group: vocab_parallel.sum_grad_over_tp(hidden, tp_group)
    (Megatron: copy_to_tensor_model_parallel_region; under Megatron's sequence parallelism
    gather_from_sequence_parallel_region, whose backward reduce-scatters it). Two all-reduces
    per chunk of rows. tp_group None or of size 1: the one-rank op, vocab_size marking padding
    rows there too.
    """
    hidden, offsets = _values_and_offsets(hidden, offsets, "hidden")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be (T, H) and weight (V, H) with the same H, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    shard = vocab_shard(weight.shape[0], tp_group, vocab_start, vocab_size)
    targets = _supervised_positions(hidden.shape[0], shard.vocab_size, input_ids, loss_mask, labels, ignore_index, offsets)
    return linear_cross_entropy_of_targets(
        hidden, weight, bias, targets, reduction=reduction, denominator=denominator, label_smoothing=label_smoothing,
        z_loss_weight=z_loss_weight, softcap=softcap, return_logprobs=return_logprobs, backend=backend,
        chunk_rows=chunk_rows, gemm_dtype=gemm_dtype, grad_scale=grad_scale, grad_weight_into=grad_weight_into,
        return_correct=return_correct, shard=shard,
    )


def _check_gradient_destination(grad_scale, grad_weight_into, weight, reduction):
    if grad_scale is None and grad_weight_into is None:
        return
    if reduction == "none":
        raise ValueError("grad_scale and grad_weight_into apply to a reduced loss ('sum', 'mean', 'seq_mean'), not 'none'")
    if grad_scale is not None and not (isinstance(grad_scale, (int, float)) and grad_scale > 0):
        raise ValueError(f"grad_scale must be a positive number, got {grad_scale!r}")
    if grad_weight_into is None:
        return
    if grad_scale is None:
        raise ValueError("grad_weight_into needs grad_scale: d(weight) is added into it already scaled")
    if (grad_weight_into.shape != weight.shape or grad_weight_into.dtype != torch.float32
            or grad_weight_into.device != weight.device or not grad_weight_into.is_contiguous()):
        raise ValueError(f"grad_weight_into must be a contiguous float32 tensor of the weight's shape {tuple(weight.shape)} "
                         f"on {weight.device}, got {grad_weight_into.dtype} {tuple(grad_weight_into.shape)} on "
                         f"{grad_weight_into.device}")


def linear_cross_entropy_of_targets(
    hidden, weight, bias, targets: varlen_targets.SupervisedPositions, *, reduction, denominator, label_smoothing,
    z_loss_weight, softcap, return_logprobs, backend, chunk_rows, gemm_dtype, grad_scale=None, grad_weight_into=None,
    return_correct=False, shard: VocabShard | None = None,
) -> VarlenCEOutput:
    """varlen_linear_cross_entropy once the supervised rows are known (hidden a plain (T, H)
    tensor; shard: vocab_parallel.vocab_shard's, None for the whole vocabulary on one rank).
    Nothing here reads a value back from the device, so it also runs on meta tensors: the byte
    accounting (byte_accounting.py) replays the CUDA path's allocations through it."""
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},) to match weight, got {tuple(bias.shape)}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if weight.device != hidden.device or (bias is not None and bias.device != hidden.device):
        raise ValueError(f"hidden, weight and bias must be on one device, got {hidden.device} and {weight.device}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    _check_gradient_destination(grad_scale, grad_weight_into, weight, reduction)
    gemm_dtype = _gemm_dtype(gemm_dtype, hidden, weight)
    options = _options(label_smoothing, z_loss_weight, softcap)
    total_tokens = hidden.shape[0]
    dtype = compute_dtype_for(hidden.dtype)
    backend_name, row_kernel = select_row_kernel(backend, hidden.device, dtype)
    row_scale = _row_scale(reduction, denominator, targets, dtype, hidden.device)
    shard = shard or vocab_shard(weight.shape[0])
    if shard.parallel:
        row_kernel = VocabParallelRows(shard, shard_kernels(backend_name))
        if chunk_rows is None:  # every rank of the group must cut the same chunks: the whole vocabulary's rule
            chunk_rows = default_chunk_rows(total_tokens, targets.labels.numel(), hidden.shape[1], shard.vocab_size,
                                            hidden.dtype, hidden.device, grad_weight_into is not None)
    elif return_correct:
        row_kernel = with_argmax_hits(row_kernel)
    vocab_rows = shard.rows if shard.rows < weight.shape[0] else None
    loss, zloss, logprob, hits = LinearCrossEntropyFunction.apply(
        hidden, targets.positions, weight, bias, targets.labels, row_scale, options, row_kernel, reduction != "none",
        chunk_rows, gemm_dtype, grad_scale, grad_weight_into, torch.is_grad_enabled(), vocab_rows, return_correct,
    )
    return _output(loss, zloss, logprob, targets, row_scale, total_tokens, reduction, return_logprobs, backend_name, hits)


def varlen_cross_entropy(
    logits,
    *,
    input_ids=None,
    offsets=None,
    loss_mask=None,
    labels=None,
    ignore_index=-100,
    reduction="sum",
    denominator=None,
    label_smoothing=0.0,
    z_loss_weight=0.0,
    softcap=None,
    return_logprobs=False,
    backend="auto",
) -> VarlenCEOutput:
    """Same loss as varlen_linear_cross_entropy on given logits (T, V) (or nested jagged)."""
    logits, offsets = _values_and_offsets(logits, offsets, "logits")
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point (T, V) tensor, got {logits.dtype} {tuple(logits.shape)}")
    options = _options(label_smoothing, z_loss_weight, softcap)
    total_tokens = logits.shape[0]
    targets = _supervised_positions(total_tokens, logits.shape[1], input_ids, loss_mask, labels, ignore_index, offsets)
    dtype = compute_dtype_for(logits.dtype)
    backend_name, row_kernel = select_row_kernel(backend, logits.device, dtype)
    row_scale = _row_scale(reduction, denominator, targets, dtype, logits.device)
    loss, zloss, logprob = CrossEntropyRowsFunction.apply(
        logits, targets.positions, targets.labels, row_scale, options, row_kernel, reduction != "none", torch.is_grad_enabled()
    )
    return _output(loss, zloss, logprob, targets, row_scale, total_tokens, reduction, return_logprobs, backend_name)
