"""The training (or validation) data: one dataset per entry of data.train_files, in order,
seen as one indexable dataset whose items say which entry (source) they come from.

Item i is {input_ids, loss_mask, index: i, source: s}. With plain paths the sources are the
files concatenated, as one file holding them all would be; a weighted mixture samples from
them by weight (hpsft/data/sampler.py). Per-source losses are logged under the entries'
names. Items are checked as they are read: a custom dataset class (data.custom_cls) must
return what the built-in one does.
"""

import bisect

import numpy as np
import torch

from hpsft.data.batch import IMAGE_FIELDS
from hpsft.data.token_store import TokenStore
from hpsft.utils.errors import UserInputError


class SourcedDataset(torch.utils.data.Dataset):
    def __init__(self, datasets: list, names: list[str], max_length: int, described_by: str):
        self.datasets = datasets
        self.names = names
        self.max_length = max_length
        self.described_by = described_by  # names the dataset class in errors
        self.sizes = [len(d) for d in datasets]
        for name, size in zip(names, self.sizes):
            if size == 0:
                raise UserInputError(f"data source {name!r} ({described_by}) has no examples")
        self.starts = [0]
        for size in self.sizes:
            self.starts.append(self.starts[-1] + size)
        # The built-in store knows every length without reading tokens; a custom class does not.
        self.lengths = (np.concatenate([d.lengths for d in datasets]) if all(hasattr(d, "lengths") for d in datasets)
                        else None)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> dict:
        source = bisect.bisect_right(self.starts, i) - 1
        item = self.datasets[source][i - self.starts[source]]
        input_ids, loss_mask = self.checked(item, source, i - self.starts[source])
        images = {key: item[key] for key in IMAGE_FIELDS if key in item}  # a vision-language model's store
        return {"input_ids": input_ids, "loss_mask": loss_mask, "index": i, "source": source, **images}

    def sequence_lengths(self, indices: list[int]) -> np.ndarray:
        """Tokens of each of these samples (for balancing ranks)."""
        if self.lengths is not None:
            return self.lengths[indices]
        return np.array([self[i]["input_ids"].numel() for i in indices], dtype=np.int64)

    def image_grids(self, indices: list[int]) -> list[np.ndarray]:
        """Each of these samples' image grids, one row per image (for balancing ranks: the vision
        tower's work); a store without images, or a custom dataset class, gives none."""
        out = []
        for i in indices:
            source = bisect.bisect_right(self.starts, i) - 1
            store = self.datasets[source]
            has_images = isinstance(store, TokenStore) and store.patches is not None
            out.append(store.image_grids(i - self.starts[source]) if has_images else np.zeros((0, 3), np.int64))
        return out

    def checked(self, item, source: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        where = f"data source {self.names[source]!r} item {i} ({self.described_by})"
        if not isinstance(item, dict) or not {"input_ids", "loss_mask"} <= set(item):
            raise UserInputError(f"{where} must be a dict with 'input_ids' and 'loss_mask', got "
                                 f"{type(item).__name__}" + (f" with keys {sorted(item)}" if isinstance(item, dict)
                                                             else ""))
        input_ids, loss_mask = item["input_ids"], item["loss_mask"]
        if not (torch.is_tensor(input_ids) and input_ids.dim() == 1 and not input_ids.is_floating_point()
                and torch.is_tensor(loss_mask) and loss_mask.dim() == 1 and not loss_mask.is_floating_point()):
            raise UserInputError(f"{where}: input_ids and loss_mask must be 1-D integer (or bool) tensors")
        if input_ids.numel() != loss_mask.numel() or not 0 < input_ids.numel() <= self.max_length:
            raise UserInputError(f"{where}: input_ids ({input_ids.numel()} tokens) and loss_mask "
                                 f"({loss_mask.numel()}) must have the same length, 1 to "
                                 f"data.max_length={self.max_length}")
        return input_ids.long(), loss_mask.bool()
