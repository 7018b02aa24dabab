"""The fused loss sharded by vocabulary under tensor parallelism (docs/ops.md, "Vocabulary-parallel").

Each rank of the TP group holds rows [start, start + rows) of the LM head's weight (and bias),
the same hidden states and the same labels. The host driver (fused_linear_ce.py) runs as on one
rank: per chunk of supervised rows one (rows, V/TP) logit block of the rank's own columns, two
GEMMs after it. Between them, instead of the one-pass row kernel, VocabParallelRows runs:

  1. the backend's shard_stats_ pass over the block (soft-cap in place; per row the local
     max m, sum-exp relative to m, the target logit where this rank owns the target, the
     finite logits' sum relative to m and their count),
  2. all-reduce MAX of m (and, for token accuracy, of the raw logits' max) -> the global max M,
  3. each rank rescales its sum-exp to M (s * exp(m - M)) and all-reduces SUM, in one call,
     of (rows, k) columns: sum-exp, the target logit - M (0 on every rank but the owner),
     with label smoothing the finite logits' sum - M and their count, with token accuracy
     "the owner's first max is the target" and "a rank before the target's reaches M",
  4. lse = M + log(sum), the loss, z-loss (from the global lse) and log-prob per row, equal on
     every rank (computed from the same all-reduced numbers),
  5. the backend's shard_grad_ pass writes the block's d(logits) from those global values.

Two all-reduces of (rows,) and (rows, 2..6) per chunk; logits never exist beyond one chunk's
(rows, V/TP) block. Padded vocabulary rows (Megatron pads V to a multiple of TP x 128) lie past
`vocab_size`: the driver never multiplies them (the block has the shard's real rows only), so
they contribute nothing to any statistic and get a zero gradient.

The d(hidden) contract: the op's d(hidden) is this rank's PARTIAL sum, over its own vocabulary
rows. The hidden states are replicated over the TP group, so their gradient is the sum of the
partials, and the caller's region does that sum, as Megatron's column-parallel LM head does:
put the hidden states through sum_grad_over_tp below (Megatron: copy_to_tensor_model_parallel_
region) before the loss, or, with Megatron's sequence parallelism, through
gather_from_sequence_parallel_region (all-gather forward, reduce-scatter backward). The op does
not all-reduce d(hidden) itself, so that a sequence-parallel caller can reduce-scatter it
instead; forgetting the region leaves every rank with its partial (wrong gradients, not an error).
d(weight) and d(bias) are the rank's own shard's, complete; nothing sums them over TP.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpsft.ops.row_options import RowOptions, ShardKernels


@dataclass(frozen=True)
class VocabShard:
    """Which vocabulary rows this rank's weight holds."""
    group: object  # the TP process group; None at TP=1
    rank: int
    size: int
    start: int  # global vocabulary index of the weight's first row
    rows: int  # real rows: [start, start + rows) lies in [0, vocab_size); the rest is padding
    vocab_size: int  # the real vocabulary, the same on every rank

    @property
    def parallel(self) -> bool:
        return self.size > 1


def vocab_shard(weight_rows: int, tp_group=None, vocab_start: int | None = None,
                vocab_size: int | None = None) -> VocabShard:
    """The shard the weight's rows are. tp_group None or of size 1: the weight is the whole
    vocabulary, the first `vocab_size` rows real (default: all). Otherwise vocab_start defaults
    to rank x weight_rows (Megatron's and torch's even vocab-parallel layout), vocab_size to
    size x weight_rows (no padding); every rank of the group must pass the same vocab_size,
    shards that tile [0, vocab_size) and the same options (each call runs collectives)."""
    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    if rank < 0:
        raise ValueError("tp_group must be a process group this rank belongs to")
    if size == 1:
        if vocab_start not in (None, 0):
            raise ValueError(f"vocab_start applies under tensor parallelism (a tp_group of size > 1); without it the "
                             f"weight's rows start at vocabulary index 0, got vocab_start={vocab_start}")
        start, default_size = 0, weight_rows
    else:
        start = rank * weight_rows if vocab_start is None else vocab_start
        default_size = size * weight_rows
    vocab_size = default_size if vocab_size is None else vocab_size
    # With explicit (maybe uneven) shards only the caller knows the whole; else the rows bound it.
    largest = vocab_size if size > 1 and vocab_start is not None else default_size
    if not 1 <= vocab_size <= largest:
        raise ValueError(f"vocab_size (the real vocabulary, without padding rows) must lie in [1, {default_size}] for "
                         f"{size} rank(s) holding {weight_rows} weight rows each, got {vocab_size}")
    if start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {start}")
    rows = min(max(vocab_size - start, 0), weight_rows)
    return VocabShard(tp_group if size > 1 else None, rank, size, start, rows, vocab_size)


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    # Meta tensors hold no data (the byte accounting replays the GPU path on them): an in-place
    # all-reduce allocates nothing in the caching allocator, so there is nothing to replay.
    if tensor.device.type != "meta":
        dist.all_reduce(tensor, op=op, group=group)


