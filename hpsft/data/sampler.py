"""Where a run is in its stream of training samples, whatever the data-parallel size.

Each epoch has one global order of the samples (DistributedSampler's shuffle of the run's
seed and the epoch). Optimizer step k of an epoch trains on samples [kB, (k+1)B) of that
order, B = data.train_batch_size, for any number of ranks n: rank r takes every n-th of
them, from r on. So a position is (epoch, samples consumed in the epoch), and a run with
another n continues from it on exactly the samples the straight run would consume next.
"""

import itertools

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
