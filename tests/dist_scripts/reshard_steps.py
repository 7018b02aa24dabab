"""Optimizer steps through hpsft's DeepSpeedEngine that start from a checkpoint written by
another number of ranks, and save for the next: one launch runs a segment of every engine
variant of a chain (1 rank -> 2 ranks -> 1 rank). Rank 0 saves what each segment did.

    [torchrun --nproc_per_node N] tests/dist_scripts/reshard_steps.py SPEC_PT OUT_PT

SPEC_PT holds {"model": folder, "steps": [[row, ...] per step] (a row: {input_ids, loss_mask,
offsets, position_ids}, one micro-batch), "segments": [{"name", "engine": EngineConfig's
fields, "load": [root, tag] or None, "steps": [first, last] (1-based, inclusive), "save": [root,
tag, at_step] or None}]}. Every rank count trains the same rows: rank r of N runs rows r, r+N,
... of a step as its micro-batches, normalised by the loss tokens of the whole step, so a step's
gradient is the same sum whatever N (up to the order of the additions). OUT_PT gets {name:
{"grad_norms": {step: norm}, "stage": DeepSpeed's ZeRO stage, "optimizer": its class,
"fp32": {param: fp32 master weight after the last step}}}. (The AdamW moments are not read
back: DeepSpeed 0.19.8 links no moments to the 1-D parameters' group under ZeRO-Offload. They
show in the weights and gradient norms of the steps after a resume.)
"""

import sys

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param

from hpsft.config.schema import EngineConfig, OptimConfig
from hpsft.data.batch import IGNORE_INDEX, shifted_labels
from hpsft.utils.distributed import init_distributed, mesh
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.models import PackedCausalLM, load_causal_lm
from hpsft.workers.training_worker import token_mean_loss

# A rate that moves the tiny model's weights visibly every step, clipping that binds on some
# steps, and a cosine schedule over the 6 steps: the LR scheduler's state matters on resume.
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0, warmup_ratio=0.0)
TOTAL_STEPS = 6


def loss_tokens(row: dict) -> int:
    return int(shifted_labels(row["input_ids"][0], row["loss_mask"], row["offsets"]).ne(IGNORE_INDEX).sum())


def master_weights(engine: DeepSpeedEngine) -> dict:
    """The optimizer's fp32 weight of every parameter, whole (a collective: ZeRO assembles its
    partitions)."""
    return {name: safe_get_full_fp32_param(param).detach().cpu().clone()
            for name, param in engine.module.named_parameters()}


def run_segment(model: str, steps: list[list[dict]], segment: dict) -> dict:
    engine_config = EngineConfig(**segment["engine"])
    engine = DeepSpeedEngine(engine_config, OPTIM, total_steps=TOTAL_STEPS, mesh=mesh(engine_config))
    engine.initialize(PackedCausalLM(load_causal_lm(model, model_init=engine.model_init)))
    if segment["load"]:
        engine.load_checkpoint(*segment["load"])
    first, last = segment["steps"]
    rank, world = dist.get_rank(), dist.get_world_size()
    norms = {}
    for step in range(first, last + 1):
        rows = steps[step - 1]
        total = sum(loss_tokens(row) for row in rows)
        result = engine.train_batch(rows[rank::world], lambda out: token_mean_loss(out, total))
        norms[step] = result.grad_norm
        if segment["save"] and segment["save"][2] == step:
            engine.save_checkpoint(*segment["save"][:2])
    return {"grad_norms": norms, "stage": engine.engine.zero_optimization_stage(),
            "optimizer": type(engine.engine.optimizer).__name__, "fp32": master_weights(engine)}


def main() -> None:
    spec_pt, out_pt = sys.argv[1:3]
    init_distributed("gloo")
    spec = torch.load(spec_pt)
    results = {}
    for segment in spec["segments"]:
        print(f"segment {segment['name']}", flush=True)
        results[segment["name"]] = run_segment(spec["model"], spec["steps"], segment)
    if dist.get_rank() == 0:
        torch.save(results, out_pt)


if __name__ == "__main__":
    main()
