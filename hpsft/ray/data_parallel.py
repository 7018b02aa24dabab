"""The worker group seen from the driver as one Worker (hpsft/workers/base.py) that takes whole
global batches.

The driver sees every sequence of a step, so it computes lengths and the step's loss-token
count itself (no all-gather), splits the batch into per-rank shards balanced by cost
(hpsft/data/balance.py: the SPMD sampler's SequenceCost, tokens plus a vision tower's work on
the images, from the batch's lengths and image grids: the split the SPMD ranks compute),
sends each rank its shard and gathers the results. Which rank gets which sequence does not
change the step: the loss is normalised by the loss tokens of the whole global batch.
With sequence, tensor or pipeline parallelism the batch is split over the data-parallel ranks
of the workers' Mesh (the one the SPMD ranks build, distributed.workers_mesh) and every rank
gets its data-parallel rank's shard; an SP rank returns its slices' share of the per-sequence
results, which add up, and of a TP (PP) group only the rank Mesh.reports_counts names returns
counts (the others zeros: TrainingWorker), so the sums count each row once.
"""

import torch

from hpsft.data.balance import SequenceCost, split_by_cost
from hpsft.data.batch import image_grids, loss_token_count, select, seqlens
from hpsft.ray.worker_group import PerRank, RayWorkerGroup
from hpsft.utils.distributed import Mesh
from hpsft.workers.base import Worker
from hpsft.workers.step_result import StepResult


class DataParallelWorker(Worker):
    def __init__(self, group: RayWorkerGroup, mesh: Mesh, cost: SequenceCost):
        self.group = group
        self.mesh = mesh  # the workers' (the driver has no rank in it)
        self.cost = cost  # the trainer's, its sampler's too

    def shard(self, batch) -> tuple[list[list[int]], PerRank]:
        """The sample positions of each rank's shard, and the shards (one per rank)."""
        costs = self.cost(seqlens(batch).numpy(), image_grids(batch))
        dp_positions = split_by_cost(costs, self.mesh.dp_size)
        positions = [dp_positions[self.mesh.at(rank).dp_rank] for rank in range(self.mesh.world_size)]
        return positions, PerRank(select(batch, p) for p in positions)

    def global_loss_tokens(self, batch) -> int:
        return loss_token_count(batch)

    def train_batch(self, batch, global_loss_tokens: int) -> StepResult:
        _, shards = self.shard(batch)
        return StepResult.combine(self.group.train_batch(shards, global_loss_tokens=global_loss_tokens).get())

    def infer_batch(self, batch) -> dict:
        """Per-sequence results of every rank, put back in the batch's order (the shares of a
        sequence from its group's ranks added up)."""
        positions, shards = self.shard(batch)
        outs = self.group.infer_batch(shards).get()
        gathered = {}
        for key, first in outs[0].items():
            gathered[key] = torch.zeros(batch.batch_size[0], dtype=first.dtype)
            for rank_positions, out in zip(positions, outs):
                gathered[key][torch.as_tensor(rank_positions, dtype=torch.int64)] += out[key]
        return gathered

    def start_profiler(self, folder: str, ranks: list[int], first_step: int) -> None:
        self.group.start_profiler(folder, ranks, first_step).get()

    def stop_profiler(self) -> None:
        self.group.stop_profiler().get()

    def save_checkpoint(self, root: str, tag: str) -> None:
        self.group.save_checkpoint(root, tag).get()

    def load_checkpoint(self, root: str, tag: str) -> None:
        self.group.load_checkpoint(root, tag).get()

    def export_hf(self, out_dir: str, tokenizer, progress: bool = False) -> None:
        # rank 0 writes; every rank gathers. Its bar shows only if the actor's stderr is a terminal.
        self.group.export_hf(out_dir, tokenizer, progress=progress).get()
