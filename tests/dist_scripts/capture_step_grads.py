"""One optimizer step through hpsft's DeepSpeedEngine or MegatronEngine, once per engine
variant and micro-batch count; rank 0 saves each step's gradients as the engine holds them
after accumulation and reduction (read just before the optimizer step), and the step's loss, to
a torch file.

    [torchrun --nproc_per_node N] tests/dist_scripts/capture_step_grads.py \
        SEQUENCES_PT OUT_PT MICRO_BATCHES[,MICRO_BATCHES...] VARIANT[;VARIANT...] model.path=... engine.key=value ...

A VARIANT is space-separated overrides on top of the common ones that follow (one process
start-up for every variant: each step builds its own engine anyway). SEQUENCES_PT holds a
list of {input_ids, loss_mask}: data-parallel rank r takes sequences r, r+DP, ... and splits
its share into MICRO_BATCHES packed rows, in order (every TP rank of a replica the same rows).
OUT_PT gets {variant: {micro_batches: {"grads": {name: tensor}, "loss": float, "rows": [every
data-parallel rank's rows], "weight_dtypes": [the module's], "masters_beyond_bf16": fraction
of the optimizer's master weights that bf16 cannot represent after the step}}}.

DeepSpeed's gradients are the Hugging Face parameters' whole ones (safe_get_full_grad).
Megatron's are its DDP main_grad buffers, gathered whole over DP, named "NAME@tpT.ppP" (this
TP rank's shard, this stage's layers); a Megatron step also gets "grad_dtypes" (the buffers')
"fp32_weights" (the names of its fp32 parameters) and "rows_sum": the fp64 sum of each row's gradient taken alone by the same engine with the
same weights (a step of that one row on its rank, every other rank's row weighted 0, read
before any update), so what the step adds to the rows' own bf16 gradients, accumulation over
micro-batches and reduction over ranks, is isolated (a sum with exact zeros adds no rounding,
in any precision).
"""

import sys

import torch
import torch.distributed as dist

from hpsft.config import load_config
from hpsft.data.batch import collate_jagged, loss_token_count, packed_row
from hpsft.engine.factory import engine_class
from hpsft.models import PackedCausalLM, load_causal_lm
from hpsft.utils.distributed import Mesh, init_distributed, mesh
from hpsft.workers.training_worker import token_mean_loss
from tests.dist_scripts.step_claims import released


def replica_rows(samples: list[dict], micro_batches: int, layout: Mesh) -> list[dict]:
    mine = samples[layout.dp_rank::layout.dp_size]
    splits = torch.arange(len(mine)).tensor_split(micro_batches)
    return [packed_row(collate_jagged([mine[i] for i in split.tolist()])) for split in splits]


