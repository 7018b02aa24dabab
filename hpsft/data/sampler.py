"""Where a run is in its stream of training samples, whatever the data-parallel size.

Each epoch has one global order of the samples: DistributedSampler's shuffle of the run's
seed and the epoch, or, for a weighted mixture, `mixture_order`. Optimizer step k of an
epoch trains on samples [kB, (k+1)B) of that order, B = data.train_batch_size, for any
number of ranks n: rank r takes every n-th of them, from r on. So a position is (epoch,
samples consumed in the epoch), and a run with another n continues from it on exactly the
samples the straight run would consume next.

A mixture epoch (docs/data.md, "Mixing datasets") has as many draws as the sources have
samples together. Each draw picks a source with probability weight / sum of weights
(independent draws), and takes that source's next sample in a shuffled order of it: a
source is gone through without replacement, and when exhausted it is reshuffled and gone
through again. Everything is drawn from a generator seeded with seed + epoch, so an epoch's
order is a function of (seed, epoch) alone.
"""

import itertools

import torch
from torch.utils.data import DistributedSampler


class PositionedDistributedSampler(DistributedSampler):
    """A DistributedSampler whose epoch can start part-way, at a global sample position."""

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.start = 0

    def set_position(self, epoch: int, samples_consumed: int) -> None:
        """Iterate epoch `epoch` from global sample `samples_consumed` (a multiple of the
        number of ranks: whole steps are consumed) on."""
        if samples_consumed % self.num_replicas:
            raise ValueError(f"{samples_consumed} samples do not split over {self.num_replicas} ranks")
        self.set_epoch(epoch)
        self.start = samples_consumed // self.num_replicas  # this rank's share of them

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return max(self.num_samples - self.start, 0)


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


class MixtureSampler(PositionedDistributedSampler):
    """The same positions and rank split over `mixture_order`; `dataset` is a SourcedDataset."""

    def __init__(self, dataset, weights: list[float], num_replicas: int, rank: int, shuffle: bool, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.sizes, self.weights = dataset.sizes, weights

    def __iter__(self):
        order = mixture_order(self.sizes, self.weights, self.seed, self.epoch, self.shuffle)
        first = self.rank + self.start * self.num_replicas
        return iter(order[first:self.total_size:self.num_replicas].tolist())


def training_sampler(dataset, weights: list[float] | None, num_replicas: int, rank: int, shuffle: bool,
                     seed: int) -> PositionedDistributedSampler:
    """Rank `rank`'s sampler: a weighted mixture when weights are given, else every sample
    once an epoch."""
    if weights is None:
        return PositionedDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
    return MixtureSampler(dataset, weights, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
