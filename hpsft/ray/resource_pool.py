"""Where the ranks of a worker group run: one placement group per node, one bundle per rank.

Each node's bundles are STRICT_PACKed so that the ranks of a node share it (and its fast
links); rank r is bundle r % n_workers_per_node of node r // n_workers_per_node. A bundle
holds a GPU where the cluster has GPUs, CPUs otherwise.
"""

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    local_rank: int  # bundle index on its node
    placement_group: PlacementGroup

    def scheduling_strategy(self) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=self.local_rank,
            placement_group_capture_child_tasks=True,
        )


class RayResourcePool:
    def __init__(self, nnodes: int, n_workers_per_node: int, cpus_per_worker: float, timeout_s: float):
        self.nnodes, self.n_workers_per_node = nnodes, n_workers_per_node
        self.world_size = nnodes * n_workers_per_node
        self.use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        self.bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}
        self.placement_groups = [
            placement_group([dict(self.bundle)] * n_workers_per_node, strategy="STRICT_PACK")
            for _ in range(nnodes)
        ]
        ready, _ = ray.wait([pg.ready() for pg in self.placement_groups], num_returns=nnodes, timeout=timeout_s)
        if len(ready) < nnodes:
            self.release()
            raise RuntimeError(
                f"Ray could not place {nnodes} node(s) x {n_workers_per_node} workers of {self.bundle} "
                f"within {timeout_s:.0f} s (ray.placement_timeout_s); the cluster has {ray.cluster_resources()}, "
                f"free now {ray.available_resources()}: lower ray.n_workers_per_node or ray.cpus_per_worker"
            )

    def placements(self) -> list[RankPlacement]:
        return [
            RankPlacement(rank, rank % self.n_workers_per_node, self.placement_groups[rank // self.n_workers_per_node])
            for rank in range(self.world_size)
        ]

    def release(self) -> None:
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []
