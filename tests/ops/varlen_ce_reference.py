"""Independent fp64 reference: loop over sequences, F.cross_entropy(reduction='none') each.

Shares no code with hpsft.ops: it builds per-sequence shifted labels itself and lets autograd
differentiate the plain expression.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100


@dataclass
class PackedBatch:
    hidden: torch.Tensor  # (T, H) fp32
    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor  # (V,)
    input_ids: torch.Tensor  # (T,) int64
    loss_mask: torch.Tensor  # (T,) int64 0/1
    offsets: torch.Tensor  # (B+1,) int64

    def aligned_labels(self):
        """The same supervision as input_ids + loss_mask, expressed as labels of predicting rows."""
        labels = torch.full_like(self.input_ids, IGNORE)
        for start, stop in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist()):
            keep = self.loss_mask[start + 1 : stop].bool()
            labels[start : stop - 1] = torch.where(keep, self.input_ids[start + 1 : stop], IGNORE)
        return labels


def make_batch(lengths=(5, 0, 1, 7, 4, 9), hidden_size=16, vocab_size=37, fully_masked=(4,), seed=0, dtype=torch.float32):
    """Packed sequences with an empty one, a one-token one and one whose labels are all masked."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    input_ids = torch.randint(0, vocab_size, (total,), generator=gen)
    input_ids[::5] = vocab_size - 1  # the last vocabulary entry is a label somewhere
    loss_mask = (torch.rand(total, generator=gen) < 0.6).long()
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for b in fully_masked:
        loss_mask[offsets[b] : offsets[b + 1]] = 0
    return PackedBatch(
        hidden=torch.randn(total, hidden_size, generator=gen, dtype=dtype),
        weight=torch.randn(vocab_size, hidden_size, generator=gen, dtype=dtype) * 0.5,
        bias=torch.randn(vocab_size, generator=gen, dtype=dtype),
        input_ids=input_ids,
        loss_mask=loss_mask,
        offsets=offsets,
    )


def reference_rows(logits_of_rows, labels, offsets, label_smoothing=0.0, z_loss_weight=0.0, softcap=None):
    """Per-row (loss, zloss, logprob) in fp64, 0 on rows without a label.

    logits_of_rows(start, stop) -> (stop - start, V) fp64 logits of those rows.
    """
    total = labels.shape[0]
    loss = torch.zeros(total, dtype=torch.float64)
    zloss = torch.zeros(total, dtype=torch.float64)
    logprob = torch.zeros(total, dtype=torch.float64)
    for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        if stop == start:
            continue
        logits = logits_of_rows(start, stop)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        seq_labels = labels[start:stop]
        valid = seq_labels != IGNORE
        # F.cross_entropy's smoothing term averages every logit (+inf loss with a -inf one); a
        # -inf logit is a masked vocabulary entry, so the uniform target covers the finite ones.
        nll = F.cross_entropy(logits, seq_labels, reduction="none", ignore_index=IGNORE)
        lse = torch.logsumexp(logits, dim=1)
        finite = torch.isfinite(logits)
        mean_finite = torch.where(finite, logits, 0.0).sum(1) / finite.sum(1)
        smoothing = label_smoothing * (lse - mean_finite) if label_smoothing else 0.0
        ce = torch.where(valid, (1 - label_smoothing) * nll + smoothing, 0.0)
        z = torch.where(valid, z_loss_weight * lse**2, 0.0)
        lp = torch.where(valid, logits.log_softmax(1).gather(1, seq_labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
        loss = loss.index_put((torch.arange(start, stop),), ce + z)
        zloss = zloss.index_put((torch.arange(start, stop),), z.detach())
        logprob = logprob.index_put((torch.arange(start, stop),), lp.detach())
    return loss, zloss, logprob


def reduce_rows(rows, labels, offsets, reduction, denominator=None):
    valid = labels != IGNORE
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    if reduction == "mean":
        return rows.sum() / (denominator if denominator is not None else max(int(valid.sum()), 1))
    per_sequence = []
    for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        count = int(valid[start:stop].sum())
        if count:
            per_sequence.append(rows[start:stop].sum() / count)
    total = torch.stack(per_sequence).sum() if per_sequence else rows.sum() * 0
    return total / (denominator if denominator is not None else max(len(per_sequence), 1))
