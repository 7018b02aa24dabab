"""Split one rank's share of a global batch into micro-batches.

Either a fixed number of sequences per micro-batch, or a token budget: sequences are
bin-packed (first-fit decreasing for the count, then a longest-first balance over that
many bins) so that each micro-batch stays under `max_tokens` and loads are even. Every
data-parallel rank must run the same number of micro-batches (ZeRO's collectives run in
every forward/backward), so the count is agreed first and short ranks get empty bins.
"""

import heapq

from hpsft.utils.errors import UserInputError


def fixed_size_bins(n: int, micro_batch_size: int) -> list[list[int]]:
    return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]


def first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    for i, length in enumerate(lengths):
        if length > max_tokens:
            raise UserInputError(
                f"sequence {i} has {length} tokens > data.max_tokens_per_micro_batch={max_tokens}; "
                "raise the budget or lower data.max_length"
            )
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def balanced_bins(lengths: list[int], num_bins: int) -> list[list[int]]:
    """Longest-first onto the least-loaded bin (greedy number partitioning)."""
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def min_micro_batches(lengths: list[int], micro_batch_size: int | None, max_tokens: int | None) -> int:
    """The fewest micro-batches this rank can run its sequences in."""
    if max_tokens is not None:
        return len(first_fit_decreasing(lengths, max_tokens))
    return len(fixed_size_bins(len(lengths), micro_batch_size))


def plan_micro_batches(
    lengths: list[int], num_bins: int, micro_batch_size: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Exactly `num_bins` lists of sample positions (some possibly empty); each sample once.

    Within a bin, samples keep their original relative order.
    """
    if max_tokens is not None:
        bins = balanced_bins(lengths, num_bins)
        if any(sum(lengths[i] for i in b) > max_tokens for b in bins):
            bins = first_fit_decreasing(lengths, max_tokens)
    else:
        bins = fixed_size_bins(len(lengths), micro_batch_size)
    if len(bins) > num_bins:
        raise ValueError(f"{len(bins)} micro-batches needed but only {num_bins} agreed")
    bins = [sorted(b) for b in bins] + [[] for _ in range(num_bins - len(bins))]
    return bins
