"""The input embedding and LM head sharded by vocabulary rows over the TP group (DeepSpeed AutoTP
path, `engine.vocab_parallel_head`; docs/tensor_parallel.md, "The vocabulary-parallel head").

AutoTP shards the decoder layers only: the (V, H) embedding and LM head stay whole on every TP
rank (for SmolLM2-sized models most of the parameters). shard_vocabulary, run before DeepSpeed
builds its optimizer, gives each TP rank rows [rank x R, (rank + 1) x R) of them, R = ceil(V / TP)
(the vocabulary padded to a multiple of TP; the padding rows, past V on the last ranks, are zero,
never looked up and never scored, so their gradient and AdamW update stay zero):

- the embedding (VocabParallelEmbedding): each rank looks up the tokens in its rows, zeros the
  others, and the partial embeddings are all-reduced over the TP group (forward sum, backward
  identity: the decoder's gradient of its input is already whole on every TP rank). Megatron's
  VocabParallelEmbedding idea.
- the head (VocabParallelHead): a holder of the rank's rows and where they start; the loss
  (PackedCausalLM.token_losses) runs hpsft/ops/vocab_parallel.py on them (global max / sum-exp /
  target logit by all-reduce, logits never materialised) and sums its partial d(hidden) over the
  group (sum_grad_over_tp).
- tied (SmolLM2): both hold the same rank-row Parameter, so autograd adds the embedding's
  gradient (its looked-up rows) and the loss's (every row of the shard) into one gradient.

Every rank's shard is complete where it is held: nothing sums d(weight) over TP, and DeepSpeed's
gradient norm counts each shard once (a TP-partitioned parameter, as AutoTP's own).
"""

import math

import torch
import torch.distributed as dist
from torch import nn

from hpsft.utils.errors import UserInputError


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group (all-reduce); backward: the gradient as it is (Megatron's
    reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, partial, group):
        summed = partial.contiguous()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class VocabRows:
    """Which vocabulary rows a rank's (R, H) weight holds: [start, start + R) of the padded
    vocabulary, the real ones below vocab_size."""

    def __init__(self, group, vocab_size: int):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.vocab_size = vocab_size
        self.rows = math.ceil(vocab_size / self.size)
        self.start = self.rank * self.rows

    def shard_of(self, whole: torch.Tensor) -> nn.Parameter:
        """This rank's rows of the whole (V, H) weight, zero rows past V."""
        shard = whole.new_zeros((self.rows, *whole.shape[1:]))
        real = max(min(self.vocab_size - self.start, self.rows), 0)
        shard[:real] = whole[self.start:self.start + real]
        return nn.Parameter(shard, requires_grad=whole.requires_grad)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: nn.Parameter, rows: VocabRows, padding_idx=None):
        super().__init__()
        self.weight = weight
        self.vocab_rows = rows
        self.padding_idx = padding_idx  # kept for the family's code that reads it; the lookup ignores it as nn.Embedding's forward does in training

    def forward(self, input_ids):
        rows = self.vocab_rows
        local = input_ids - rows.start
        mine = (local >= 0) & (local < rows.rows)
        partial = nn.functional.embedding(torch.where(mine, local, 0), self.weight)
        partial = partial * mine.unsqueeze(-1).to(partial.dtype)
        return _SumOverGroup.apply(partial, rows.group)


class VocabParallelHead(nn.Module):
    """The rank's rows of the LM head: read by the loss, never called (no logits)."""

    def __init__(self, weight: nn.Parameter, rows: VocabRows):
        super().__init__()
        self.weight = weight
        self.vocab_rows = rows
        self.vocab_size = rows.vocab_size  # the whole vocabulary (the start-up check draws its tokens from it)

    def forward(self, hidden):
        raise RuntimeError("the vocabulary-parallel LM head is read by the fused loss only: no full logits")


def shard_vocabulary(packed: nn.Module, group) -> None:
    """Replace `packed`'s (a PackedCausalLM's) input embedding and LM head by this rank's
    vocabulary rows over `group` (module docstring). Before the optimizer is built: the
    optimizer and DeepSpeed then hold the shards only."""
    lm = packed.lm
    embedding, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if type(embedding) is not nn.Embedding or type(head) is not nn.Linear or head.bias is not None:
        raise UserInputError(f"engine.vocab_parallel_head=true: {type(lm).__name__}'s embedding "
                             f"({type(embedding).__name__}) or LM head ({type(head).__name__}, with bias: "
                             f"{getattr(head, 'bias', None) is not None}) is not a plain nn.Embedding / bias-free "
                             "nn.Linear; use engine.vocab_parallel_head=false")
    if packed.token_accuracy:
        raise UserInputError("engine.vocab_parallel_head=true with model.loss.token_accuracy=true is not supported "
                             "(its argmax pass reads the whole head); set one of them false")
    tied = head.weight is embedding.weight
    rows = VocabRows(group, embedding.weight.shape[0])
    with torch.no_grad():
        embedding_rows = rows.shard_of(embedding.weight)
        head_rows = embedding_rows if tied else rows.shard_of(head.weight)
    for weight in (embedding_rows, head_rows):
        weight.hpsft_vocab_rows = rows  # for the whole-weight gather at export (whole_vocabulary_weight)
        # DeepSpeed's ZeRO-1/2 gradient norm counts a parameter not marked model-parallel on TP
        # rank 0 only (a replica): each rank's rows are a shard, counted on every rank.
        weight.tensor_model_parallel = True
    lm.set_input_embeddings(VocabParallelEmbedding(embedding_rows, rows, embedding.padding_idx))
    new_head = VocabParallelHead(head_rows, rows)
    lm.set_output_embeddings(new_head)
    for name, child in list(packed.named_children()):  # PackedCausalLM registers the HF model's children as its own
        if child is head:
            packed.register_module(name, new_head)


def vocab_rows_of(param: torch.Tensor) -> VocabRows | None:
    return getattr(param, "hpsft_vocab_rows", None)


def whole_vocabulary_weight(param: torch.Tensor) -> torch.Tensor:
    """The whole (V, H) weight from every TP rank's rows (a collective over the TP group), the
    padding rows cut."""
    rows = vocab_rows_of(param)
    pieces = [torch.empty_like(param) for _ in range(rows.size)]
    dist.all_gather(pieces, param.detach().contiguous(), group=rows.group)
    return torch.cat(pieces)[:rows.vocab_size]
