"""One optimizer step through hpsft's DeepSpeedEngine, once per engine variant and
micro-batch count; rank 0 saves each step's gradients as DeepSpeed holds them after
accumulation and reduction (read just before the optimizer step), and the step's loss, to a
torch file.

    [torchrun --nproc_per_node N] tests/dist_scripts/capture_step_grads.py \
        SEQUENCES_PT OUT_PT MICRO_BATCHES[,MICRO_BATCHES...] VARIANT[;VARIANT...] model.path=... engine.key=value ...

A VARIANT is space-separated overrides on top of the common ones that follow (one process
start-up for every variant: each step builds its own engine anyway). SEQUENCES_PT holds a
list of {input_ids, loss_mask}: rank r takes sequences r, r+N, ... and splits its share
into MICRO_BATCHES packed rows, in order. OUT_PT gets {variant: {micro_batches: {"grads":
{name: tensor}, "loss": float, "rows": [every rank's rows], "weight_dtypes": [the
module's], "masters_beyond_bf16": fraction of the optimizer's master weights that bf16
cannot represent after the step}}}.
"""

import sys

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

from hpsft.config import load_config
from hpsft.data.batch import collate_jagged, loss_token_count, packed_row
from hpsft.utils.distributed import init_distributed, mesh
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.models import PackedCausalLM, load_causal_lm
from hpsft.workers.training_worker import token_mean_loss


def rank_rows(samples: list[dict], micro_batches: int) -> list[dict]:
    mine = samples[dist.get_rank()::dist.get_world_size()]
    splits = torch.arange(len(mine)).tensor_split(micro_batches)
    return [packed_row(collate_jagged([mine[i] for i in split.tolist()])) for split in splits]


def one_step(config, rows: list[dict], global_loss_tokens: int) -> dict:
    engine = DeepSpeedEngine(config.engine, config.optim, total_steps=1, mesh=mesh(config.engine))
    engine.initialize(PackedCausalLM(load_causal_lm(config.model.path)))
    grads = {}
    take_step = engine.engine.step

    def read_grads_then_step():
        # Every rank takes part: ZeRO-2/3 assemble the partitioned gradients collectively.
        for name, param in engine.module.named_parameters():
            grads[name] = safe_get_full_grad(param).detach().cpu().clone()
        take_step()

    engine.engine.step = read_grads_then_step  # this engine instance only
    result = engine.train_batch(rows, lambda out: token_mean_loss(out, global_loss_tokens))
    loss_sum = torch.tensor(sum(float(o["nll"]) for o in result.outputs), dtype=torch.float64)
    dist.all_reduce(loss_sum)
    # DeepSpeed starts the master weights from the bf16 ones; after a step, fp32 masters hold
    # values bf16 cannot (bf16 masters would hold none).
    masters = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]  # collective
    return {
        "grads": grads,
        "loss": float(loss_sum) / global_loss_tokens,
        "weight_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "masters_beyond_bf16": sum(int((m != m.bfloat16().float()).sum()) for m in masters)
        / sum(m.numel() for m in masters),
    }


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
            rows = rank_rows(samples, count)
            every_rank_rows = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank_rows, rows)
            results[variant][count] = {**one_step(config, rows, global_loss_tokens),
                                       "rows": [row for ranks_rows in every_rank_rows for row in ranks_rows]}
    if dist.get_rank() == 0:
        torch.save(results, out_pt)


if __name__ == "__main__":
    main()
