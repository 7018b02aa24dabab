"""How batches reach the device a rank trains on: the one decision of what is pinned and prefetched.

On a CUDA device the host side of the next step runs while this one computes: the DataLoader's
worker processes load and collate the next batches from the token store (`prefetch_factor`
each) while the main process trains, and the packed rows the engine gets are pinned (page-locked)
host memory, so that its `non_blocking` host->device copies are real DMA transfers that return
at once instead of staging through pageable memory. Elsewhere nothing changes: a CPU run has no
copy to overlap, and `pin_memory()` needs an accelerator. docs/performance.md says what
overlaps what.
"""

from dataclasses import dataclass

import torch

PREFETCH_FACTOR = 2  # batches each loader worker keeps ready: the next step's and one more


@dataclass(frozen=True)
class DeviceFeed:
    pin_rows: bool  # packed rows built in pinned host memory
    min_loader_workers: int  # at least this many DataLoader worker processes


def device_feed(device: torch.device | str) -> DeviceFeed:
    """What a rank whose engine runs on `device` pins and prefetches (a string names a device
    type: the decision needs no device, so a CPU test reads a CUDA run's)."""
    if torch.device(device).type == "cuda":
        return DeviceFeed(pin_rows=True, min_loader_workers=1)
    return DeviceFeed(pin_rows=False, min_loader_workers=0)


def loader_options(feed: DeviceFeed, num_workers: int) -> dict:
    """DataLoader keyword arguments: data.num_workers, raised to the feed's minimum. Workers
    stay up across epochs (no restart at each epoch's first batch). The batch sampler runs in
    the main process either way: prefetching moves no data position (the trainer counts the
    samples of the batches it has trained on, and a resume starts the sampler there)."""
    workers = max(num_workers, feed.min_loader_workers)
    if workers == 0:
        return {"num_workers": 0}
    return {"num_workers": workers, "prefetch_factor": PREFETCH_FACTOR, "persistent_workers": True}


def pinned(row: dict, feed: DeviceFeed) -> dict:
    """A packed row (data/batch.py: packed_row, data/sequence_split.py: split_row) with its
    tensors in pinned memory when the feed pins, else the row itself."""
    if not feed.pin_rows:
        return row
    return {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in row.items()}
