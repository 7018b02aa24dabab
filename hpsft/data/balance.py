"""A global batch split over data-parallel ranks so that every rank carries about the same
work: the slowest rank sets the step, and dealing every n-th sequence leaves the others idle
(on real ShareGPT lengths the busiest of 8 ranks x 8 sequences carried 1.28x the mean).

Both paths weigh a sequence with the same SequenceCost: the SPMD ranks each compute the whole
split from the stored lengths and image grids of the step's global batch (the same on every
rank, no communication) and take their part; the Ray driver splits the batch it loaded, from
that batch's lengths and image grids. Which rank trains which sequence does not change the
step: the loss is normalised by the loss tokens of the whole global batch.
"""

import heapq

import numpy as np

MAX_SWAP_PAIRS = 1 << 16  # parts larger than this (256 x 256 sequences) balance well by the greedy pass alone


def sequence_costs(lengths, attention_hidden_size: int | None = None, image_costs=None) -> np.ndarray:
    """The work of each sequence: its tokens, or with `attention_hidden_size` h its tokens
    plus attention's quadratic term, L * (1 + L / (6h)) (attention's score and value matmuls,
    4hL^2 flops, against a dense layer's 24h^2 flops per token); plus `image_costs`, the vision
    tower's work on each sequence's images in decoder tokens (hpsft/models/vision_cost.py)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    costs = lengths if attention_hidden_size is None else lengths * (1.0 + lengths / (6.0 * attention_hidden_size))
    return costs if image_costs is None else costs + np.asarray(image_costs, dtype=np.float64)


class SequenceCost:
    """How the balance weighs each sequence of a step, the one rule of both paths: its tokens,
    with `attention_hidden_size` (data.balance=attention) attention's quadratic term, plus with
    `tower_cost` (a vision model's VisionTowerCost, hpsft/models/vision_cost.py) the tower's work
    on its images."""

    def __init__(self, attention_hidden_size: int | None = None, tower_cost=None):
        self.attention_hidden_size, self.tower_cost = attention_hidden_size, tower_cost

    def __call__(self, lengths, image_grids: list[np.ndarray]) -> np.ndarray:
        """`image_grids`: each sequence's image grids, one row per image (TokenStore.image_grids)."""
        images = None
        if self.tower_cost is not None:
            images = [self.tower_cost.sequence_cost(grids) for grids in image_grids]
        return sequence_costs(lengths, self.attention_hidden_size, images)


def split_by_cost(costs, n_parts: int) -> list[list[int]]:
    """`n_parts` lists of positions into `costs` whose sizes differ by at most one (every rank
    then runs the same number of sequences, and of fixed-size micro-batches) and whose costs
    are balanced: longest first onto the least-loaded part that still has room, then pairs
    swapped between the heaviest and the lightest part while that narrows the gap. Each list is
    in increasing order; the split depends on the costs alone."""
    costs = np.asarray(costs, dtype=np.float64)
    n = costs.size
    capacity = [n // n_parts + (r < n % n_parts) for r in range(n_parts)]
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    loads = [0.0] * n_parts
    open_parts = [(0.0, r) for r in range(n_parts)]  # (load, part) of the parts with room
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(open_parts)
        parts[r].append(i)
        loads[r] = load + costs[i]
        if len(parts[r]) < capacity[r]:
            heapq.heappush(open_parts, (loads[r], r))
    improve_by_swaps(costs, parts, loads)
    return [sorted(part) for part in parts]


def improve_by_swaps(costs: np.ndarray, parts: list[list[int]], loads: list[float], rounds: int = 64) -> None:
    """Swap one sequence of the heaviest part for one of the lightest (sizes stay) while that
    lowers the heavier of the two: greedy leaves a few percent on heavy-tailed lengths."""
    for _ in range(rounds):
        heavy, light = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[heavy] - loads[light]
        pairs = len(parts[heavy]) * len(parts[light])
        if gap <= 0 or pairs == 0 or pairs > MAX_SWAP_PAIRS:
            return
        h = np.asarray(parts[heavy], dtype=np.int64)
        lt = np.asarray(parts[light], dtype=np.int64)
        # Moving d = cost[a] - cost[b] from heavy to light leaves a gap |gap - 2d|: best d near gap / 2.
        diff = costs[h][:, None] - costs[lt][None, :]
        score = np.where(diff > 0, np.abs(gap - 2 * diff), np.inf)
        a, b = np.unravel_index(int(np.argmin(score)), score.shape)
        if not score[a, b] < gap:
            return
        parts[heavy][a], parts[light][b] = int(lt[b]), int(h[a])
        loads[heavy] -= diff[a, b]
        loads[light] += diff[a, b]