def beyond_bf16(masters: list[torch.Tensor], group=None) -> float:
    """The fraction of these master weights' values bf16 cannot represent; with a group, of
    every rank's in it (each holding its own shards)."""
    counts = torch.tensor([sum(int((m != m.bfloat16().float()).sum()) for m in masters),
                           sum(m.numel() for m in masters)], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(counts, group=group)
    return float(counts[0] / counts[1])


def deepspeed_grads(engine) -> dict:
    from deepspeed.utils import safe_get_full_grad

    # Every rank takes part: ZeRO-2/3 assemble the partitioned gradients collectively.
    return {name: safe_get_full_grad(param).detach().cpu().clone() for name, param in engine.module.named_parameters()}


def deepspeed_masters_beyond_bf16(engine) -> float:
    from deepspeed.utils import safe_get_full_fp32_param

    # DeepSpeed starts the master weights from the bf16 ones; after a step, fp32 masters hold
    # values bf16 cannot (bf16 masters would hold none). Each rank gets them whole.
    return beyond_bf16([safe_get_full_fp32_param(p) for p in engine.module.parameters()])  # collective


def megatron_grads(engine) -> dict:
    """Every rank's main_grad buffers, whole: the distributed optimizer leaves each DP rank the
    reduced gradient of its shard only, so the shards are all-gathered (in place: the optimizer
    reads this rank's shard, unchanged). Keyed NAME@tpT.ppP; the DP replicas' are the same."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for group in engine.model.bucket_groups + engine.model.expert_parallel_bucket_groups:
        size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
        for bucket in group.buckets:
            shard = shard_buffer(bucket.grad_data, size)[rank].clone()
            dist.all_gather_into_tensor(bucket.grad_data, shard, group=group.intra_distributed_optimizer_instance_group)
    where = f"tp{engine.mesh.tp_rank}.pp{engine.mesh.pp_rank}"
    mine = {f"{name}@{where}": p.main_grad.detach().clone() for name, p in engine.module.named_parameters()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for ranks in every for k, v in ranks.items()}


def megatron_masters_beyond_bf16(engine) -> float:
    from megatron.core import parallel_state as ps

    masters = [m for chained in engine.optimizer.chained_optimizers
               for group in chained.shard_fp32_from_float16_groups for m in group]
    assert masters and all(m.dtype == torch.float32 for m in masters), sorted({str(m.dtype) for m in masters})
    return beyond_bf16(masters, group=ps.get_data_parallel_group())


def deepspeed_step_hook(engine):
    return engine.engine, "step"


def megatron_step_hook(engine):
    return engine, "optimizer_step"


# engine name: (its gradients after accumulation and reduction, its masters' fraction beyond
# bf16, (object, attribute) of the optimizer step that reads them first)
READERS = {"deepspeed": (deepspeed_grads, deepspeed_masters_beyond_bf16, deepspeed_step_hook),
           "megatron": (megatron_grads, megatron_masters_beyond_bf16, megatron_step_hook)}


def rows_sum(engine, rows: list[dict], global_loss_tokens: int) -> dict:
    """The fp64 sum of each row's gradient alone: a step per row of every replica (the owner's
    row weighted 1, the other replicas' first rows 0), its gradients read and not applied."""
    read_grads, _, hook = READERS["megatron"]
    owner, attribute = hook(engine)
    total = {}
    for owning in range(engine.mesh.dp_size):
        for i in range(len(rows)):
            mine = owning == engine.mesh.dp_rank
            captured = {}
            setattr(owner, attribute, lambda: captured.update(read_grads(engine)) or 0.0)
            engine.train_batch([rows[i] if mine else rows[0]],
                               lambda out: token_mean_loss(out, global_loss_tokens) * float(mine))
            for k, g in captured.items():
                total[k] = total.get(k, 0) + g.double()
    delattr(owner, attribute)  # the class's step again
    engine.taken = engine.updates = 0  # nothing was applied: the step that follows is the first
    return total


def one_step(config, rows: list[dict], global_loss_tokens: int) -> dict:
    read_grads, masters_beyond_bf16, hook = READERS[config.engine.name]
    engine = engine_class(config.engine.name)(config.engine, config.optim, total_steps=1, mesh=mesh(config.engine))
    engine.initialize(PackedCausalLM(load_causal_lm(config.model.path)))
    extra = {}
    if config.engine.name == "megatron":
        extra = {"rows_sum": rows_sum(engine, rows, global_loss_tokens),
                 "grad_dtypes": sorted({str(p.main_grad.dtype) for p in engine.module.parameters()}),
                 "fp32_weights": sorted(n for n, p in engine.module.named_parameters() if p.dtype == torch.float32)}
    grads = {}
    owner, attribute = hook(engine)
    take_step = getattr(owner, attribute)

    def read_grads_then_step():
        grads.update(read_grads(engine))
        return take_step()

    setattr(owner, attribute, read_grads_then_step)  # this engine instance only
    result = engine.train_batch(rows, lambda out: token_mean_loss(out, global_loss_tokens))
    reported = sum(float(o["nll"]) for o in result.outputs) if engine.mesh.reports_counts else 0.0
    loss_sum = torch.tensor(reported, dtype=torch.float64)
    dist.all_reduce(loss_sum)
    step = {
        **extra,
        "grads": grads,
        "loss": float(loss_sum) / global_loss_tokens,
        "weight_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "masters_beyond_bf16": masters_beyond_bf16(engine),
    }
    released(engine)  # the next engine builds its own (Megatron: its parallel state)
    return step


def main() -> None:
    sequences_pt, out_pt, counts, variants = sys.argv[1:5]
    common = [a for a in sys.argv[5:] if not a.startswith("--local_rank")]
    init_distributed(load_config(None, common).engine.dist_backend)
    samples = [{**s, "index": i} for i, s in enumerate(torch.load(sequences_pt))]
    global_loss_tokens = loss_token_count(collate_jagged(samples))
    results = {}
    for variant in variants.split(";"):
        config = load_config(None, [*common, *variant.split()])
        results[variant] = {}
        for count in map(int, counts.split(",")):
            layout = mesh(config.engine)
            rows = replica_rows(samples, count, layout)
            every_rank_rows = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank_rows, (layout.dp_rank, rows))
            by_replica = dict(every_rank_rows)  # every TP / PP rank of a replica has its rows
            results[variant][count] = {**one_step(config, rows, global_loss_tokens),
                                       "rows": [row for dp in sorted(by_replica) for row in by_replica[dp]]}
    if dist.get_rank() == 0:
        torch.save(results, out_pt)


if __name__ == "__main__":
    main()
