"""Cut one packed row along its tokens across a sequence-parallel (SP) group.

Each of the SP ranks of a group holds the same packed row (the same data-parallel share of
the batch) and keeps one contiguous slice of it: rank r the tokens [r*L, (r+1)*L), L the
padded row length / SP. A cut may fall anywhere: inside a sequence, at a sequence boundary,
or around a whole sequence shorter than SP. What crosses a cut is made explicit here:

- labels are computed on the whole row before the cut (batch.shifted_labels), so a slice's
  last position carries the label of the token that opens the next slice;
- every rank keeps the row's full `offsets`: attention gathers the whole row back per head
  group (models/ulysses_attention.py) and needs the exact sequence boundaries there;
- position ids are the row's, cut like the tokens (rotary runs on each rank's slice);
- a vision-language row's images (pixel_values, image_grid_thw) go whole to every rank, with
  the whole (padded) row's tokens (`row_input_ids`): the model runs its tower on all of them,
  finds the image tokens and computes Qwen2-VL's 3-D positions on the whole row, and keeps the
  features of its slice's image tokens, an image cut by the slice boundary giving its features
  to both ranks (packed_vision_lm.py), with no collective. A text decoder ignores them.

The row is padded to a multiple of SP by extending its last sequence with unsupervised
tokens (label IGNORE_INDEX, positions continuing that sequence's): causal attention keeps
every real token's output unchanged (no real token sees a later one), the boundaries stay
those of the real sequences, and the padding counts as computed-but-not-real tokens.
"""

import torch

from hpsft.data.batch import IGNORE_INDEX, IMAGE_FIELDS, longest_sequence, shifted_labels

PAD_TOKEN = 0  # any valid id: padded positions are never predicted and never predict


def padded_length(length: int, sp_size: int) -> int:
    return -(-length // sp_size) * sp_size


def slice_bounds(length: int, sp_rank: int, sp_size: int) -> tuple[int, int]:
    """[start, stop) of this SP rank's slice of a row of `length` tokens, once padded."""
    local = padded_length(length, sp_size) // sp_size
    return sp_rank * local, (sp_rank + 1) * local


def real_tokens(length: int, sp_rank: int, sp_size: int) -> int:
    """How many of this rank's slice are the row's own tokens, not padding."""
    start, stop = slice_bounds(length, sp_rank, sp_size)
    return max(0, min(stop, length) - start)


def split_row(row: dict, sp_rank: int, sp_size: int) -> dict:
    """This SP rank's slice of a packed row (packed_row's dict): input_ids and position_ids
    (1, L), labels (L,), the padded whole row's offsets and their longest sequence,
    `slice_start`, where the slice begins in the row, and `row_input_ids`, the padded whole row's
    (1, SP * L) tokens; a vision-language row's images whole."""
    input_ids, position_ids = row["input_ids"][0], row["position_ids"][0]
    labels = shifted_labels(input_ids, row["loss_mask"], row["offsets"])
    length = input_ids.numel()
    pad = padded_length(length, sp_size) - length
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_full((pad,), PAD_TOKEN)])
        position_ids = torch.cat([position_ids, position_ids[-1] + torch.arange(1, pad + 1, dtype=position_ids.dtype)])
        labels = torch.cat([labels, labels.new_full((pad,), IGNORE_INDEX)])
    offsets = row["offsets"].clone()
    offsets[-1] += pad  # the last sequence absorbs the padding
    start, stop = slice_bounds(length, sp_rank, sp_size)
    return {
        "input_ids": input_ids[start:stop].unsqueeze(0),
        "position_ids": position_ids[start:stop].unsqueeze(0),
        "labels": labels[start:stop],
        "offsets": offsets,
        "max_length": longest_sequence(offsets),  # the padding lengthens the last sequence
        "slice_start": start,
        "row_input_ids": input_ids.unsqueeze(0),
        **{name: row[name] for name in IMAGE_FIELDS if name in row},
    }
