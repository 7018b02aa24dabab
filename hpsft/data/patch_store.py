"""The image patches of a shard on disk, beside its tokens, memory-mapped when read.

A shard's `<shard>.patches` file holds the pixel_values of every sequence's images, float32,
[total patches, patch_dim] row-major, written sequence by sequence as they come (never all in
memory); `<shard>.patches.npz`, written after it, holds per sequence the offsets of its patches
(`patch_offsets`, [sequences + 1]) and of its images (`image_offsets`, [sequences + 1]) into the
image grids (`grid_thw`, int64 [images, 3]). Both are put in place by an atomic rename, the index
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

    def __init__(self, shard: Path, patch_dim: int):
        self.path, self.index_path = patch_paths(shard)
        self.patch_dim = patch_dim
        self.tmp = file_beside(self.path)
        self.file = open(self.tmp, "wb")
        self.patch_offsets, self.image_offsets, self.grids = [0], [0], []

    def add(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> None:
        """One sequence's images (none: a text-only sequence, zero patches)."""
        pixels = np.ascontiguousarray(pixel_values, dtype=np.float32).reshape(-1, self.patch_dim)
        grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        if int(grid_thw.prod(axis=1).sum()) != len(pixels):
            raise ValueError(f"{len(pixels)} patches for grids {grid_thw.tolist()}: they must hold t*h*w patches each")
        self.file.write(pixels.tobytes())
        self.patch_offsets.append(self.patch_offsets[-1] + len(pixels))
        self.image_offsets.append(self.image_offsets[-1] + len(grid_thw))
        self.grids += grid_thw.tolist()

    def close(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)
        tmp_index = file_beside(self.index_path)
        with open(tmp_index, "wb") as f:
            np.savez(f, patch_offsets=np.asarray(self.patch_offsets, np.int64), patch_dim=self.patch_dim,
                     image_offsets=np.asarray(self.image_offsets, np.int64),
                     grid_thw=np.asarray(self.grids, np.int64).reshape(-1, 3))
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
            self.grid_thw, patch_dim = index["grid_thw"], int(index["patch_dim"])
        total = int(self.patch_offsets[-1])
        if path.stat().st_size != total * patch_dim * 4:
            raise DataError(f"{path} has {path.stat().st_size} bytes, its index records {total} patches of "
                            f"{patch_dim} float32: prepare the data again")
        self.pixels = np.memmap(path, np.float32, "r", shape=(total, patch_dim)) if total else np.zeros((0, patch_dim),
                                                                                                       np.float32)

    def __len__(self) -> int:
        return len(self.patch_offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        patches = self.pixels[self.patch_offsets[i]:self.patch_offsets[i + 1]]
        return patches, self.grid_thw[self.image_offsets[i]:self.image_offsets[i + 1]]
