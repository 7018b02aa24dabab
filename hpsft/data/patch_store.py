"""The image patches of a shard on disk, beside its tokens, memory-mapped when read.

A shard's `<shard>.patches` file holds the pixel_values of every sequence's images, float32,
[total rows, *row_shape] row-major, written sequence by sequence as they come (never all in
memory): Qwen2-VL's rows are patches (row_shape (patch_dim,)), LLaVA's whole images
(row_shape (C, H, W)); `<shard>.patches.npz`, written after it, holds the row shape, and per
sequence the offsets of its rows (`patch_offsets`, [sequences + 1]) and of its images
(`image_offsets`, [sequences + 1]) into the image grids (`grid_thw`, int64 [images, grid_width]:
Qwen2-VL's (t, h, w), t*h*w rows per image; LLaVA's width 0, one row per image). Both are put in place by an atomic rename, the index
last, so a shard whose index exists is complete (resumed by shard as the token files are).
"""

import os
from pathlib import Path

import numpy as np

from hpsft.data.rows import DataError
from hpsft.utils.files import file_beside


def patch_paths(shard: Path) -> tuple[Path, Path]:
    return shard.with_name(shard.name + ".patches"), shard.with_name(shard.name + ".patches.npz")


class PatchWriter:
    """Sequences' (pixel_values, grid_thw) -> one shard's patch file and its index, in sequence order."""

    def __init__(self, shard: Path, row_shape: tuple[int, ...], grid_width: int):
        self.path, self.index_path = patch_paths(shard)
        self.row_shape, self.grid_width = tuple(row_shape), grid_width
        self.tmp = file_beside(self.path)
        self.file = open(self.tmp, "wb")
        self.patch_offsets, self.image_offsets, self.grids = [0], [0], []

    def add(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> None:
        """One sequence's images (none: a text-only sequence, zero patches)."""
        pixels = np.ascontiguousarray(pixel_values, dtype=np.float32).reshape(-1, *self.row_shape)
        grid_thw = np.asarray(grid_thw, dtype=np.int64)
        if grid_thw.ndim != 2 or grid_thw.shape[1] != self.grid_width:
            raise ValueError(f"grids of shape {grid_thw.shape}: (images, {self.grid_width}) expected")
        if int(grid_thw.prod(axis=1).sum()) != len(pixels):  # a width-0 grid's product is 1: a row per image
            raise ValueError(f"{len(pixels)} rows of pixel_values for grids {grid_thw.tolist()}: they must hold "
                             "t*h*w rows each")
        self.file.write(pixels.tobytes())
        self.patch_offsets.append(self.patch_offsets[-1] + len(pixels))
        self.image_offsets.append(self.image_offsets[-1] + len(grid_thw))
        self.grids.append(grid_thw)

    def close(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)
        tmp_index = file_beside(self.index_path)
        with open(tmp_index, "wb") as f:
            np.savez(f, patch_offsets=np.asarray(self.patch_offsets, np.int64),
                     row_shape=np.asarray(self.row_shape, np.int64),
                     image_offsets=np.asarray(self.image_offsets, np.int64),
                     grid_thw=np.concatenate([np.zeros((0, self.grid_width), np.int64), *self.grids]))
        os.replace(tmp_index, self.index_path)


    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class MappedPatches:
    """One shard's patches, mapped: sequence i -> (pixel_values, grid_thw) as they were written."""

    def __init__(self, shard: Path):
        path, index_path = patch_paths(shard)
        if not index_path.is_file():
            raise DataError(f"the image patches of {shard} are missing ({index_path}): prepare the data again")
        with np.load(index_path) as index:
            self.patch_offsets, self.image_offsets = index["patch_offsets"], index["image_offsets"]
            self.grid_thw, row_shape = index["grid_thw"], tuple(int(n) for n in index["row_shape"])
        total = int(self.patch_offsets[-1])
        if path.stat().st_size != total * int(np.prod(row_shape)) * 4:
            raise DataError(f"{path} has {path.stat().st_size} bytes, its index records {total} rows of "
                            f"{row_shape} float32: prepare the data again")
        shape = (total, *row_shape)
        self.pixels = np.memmap(path, np.float32, "r", shape=shape) if total else np.zeros(shape, np.float32)

    def __len__(self) -> int:
        return len(self.patch_offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        patches = self.pixels[self.patch_offsets[i]:self.patch_offsets[i + 1]]
        return patches, self.grid_thw[self.image_offsets[i]:self.image_offsets[i + 1]]
