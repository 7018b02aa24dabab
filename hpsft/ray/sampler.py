"""The driver's sampler: global batches made of exactly the sequences that the SPMD ranks'
samplers pick in the same step, so both paths train on the same data."""

from torch.utils.data import Sampler

from hpsft.data.sampler import training_sampler


class RankInterleavedSampler(Sampler):
    """Step k yields rank 0's k-th batch of `batch_per_rank` indices, then rank 1's, ...;
    a loader with batch_size = dp_size * batch_per_rank then returns the SPMD global batch."""

    def __init__(self, dataset, weights: list[float] | None, dp_size: int, batch_per_rank: int, shuffle: bool,
                 seed: int):
        self.rank_samplers = [training_sampler(dataset, weights, dp_size, r, shuffle, seed) for r in range(dp_size)]
        self.batch_per_rank = batch_per_rank

    def set_position(self, epoch: int, samples_consumed: int) -> None:
        for sampler in self.rank_samplers:
            sampler.set_position(epoch, samples_consumed)

    def steps(self) -> int:
        """Full steps left in the epoch (SPMD's loaders drop a last partial batch)."""
        return len(self.rank_samplers[0]) // self.batch_per_rank

    def __len__(self) -> int:
        return self.steps() * self.batch_per_rank * len(self.rank_samplers)

    def __iter__(self):
        per_rank = [list(sampler) for sampler in self.rank_samplers]
        b = self.batch_per_rank
        for step in range(self.steps()):
            for indices in per_rank:
                yield from indices[step * b:(step + 1) * b]
