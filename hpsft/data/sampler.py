"""Where a run is in its stream of training samples, whatever the data-parallel size.

Each epoch has one global order of the samples: a shuffle of the run's seed and the epoch
(torch.randperm seeded with seed + epoch, as torch's DistributedSampler draws it), or, for a
weighted mixture, `mixture_order`. Optimizer step k of an epoch trains on samples
[kB, (k+1)B) of that order, B = data.train_batch_size, and a last partial batch is dropped.
So a position is (epoch, samples consumed in the epoch), and a run with another number of
ranks continues from it on exactly the samples the straight run would consume next.

Each step's global batch is split over the loading processes by cost (hpsft/data/balance.py,
from the stored lengths and a vision model's stored image grids, the same on every process
without communication): the SPMD ranks take one part each, the Ray driver (one loading
process) the whole batch, which its worker group splits the same way (the same SequenceCost, from
the loaded batch's lengths and image grids).

A mixture epoch (docs/data.md, "Mixing datasets") has as many draws as the sources have
samples together. Each draw picks a source with probability weight / sum of weights
(independent draws), and takes that source's next sample in a shuffled order of it: a
source is gone through without replacement, and when exhausted it is reshuffled and gone
through again. Everything is drawn from a generator seeded with seed + epoch, so an epoch's
order is a function of (seed, epoch) alone.
"""

import torch
from torch.utils.data import Sampler

from hpsft.data.balance import SequenceCost, split_by_cost


def mixture_order(sizes: list[int], weights: list[float], seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """An epoch of a weighted mixture: sum(sizes) indices into the sources concatenated."""
    g = torch.Generator().manual_seed(seed + epoch)
    draws = sum(sizes)
    source_of_draw = torch.multinomial(torch.tensor(weights, dtype=torch.float64), draws, replacement=True,
                                       generator=g)
    order = torch.empty(draws, dtype=torch.int64)
    start = 0
    for source, size in enumerate(sizes):
        positions = torch.nonzero(source_of_draw == source, as_tuple=True)[0]
        passes = -(-positions.numel() // size)  # how often the source is gone through (maybe never)
        if passes:
            within = torch.cat([torch.randperm(size, generator=g) if shuffle else torch.arange(size)
                                for _ in range(passes)])
            order[positions] = start + within[:positions.numel()]
        start += size
    return order


def epoch_order(sizes: list[int], weights: list[float] | None, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The global order of an epoch: every sample once (shuffled or not), or a mixture's draws."""
    if weights is not None:
        return mixture_order(sizes, weights, seed, epoch, shuffle)
    if not shuffle:
        return torch.arange(sum(sizes))
    return torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(seed + epoch))


class StepBatchSampler(Sampler):
    """Yields, for each remaining step of the epoch, this process's part of the step's global
    batch: `part` of `parts` (list of dataset indices, in the global order).

    `dataset` has `sizes` (samples per source) and `sequence_lengths(indices)` (hpsft/data/
    sources.py) and `image_grids(indices)`, from which `cost` (balance.SequenceCost, default: tokens
    alone) weighs each sample."""

    def __init__(self, dataset, weights: list[float] | None, batch_size: int, part: int, parts: int,
                 shuffle: bool, seed: int, cost: SequenceCost | None = None):
        self.dataset, self.weights = dataset, weights
        self.batch_size, self.part, self.parts = batch_size, part, parts
        self.shuffle, self.seed = shuffle, seed
        self.cost = cost or SequenceCost()
        self.epoch, self.first_step = 0, 0

    def set_position(self, epoch: int, samples_consumed: int) -> None:
        """Iterate epoch `epoch` from global sample `samples_consumed` (whole steps) on."""
        if samples_consumed % self.batch_size:
            raise ValueError(f"{samples_consumed} samples are not whole steps of {self.batch_size}")
        self.epoch, self.first_step = epoch, samples_consumed // self.batch_size

    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def __len__(self) -> int:
        return max(self.steps_per_epoch() - self.first_step, 0)

    def __iter__(self):
        order = epoch_order(self.dataset.sizes, self.weights, self.seed, self.epoch, self.shuffle)
        for step in range(self.first_step, self.steps_per_epoch()):
            batch = order[step * self.batch_size:(step + 1) * self.batch_size].tolist()
            if self.parts == 1:
                yield batch
                continue
            costs = self.cost(self.dataset.sequence_lengths(batch), self.dataset.image_grids(batch))
            yield [batch[i] for i in split_by_cost(costs, self.parts)[self.part]]
