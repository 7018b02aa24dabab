"""One optimizer step's results as one rank computed them, and how the step's come from every
rank's. The same rule on both paths: the SPMD trainer all-reduces a rank's result
(`all_reduced`), the Ray driver combines its workers' (`combine`).

Each field says how it combines over ranks:
- SHARE: a count or sum over this rank's share of the global batch: added up. Every TP (and PP)
  rank of a group trained the same rows, so only one of them counts it (`counted_once`, the
  rank Mesh.reports_counts names).
- WORK: this rank's own work (FLOPs, its device's peak): added up, on every rank.
- SHARE_PER_SOURCE: a list with one SHARE value per training source, added up element-wise.
- LARGEST: the largest rank's (memory).
- SAME: the same on every rank (the global gradient norm, the learning rate): taken from one.
"""

import dataclasses
from dataclasses import dataclass, field

from hpsft.utils import distributed

SHARE, WORK, SHARE_PER_SOURCE, LARGEST, SAME = "share", "work", "share per source", "largest", "same"


def combined_as(how: str):
    return field(metadata={"over_ranks": how})


@dataclass(frozen=True)
class StepResult:
    objective_sum: float = combined_as(SHARE)  # the objective (NLL + z-loss + ...) summed over loss tokens
    nll_sum: float = combined_as(SHARE)
    z_loss_sum: float = combined_as(SHARE)
    router_aux_loss_sum: float = combined_as(SHARE)  # token-weighted over micro-batches, as the objective weighs it
    correct_tokens: int = combined_as(SHARE)
    loss_tokens: int = combined_as(SHARE)  # with SP: this rank's slices'
    tokens: int = combined_as(SHARE)
    computed_tokens: int = combined_as(SHARE)  # tokens + padding
    source_nll_sums: list = combined_as(SHARE_PER_SOURCE)
    source_loss_tokens: list = combined_as(SHARE_PER_SOURCE)
    flops: float = combined_as(WORK)
    peak_flops: float = combined_as(WORK)  # never below this step's own rate (PeakFlops.covering)
    rss_anon_bytes: int = combined_as(LARGEST)
    micro_batches: int = combined_as(SAME)
    grad_norm: float = combined_as(SAME)  # unclipped, over all ranks' gradients
    lr: float = combined_as(SAME)

    @classmethod
    def names(cls, how: str) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata["over_ranks"] == how]

    def counted_once(self, reports: bool) -> "StepResult":
        """This result on the rank that reports its group's share (`reports`), zero shares elsewhere."""
        if reports:
            return self
        return dataclasses.replace(self, **{name: 0 for name in self.names(SHARE)},
                                   **{name: [0.0] * len(getattr(self, name)) for name in self.names(SHARE_PER_SOURCE)})

    @classmethod
    def combine(cls, results: list["StepResult"]) -> "StepResult":
        """The step's result from every rank's (the Ray driver holds them all)."""
        first = results[0]
        values = {name: sum(getattr(r, name) for r in results) for name in cls.names(SHARE) + cls.names(WORK)}
        values.update({name: [sum(v) for v in zip(*(getattr(r, name) for r in results))]
                       for name in cls.names(SHARE_PER_SOURCE)})
        values.update({name: max(getattr(r, name) for r in results) for name in cls.names(LARGEST)})
        values.update({name: getattr(first, name) for name in cls.names(SAME)})
        return cls(**values)

    def all_reduced(self) -> "StepResult":
        """The step's result from this rank's, on every SPMD rank: one sum and one max
        collective (a no-op in one process, such as the Ray driver, whose worker combined the
        ranks already)."""
        summed = self.names(SHARE) + self.names(WORK)
        per_source = self.names(SHARE_PER_SOURCE)
        n_sources = len(self.source_nll_sums)
        totals = distributed.all_reduce_sum([getattr(self, n) for n in summed] +
                                            [v for n in per_source for v in getattr(self, n)])
        lists = totals[len(summed):]
        return dataclasses.replace(
            self, **dict(zip(summed, totals)),
            **{name: lists[i * n_sources:(i + 1) * n_sources] for i, name in enumerate(per_source)},
            **{name: distributed.all_reduce_max(getattr(self, name)) for name in self.names(LARGEST)})
