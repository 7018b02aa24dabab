"""Which packed positions carry a supervised label, and what that label is.

Everything before the LM head runs on all T packed tokens; the loss only needs the N
positions that predict a supervised token. This module turns the caller's description
(input_ids + loss_mask + offsets, or explicit labels) into those N positions, their labels
and the sequence each belongs to, and rejects malformed inputs with a message that says
what to fix. The checks read their scalars back together (one small read-back for the
offsets, one for the labels' range), and finding the supervised rows (nonzero: a size that
depends on the data) is one more: on a GPU three waits for the device per call.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SupervisedPositions:
    positions: torch.Tensor  # (N,) int64: packed rows that predict a supervised token
    labels: torch.Tensor  # (N,) int64: the token each of those rows predicts
    sequence_ids: torch.Tensor  # (N,) int64: index of the sequence each row belongs to
    num_sequences: int


def check_offsets(offsets: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Validate cu_seqlens (B+1,) and return them as int64."""
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("offsets must be a 1-D tensor of cu_seqlens (B+1,), e.g. tensor([0, 5, 9])")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be int32 or int64, got {offsets.dtype}")
    offsets = offsets.long()
    first, ordered, last = torch.stack([offsets[0], (offsets[1:] >= offsets[:-1]).all(), offsets[-1]]).tolist()
    if first != 0:
        raise ValueError(f"offsets must start at 0, got {first}")
    if not ordered:
        raise ValueError(f"offsets must be non-decreasing, got {offsets.tolist()}")
    if last != total_tokens:
        raise ValueError(f"offsets must end at the number of tokens ({total_tokens}), got {last}")
    return offsets


def _check_token_vector(name: str, tensor: torch.Tensor, total_tokens: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.shape != (total_tokens,):
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must have shape ({total_tokens},) like the rows of hidden/logits, got {shape}")


def _check_label_range(labels: torch.Tensor, vocab_size: int, what: str) -> None:
    if not labels.numel():
        return
    low, high = torch.stack([labels.min(), labels.max()]).tolist()
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{what} must lie in [0, {vocab_size}) (the vocabulary of weight/logits), "
                         f"got values in [{low}, {high}]")


def _sequence_ids(positions: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # right=True puts a position that equals a sequence start into that sequence, and
    # skips zero-length sequences (their start equals the next one's).
    return torch.searchsorted(offsets, positions, right=True) - 1


def from_input_ids(input_ids, loss_mask, offsets, total_tokens: int, vocab_size: int) -> SupervisedPositions:
    """Position t predicts token t+1 of the same sequence when loss_mask[t+1] is set."""
    _check_token_vector("input_ids", input_ids, total_tokens)
    _check_token_vector("loss_mask", loss_mask, total_tokens)
    if offsets is None:
        raise ValueError("offsets (cu_seqlens) are required with input_ids/loss_mask: the shift stops at sequence ends")
    if input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    offsets = check_offsets(offsets, total_tokens)
    device = input_ids.device
    # starts[t] is True when token t opens a sequence: nothing before it may predict it.
    starts = torch.zeros(total_tokens + 1, dtype=torch.bool, device=device)
    starts[offsets] = True
    predicts = loss_mask[1:].bool() & ~starts[1:total_tokens]
    positions = torch.nonzero(predicts, as_tuple=True)[0]
    labels = input_ids[positions + 1].long()
    _check_label_range(labels, vocab_size, "supervised input_ids")
    return SupervisedPositions(positions, labels, _sequence_ids(positions, offsets), offsets.numel() - 1)


def from_labels(labels, ignore_index: int, offsets, total_tokens: int, vocab_size: int) -> SupervisedPositions:
    """Labels are already aligned with the predicting rows; ignore_index marks rows without one."""
    _check_token_vector("labels", labels, total_tokens)
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    positions = torch.nonzero(labels != ignore_index, as_tuple=True)[0]
    kept = labels[positions].long()
    _check_label_range(kept, vocab_size, f"labels (other than ignore_index={ignore_index})")
    if offsets is None:
        return SupervisedPositions(positions, kept, torch.zeros_like(positions), 1)
    offsets = check_offsets(offsets, total_tokens)
    return SupervisedPositions(positions, kept, _sequence_ids(positions, offsets), offsets.numel() - 1)
