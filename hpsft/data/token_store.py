"""The tokenized data on disk: one Arrow IPC file per shard, memory-mapped when read.

A shard file holds one row per training sequence: `input_ids` (list of int32), `loss_mask`
(list of uint8, 1 on supervised tokens) and `row` (the row number in its input file the
sequence came from). It is written record batch by record batch (a few million tokens at a
time), so writing never holds more than one batch, and it is put in place by an atomic
rename; a sidecar `<shard>.json` written after it (also atomically) records what it holds
and is the mark that the shard is complete.

Reading maps every shard file (`pa.memory_map`): the tokens stay in the page cache, counted
as file pages, not as the process's anonymous memory, and only the sequences a rank reads
are touched. The lengths of all sequences (for sampling and balancing ranks) come from the
list offsets, without touching the tokens. Why Arrow IPC: docs/data.md ("The token store").
"""

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from hpsft.data.patch_store import MappedPatches
from hpsft.data.rows import DataError
from hpsft.utils.files import file_beside

SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())), ("row", pa.int64())])
FLUSH_TOKENS = 1 << 22  # tokens buffered before a record batch is written


class ShardWriter:
    """Sequences -> one shard file, a record batch every FLUSH_TOKENS tokens."""

    def __init__(self, path: Path):
        self.path = path
        self.tmp = file_beside(path)
        self.writer = pa.ipc.new_file(str(self.tmp), SCHEMA)
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.rows: list[int] = []
        self.buffered = 0
        self.sequences = self.tokens = self.supervised = self.longest = 0

    def add(self, input_ids: list[int], loss_mask: list[int], row: int) -> None:
        self.ids.append(np.asarray(input_ids, dtype=np.int32))
        self.masks.append(np.asarray(loss_mask, dtype=np.uint8))
        self.rows.append(row)
        self.buffered += len(input_ids)
        if self.buffered >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        lengths = np.fromiter((a.size for a in self.ids), dtype=np.int64, count=len(self.ids))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        mask_values = np.concatenate(self.masks)
        batch = pa.record_batch([
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(self.ids))),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask_values)),
            pa.array(self.rows, type=pa.int64()),
        ], schema=SCHEMA)
        self.writer.write_batch(batch)
        self.sequences += len(self.rows)
        self.tokens += int(offsets[-1])
        self.longest = max(self.longest, int(lengths.max()))
        self.supervised += int(mask_values.sum(dtype=np.int64))
        self.ids, self.masks, self.rows, self.buffered = [], [], [], 0

    def close(self) -> dict:
        """Write the rest, put the file in place; what it holds."""
        try:
            self.flush()
            self.writer.close()
            with open(self.tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return {"sequences": self.sequences, "tokens": self.tokens, "supervised_tokens": self.supervised,
                "longest": self.longest, "file_bytes": self.path.stat().st_size}

    def abort(self) -> None:
        self.tmp.unlink(missing_ok=True)


class MappedShard:
    """One shard file, mapped: per record batch the numpy views of its offsets and values."""

    def __init__(self, path: Path, expected: dict):
        problem = None
        if not path.is_file():
            problem = "it is missing"
        elif path.stat().st_size != expected["file_bytes"]:
            problem = f"it has {path.stat().st_size} bytes, {expected['file_bytes']} were written"
        if problem is None:
            try:
                reader = pa.ipc.open_file(pa.memory_map(str(path)))
                if reader.schema != SCHEMA:
                    raise pa.ArrowInvalid(f"schema {reader.schema} is not hpsft's")
                self.batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            except (pa.ArrowException, OSError) as err:
                problem = f"it is not a readable Arrow file ({err})"
        if problem is None:
            counts = (sum(b.num_rows for b in self.batches),
                      sum(len(b.column(0).values) for b in self.batches))
            if counts != (expected["sequences"], expected["tokens"]):
                problem = (f"it holds {counts[0]} sequences and {counts[1]} tokens, {expected['sequences']} and "
                           f"{expected['tokens']} were written")
        if problem is not None:
            raise DamagedShard(f"tokenized shard {path} is damaged: {problem}")
        # Zero-copy views into the mapped file (batches read back are never sliced: offsets start at 0).
        self.offsets = [b.column(0).offsets.to_numpy(zero_copy_only=True) for b in self.batches]
        self.ids = [b.column(0).values.to_numpy(zero_copy_only=True) for b in self.batches]
        self.masks = [b.column(1).values.to_numpy(zero_copy_only=True) for b in self.batches]


class DamagedShard(DataError):
    pass


class TokenStore(torch.utils.data.Dataset):
    """The sequences of a prepared store, in shard order: item i is {input_ids, loss_mask, index},
    and in a vision-language model's store (summary["images"]) its images' pixel_values
    [rows, *row_shape] and (Qwen2-VL's, not LLaVA's) image_grid_thw [images, 3], read from the
    shards' patch files (patch_store.py).

    `shard_files`: the shard files with what their sidecars say they hold. Pickles as its file
    list (a DataLoader worker maps the files again instead of copying the tokens).
    """

    def __init__(self, shard_files: list[tuple[Path, dict]], summary: dict):
        self.shard_files = shard_files
        self.summary = summary  # totals and counts of the preparation (hpsft/data/preparation.py)
        self.skipped_rows = summary["skipped_rows"]
        self.map_files()

    def map_files(self) -> None:
        offsets, ids, masks = [], [], []
        for path, expected in self.shard_files:
            shard = MappedShard(path, expected)
            offsets += shard.offsets
            ids += shard.ids
            masks += shard.masks
        self.offsets, self.ids, self.masks = offsets, ids, masks
        self.patches = [MappedPatches(path) for path, _ in self.shard_files] if "images" in self.summary else None
        self.shard_starts = np.cumsum([0] + [expected["sequences"] for _, expected in self.shard_files])
        self.lengths = np.concatenate([np.diff(o) for o in offsets]) if offsets else np.zeros(0, dtype=np.int32)
        sizes = [o.size - 1 for o in offsets]
        self.batch_starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.batch_starts[1:])

    def __getstate__(self):
        return {"shard_files": self.shard_files, "summary": self.summary, "skipped_rows": self.skipped_rows}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.map_files()

    def __len__(self) -> int:
        return int(self.batch_starts[-1])

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of sequence i's tokens and mask (in the mapped files: read-only)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} of a store of {len(self)}")
        b = int(np.searchsorted(self.batch_starts, i, side="right")) - 1
        j = i - int(self.batch_starts[b])
        start, end = int(self.offsets[b][j]), int(self.offsets[b][j + 1])
        return self.ids[b][start:end], self.masks[b][start:end]

    def image_grids(self, i: int) -> np.ndarray:
        """Sequence i's image_grid_thw rows, one per image (LLaVA's: width 0), from the patch index
        alone (for the rank balance: no pixels read)."""
        shard = int(np.searchsorted(self.shard_starts, i, side="right")) - 1
        patches, j = self.patches[shard], i - int(self.shard_starts[shard])
        return patches.grid_thw[patches.image_offsets[j]:patches.image_offsets[j + 1]]

    def __getitem__(self, i: int) -> dict:
        ids, mask = self.sequence(i)
        item = {"input_ids": torch.from_numpy(ids.astype(np.int64)),
                "loss_mask": torch.from_numpy(mask.astype(np.bool_)), "index": i}
        if self.patches is not None:
            shard = int(np.searchsorted(self.shard_starts, i, side="right")) - 1
            pixels, grids = self.patches[shard][i - int(self.shard_starts[shard])]
            item["pixel_values"] = torch.from_numpy(np.array(pixels))  # a copy: the map is read-only
            if grids.shape[1]:  # LLaVA's images have no grid (width 0)
                item["image_grid_thw"] = torch.from_numpy(np.array(grids))
        return item
