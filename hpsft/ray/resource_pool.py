"""Where the ranks of a worker group run: one placement-group bundle per node, spread over
distinct nodes, holding that node's ranks.

One STRICT_SPREAD placement group of `nnodes` bundles, each the resources of
`n_workers_per_node` ranks: every bundle is on another node, so ray.nnodes=2 means two
machines (not two groups that happen to fit on one), and the ranks of a node share it (and
its fast links). Rank r runs in bundle r // n_workers_per_node, as local rank
r % n_workers_per_node: a node's ranks are consecutive, so a tensor-parallel group (TP
consecutive ranks, TP dividing n_workers_per_node) is in one bundle. A rank takes a GPU where
the cluster has GPUs, CPUs otherwise.
"""

from dataclasses import dataclass

import ray
from ray._private.state import available_resources_per_node
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: int  # bundle index: the group's node index
    local_rank: int  # rank among the node's ranks
    placement_group: PlacementGroup

    def scheduling_strategy(self) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=self.node,
            placement_group_capture_child_tasks=True,
        )


def resources_per_node() -> str:
    """Each alive node's address, total and free resources (CPU, GPU, memory left out)."""
    free = available_resources_per_node()

    def shown(resources: dict) -> dict:
        return {k: v for k, v in resources.items() if not k.startswith("node:") and "memory" not in k}

    return "; ".join(
        f"node {n['NodeManagerAddress']} ({n['NodeID'][:8]}): total {shown(n['Resources'])}, "
        f"free {shown(free.get(n['NodeID'], {}))}"
        for n in ray.nodes() if n["Alive"]
    )


class RayResourcePool:
    def __init__(self, nnodes: int, n_workers_per_node: int, cpus_per_worker: float, timeout_s: float):
        self.nnodes, self.n_workers_per_node = nnodes, n_workers_per_node
        self.world_size = nnodes * n_workers_per_node
        self.use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        self.bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}  # one rank's
        node_bundle = {k: v * n_workers_per_node for k, v in self.bundle.items()}
        self.placement_group = placement_group([dict(node_bundle)] * nnodes, strategy="STRICT_SPREAD")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if not ready:
            nodes = resources_per_node()  # before release: the pending group holds nothing
            self.release()
            raise RuntimeError(
                f"Ray could not place {nnodes} node(s) with {node_bundle} each ({n_workers_per_node} workers of "
                f"{self.bundle}), on distinct nodes, within {timeout_s:g} s (ray.placement_timeout_s). Per node: "
                f"{nodes}. Lower ray.nnodes, ray.n_workers_per_node or ray.cpus_per_worker, add nodes, or wait "
                "for the others' jobs to end"
            )

    def placements(self) -> list[RankPlacement]:
        return [
            RankPlacement(rank, rank // self.n_workers_per_node, rank % self.n_workers_per_node, self.placement_group)
            for rank in range(self.world_size)
        ]

    def release(self) -> None:
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
        self.placement_group = None
