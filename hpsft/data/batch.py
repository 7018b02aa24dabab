"""Jagged batches: samples -> a TensorDict of nested tensors (layout torch.jagged).

Nothing is padded. All fields share one set of offsets (the batch's cu_seqlens), so
`batch["input_ids"].offsets()` describes every field. Per sequence: `index` (its position
in the dataset) and `source` (which data.train_files/val_files entry it comes from; a sample
that does not say is from the first). A vision-language model's batch (samples with
`pixel_values` [rows, *row_shape] and, Qwen2-VL's, `image_grid_thw` [images, 3]: token_store.py)
also holds those as jagged fields with their own offsets (rows, images per sequence), so that
selecting sequences selects their images.
"""

import numpy as np
import torch
from tensordict import TensorDict

FIELDS = ("input_ids", "loss_mask", "position_ids")
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")


def jagged_batch(input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor,
                 source: torch.Tensor) -> TensorDict:
    """Build a batch from flat values and offsets (offsets[0] == 0, offsets[-1] == numel)."""
    lengths = offsets.diff()
    starts = torch.repeat_interleave(offsets[:-1], lengths)
    position_ids = torch.arange(input_ids.numel(), dtype=torch.int64) - starts
    offsets = offsets.to(torch.int64)
    fields = {
        name: torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
        for name, values in (("input_ids", input_ids), ("loss_mask", loss_mask), ("position_ids", position_ids))
    }
    fields["index"] = index
    fields["source"] = source
    return TensorDict(fields, batch_size=[offsets.numel() - 1])


def collate_jagged(samples: list[dict]) -> TensorDict:
    """Dataloader collate_fn: a list of {input_ids, loss_mask, index, source?, and for a
    vision-language model pixel_values, image_grid_thw} -> jagged TensorDict."""
    batch = jagged_batch(
        torch.cat([s["input_ids"] for s in samples]),
        torch.cat([s["loss_mask"] for s in samples]),
        offsets_of([s["input_ids"].shape[0] for s in samples]),
        torch.tensor([s["index"] for s in samples], dtype=torch.int64),
        torch.tensor([s.get("source", 0) for s in samples], dtype=torch.int64),
    )
    if samples and "pixel_values" in samples[0]:
        for name in (name for name in IMAGE_FIELDS if name in samples[0]):
            batch[name] = torch.nested.nested_tensor_from_jagged(
                torch.cat([s[name] for s in samples]), offsets=offsets_of([s[name].shape[0] for s in samples]))
    return batch


def offsets_of(lengths: list[int]) -> torch.Tensor:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return offsets


def empty_batch() -> TensorDict:
    return jagged_batch(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool),
        torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
    )


def seqlens(batch: TensorDict) -> torch.Tensor:
    if batch.batch_size[0] == 0:
        return torch.zeros(0, dtype=torch.int64)
    return batch["input_ids"].offsets().diff()


def target_mask(loss_mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Tokens that are predicted targets: loss_mask without each sequence's first token
    (nothing before it in its sequence predicts it). Shapes only, no data-dependent size: on
    a GPU no wait for the device (an empty sequence's start is the next one's, or T)."""
    starts = torch.zeros(loss_mask.numel() + 1, dtype=torch.bool, device=loss_mask.device)
    starts[offsets[:-1]] = True
    return torch.where(starts[:-1], torch.zeros_like(loss_mask), loss_mask)


IGNORE_INDEX = -100  # the label of a position that predicts no supervised token


def shifted_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(T,) the token each position of a packed row predicts: the next token of its own
    sequence where that token is supervised, IGNORE_INDEX elsewhere (a sequence's last
    position never predicts the next sequence's first token). Taken on the whole row, the
    labels stay right when the row is later cut (sequence_split.py): a slice's last position
    keeps the label of a token that lives on the next slice. No host sync (target_mask)."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    targets = target_mask(loss_mask.bool(), offsets)
    labels[:-1] = torch.where(targets[1:], input_ids[1:], IGNORE_INDEX)
    return labels


def image_grids(batch: TensorDict) -> list[np.ndarray]:
    """Each sequence's image grids, one row per image, as TokenStore.image_grids gives them (LLaVA's,
    with no image_grid_thw: width 0): what the rank balance weighs a loaded batch's images by."""
    lengths = seqlens(batch)
    if "pixel_values" not in batch.keys():
        return [np.zeros((0, 3), np.int64) for _ in lengths]
    if "image_grid_thw" not in batch.keys():
        return [np.zeros((int(n), 0), np.int64) for n in batch["pixel_values"].offsets().diff()]
    grids = batch["image_grid_thw"]
    offsets, values = grids.offsets().tolist(), grids.values().numpy()
    return [values[start:end] for start, end in zip(offsets[:-1], offsets[1:])]


def loss_token_count(batch: TensorDict) -> int:
    if batch.batch_size[0] == 0:
        return 0
    return int(target_mask(batch["loss_mask"].values(), batch["input_ids"].offsets()).sum())


def select(batch: TensorDict, indices) -> TensorDict:
    """Sub-batch of the given sample positions, in that order."""
    indices = torch.as_tensor(indices, dtype=torch.int64)
    if indices.numel() == 0:
        return empty_batch()
    return batch[indices]


def longest_sequence(offsets: torch.Tensor) -> int:
    """The longest sequence of a row's offsets (0 without any): what varlen attention kernels
    take as a host number. Read from CPU offsets, before they go to the device."""
    return int(offsets.diff().max()) if offsets.numel() > 1 else 0


def packed_row(batch: TensorDict) -> dict:
    """One packed row for the model: (1, T) input_ids/position_ids, flat loss_mask, offsets,
    and max_length, the longest sequence (a host int: the forward needs no read-back of it).

    An empty batch becomes a single unsupervised token, so that every rank still runs a
    forward and backward (ZeRO's collectives need every rank in every micro-step).
    """
    if batch.batch_size[0] == 0:
        return {
            "input_ids": torch.zeros(1, 1, dtype=torch.int64),
            "position_ids": torch.zeros(1, 1, dtype=torch.int64),
            "loss_mask": torch.zeros(1, dtype=torch.bool),
            "offsets": torch.tensor([0, 1], dtype=torch.int64),
            "max_length": 1,
        }
    offsets = batch["input_ids"].offsets()
    row = {
        "input_ids": batch["input_ids"].values().unsqueeze(0),
        "position_ids": batch["position_ids"].values().unsqueeze(0),
        "loss_mask": batch["loss_mask"].values(),
        "offsets": offsets,
        "max_length": longest_sequence(offsets),
    }
    # A vision row: its sequences' images in row order (packed_vision_lm.py's contract; LLaVA's
    # without image_grid_thw); none when no sequence of it has an image.
    if "pixel_values" in batch.keys() and batch["pixel_values"].values().shape[0] > 0:
        row.update({name: batch[name].values() for name in IMAGE_FIELDS if name in batch.keys()})
    return row
