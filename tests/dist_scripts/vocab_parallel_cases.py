"""The vocabulary-parallel fused loss on each rank's shard, for every case of a spec, in one launch.

    torchrun --nproc_per_node 4 tests/dist_scripts/vocab_parallel_cases.py SPEC_PT OUT_PT

SPEC_PT holds a list of cases (tests/ops/test_vocab_parallel.py builds them): name, tp (1, 2 or
4), the whole padded weight (and bias), the rows each rank of a group holds ("shards": [(start,
rows), ...] per group rank), vocab_size, the hidden states and targets, the op's options, the
upstream gradient. Ranks form TP groups of consecutive ranks (4 ranks: one group of 4, two of 2,
four of 1); every rank runs every case in its group of the case's size, its hidden states
through sum_grad_over_tp (the caller's region of the d(hidden) contract) and its weight the
slice shards[group rank] of the padded weight. A tp=1 case also runs with tp_group=None.
OUT_PT gets {name: [per world rank {loss, z_loss, n_tokens, logprobs, correct, grad_hidden,
grad_weight, grad_bias}]} (for a grad_weight_into case grad_weight is what was added into it).
"""

import sys

import torch
import torch.distributed as dist

from hpsft.ops import varlen_linear_cross_entropy
from hpsft.ops.vocab_parallel import sum_grad_over_tp


def groups_by_size(world: int, rank: int) -> dict:
    """{size: this rank's group of consecutive ranks}; every rank creates every group, in order."""
    mine = {}
    for size in (1, 2, 4):
        if world % size:
            continue
        for first in range(0, world, size):
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                mine[size] = group
    return mine


def run_case(case: dict, group, group_rank: int) -> dict:
    start, rows = case["shards"][group_rank]
    dtype = case.get("dtype", torch.float32)
    weight = case["weight"][start:start + rows].to(dtype).clone().requires_grad_()
    bias = case["bias"][start:start + rows].to(dtype).clone().requires_grad_() if case["bias"] is not None else None
    hidden = case["hidden"].to(dtype).clone().requires_grad_()
    into = held = None
    if case.get("into"):
        held = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3 + group_rank))
        into = held.clone()
    explicit_start = {"vocab_start": start} if case.get("explicit_starts") else {}
    with torch.set_grad_enabled(not case.get("no_grad")):
        out = varlen_linear_cross_entropy(
            sum_grad_over_tp(hidden, group), weight, bias, offsets=case["offsets"], reduction=case["reduction"],
            denominator=case.get("denominator"), return_logprobs=True, return_correct=True, backend=case["backend"],
            chunk_rows=case.get("chunk_rows"), gemm_dtype=case.get("gemm_dtype"), grad_scale=case.get("grad_scale"),
            grad_weight_into=into, tp_group=group, vocab_size=case["vocab_size"], **explicit_start,
            **case["targets"], **case["options"],
        )
        if not case.get("no_grad"):
            out.loss.backward(case["upstream"])
    return {
        "loss": out.loss.detach(), "z_loss": out.z_loss, "n_tokens": out.n_tokens, "logprobs": out.logprobs,
        "correct": out.correct, "grad_hidden": hidden.grad,
        "grad_weight": into - held if into is not None else weight.grad,
        "grad_bias": bias.grad if bias is not None else None,
    }


def main(spec_path: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = groups_by_size(world, rank)
    results = {}
    for case in torch.load(spec_path):
        tp = case["tp"]
        results[case["name"]] = run_case(case, groups[tp], rank % tp)
        if tp == 1:
            results[case["name"] + " [tp_group=None]"] = run_case(case, None, 0)
    gathered = [None] * world
    dist.gather_object(results, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        torch.save({name: [ranks[name] for ranks in gathered] for name in results}, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