class VocabParallelRows:
    """A row kernel (row_options' contract, plus hits_out) over a rank's block of its own
    vocabulary columns: statistics pass, the two all-reduces, gradient pass (module docstring).
    labels are global vocabulary indices; loss, z-loss, log-prob and hits are the global ones.
    hits_out: (R,) bool, set where the argmax of the raw logits over the whole real vocabulary
    (ties: the first index, as torch.argmax) is the label."""

    def __init__(self, shard: VocabShard, kernels: ShardKernels):
        self.shard, self.kernels = shard, kernels

    def __call__(self, block, labels, row_scale, options: RowOptions, compute_grad: bool, grad_out=None, hits_out=None):
        shard, group = self.shard, self.shard.group
        eps, lam = options.label_smoothing, options.z_loss_weight
        local = labels - shard.start
        owned = (local >= 0) & (local < shard.rows)
        local_labels = torch.where(owned, local, -1)
        minus_inf = torch.full_like(row_scale, float("-inf"))
        if hits_out is not None:  # before the statistics pass soft-caps the block in place
            raw_max, raw_argmax = block.max(dim=1) if shard.rows else (minus_inf, torch.zeros_like(labels))
        if shard.rows:
            row_max, sum_exp, target, shifted_sum, count = self.kernels.stats_(block, local_labels, options)
        else:  # a shard of padding only: it holds no logit
            row_max, sum_exp, target, shifted_sum, count = minus_inf, *(torch.zeros_like(row_scale) for _ in range(4))
        maxima = torch.stack([row_max] if hits_out is None else [row_max, raw_max], dim=1)
        _all_reduce(maxima, dist.ReduceOp.MAX, group)
        global_max = maxima[:, 0]
        columns = [sum_exp * torch.exp(row_max - global_max), torch.where(owned, target - global_max, 0.0)]
        if eps > 0:
            columns += [torch.where(count > 0, shifted_sum + (row_max - global_max) * count, 0.0), count]
        if hits_out is not None:
            at_max = raw_max == maxima[:, 1]
            columns += [(owned & at_max & (raw_argmax == local)).to(row_scale.dtype),
                        (at_max & (shard.start + shard.rows <= labels)).to(row_scale.dtype)]
        sums = torch.stack(columns, dim=1)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        log_sum = sums[:, 0].log()
        lse = global_max + log_sum
        target_shifted = sums[:, 1]  # z'_y - M
        zloss = lam * lse * lse
        loss = (1 - eps) * (log_sum - target_shifted) + zloss
        if eps > 0:
            loss = loss + eps * (log_sum - sums[:, 2] / sums[:, 3])
        if hits_out is not None:
            hits_out.copy_((sums[:, -2] == 1) & (sums[:, -1] == 0))
        if compute_grad and shard.rows:
            uniform = eps * row_scale / sums[:, 3] if eps > 0 else torch.zeros_like(row_scale)
            self.kernels.grad_(block, local_labels, lse, (1 + 2 * lam * lse) * row_scale, uniform, (1 - eps) * row_scale,
                               options, grad_out)
        return loss, zloss, target_shifted - log_sum


def with_argmax_hits(row_kernel):
    """A one-rank row kernel that also sets hits_out (as VocabParallelRows does) from the raw block."""
    def rows(block, labels, row_scale, options, compute_grad, grad_out=None, hits_out=None):
        if hits_out is not None:
            torch.eq(block.argmax(dim=1), labels, out=hits_out)
        return row_kernel(block, labels, row_scale, options, compute_grad, grad_out)
    return rows


class _SumGradOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, group):
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        _all_reduce(grad, dist.ReduceOp.SUM, ctx.group)
        return grad, None


def sum_grad_over_tp(hidden: torch.Tensor, tp_group) -> torch.Tensor:
    """hidden, whose gradient is summed (all-reduced in place) over tp_group in backward:
    Megatron's copy_to_tensor_model_parallel_region, the region the vocabulary-parallel loss's
    partial d(hidden) needs (module docstring). tp_group None: hidden itself."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return hidden
    return _SumGradOverGroup.apply(hidden, tp_group)
