"""Two optimizer steps through hpsft's DeepSpeedEngine for each of several layouts of the
same ranks (data-parallel x sequence-parallel), on given packed rows; rank 0 saves each
layout's per-step losses and the gradients of the first step (read just before the
optimizer step, as DeepSpeed holds them after reduction) to a torch file.

    torchrun --nproc_per_node N tests/dist_scripts/sequence_parallel_steps.py SPEC_PT OUT_PT

SPEC_PT holds {"sequences": [{input_ids, loss_mask}] (a vision-language model's: also each
sequence's pixel_values and image_grid_thw, empty without images), "steps": [[row, ...], ...] (a row: the
sequence indices packed into it), "layouts": [{"name", "model", "zero_stage", "sp"}]}. With
SP ranks per group there are N/SP data-parallel ranks: dp rank d trains rows d, d+N/SP, ...
of a step (the rows are the same on every SP rank of a group, and each trains its slice:
exactly what TrainingWorker does after planning the rows); "checkpointing": true in a layout
turns on activation checkpointing, "tiled_mlp_tokens": N tiles the MLPs. OUT_PT gets {name: {"losses":
[per step], "grads": {param: tensor}, "forwards": decoder forwards, "tile_counts": tile counts decided
(agreed_tiles calls: under ZeRO-3 each is an all-reduce)}}.
"""

import sys

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

from hpsft.utils import distributed
from hpsft.config import load_config
from hpsft.data.batch import collate_jagged, loss_token_count, packed_row
from hpsft.data.sequence_split import split_row
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.models import PackedCausalLM, load_causal_lm
from hpsft.models import tiled_mlp
from hpsft.models.packed_vision_lm import PackedVisionLM, is_vision_language
from hpsft.models.tiled_mlp import tile_mlps
from hpsft.workers.training_worker import token_mean_loss


def rank_rows(samples: list[dict], rows: list[list[int]], sp: int, sp_group) -> list[dict]:
    place = distributed.Mesh.of_world(distributed.world_size(), distributed.rank(), sp_size=sp)
    packed = [packed_row(collate_jagged([samples[i] for i in row])) for row in rows[place.dp_rank::place.dp_size]]
    return [split_row(row, place.sp_rank, sp) for row in packed] if sp > 1 else packed


def run_layout(layout: dict, samples: list[dict], steps: list[list[list[int]]]) -> dict:
    config = load_config(None, [f"model.path={layout['model']}", f"engine.zero_stage={layout['zero_stage']}",
                                f"model.gradient_checkpointing={str(layout.get('checkpointing', False)).lower()}",
                                "optim.lr=1e-2", "optim.warmup_ratio=0", "optim.lr_scheduler=constant"])
    sp = layout["sp"]
    place = distributed.Mesh.of_world(distributed.world_size(), distributed.rank(), sp_size=sp)
    engine = DeepSpeedEngine(config.engine, config.optim, total_steps=len(steps), mesh=place)
    lm = load_causal_lm(config.model.path, gradient_checkpointing=config.model.gradient_checkpointing)
    model = PackedVisionLM(lm) if is_vision_language(lm) else PackedCausalLM(lm)
    engine.initialize(model)
    forwards, tile_counts = [], []
    if layout.get("tiled_mlp_tokens"):
        tile_mlps(model.lm, layout["tiled_mlp_tokens"])
        model.lm.get_decoder().register_forward_pre_hook(lambda *_: forwards.append(1))
        tiled_mlp.agreed_tiles = counted(AGREED_TILES, tile_counts)
    sp_group = distributed.sequence_parallel_group(place) if sp > 1 else None
    if sp > 1:
        model.enable_sequence_parallel(sp_group, sp, place.sp_rank)
    grads = {}
    take_step = engine.engine.step

    def read_grads_then_step():
        if not grads:  # the first step's; every rank takes part (ZeRO-2/3 assemble them collectively)
            for name, param in engine.module.named_parameters():
                grads[name] = safe_get_full_grad(param).detach().cpu().clone()
        take_step()

    engine.engine.step = read_grads_then_step  # this engine instance only
    losses = []
    for rows in steps:
        total = loss_token_count(collate_jagged([samples[i] for row in rows for i in row]))
        result = engine.train_batch(rank_rows(samples, rows, sp, sp_group), lambda out: token_mean_loss(out, total))
        nll = torch.tensor(sum(float(o["nll"]) for o in result.outputs), dtype=torch.float64)
        dist.all_reduce(nll)  # every rank's share: its slices of its rows
        losses.append(float(nll) / total)
    return {"losses": losses, "grads": grads, "forwards": len(forwards), "tile_counts": len(tile_counts)}


AGREED_TILES = tiled_mlp.agreed_tiles


def counted(function, calls: list):
    def call(*args):
        calls.append(1)
        return function(*args)
    return call


def main() -> None:
    spec_pt, out_pt = sys.argv[1:3]
    distributed.init_distributed("gloo")
    spec = torch.load(spec_pt)
    samples = [{**s, "index": i} for i, s in enumerate(spec["sequences"])]
    results = {layout["name"]: run_layout(layout, samples, spec["steps"]) for layout in spec["layouts"]}
    if dist.get_rank() == 0:
        torch.save(results, out_pt)


if __name__ == "__main__":
    main()
