"""The Megatron engine's checkpoints: one file per rank under <tag>/megatron/, and the Hugging
Face config beside them.

  megatron/config.json         the Hugging Face config of the trained model (for export)
  megatron/rank_00000.pt ...   each rank's: its layout and place (convert.Shard, whether it is
                               its replica's first data-parallel rank), its model shard (the
                               GPTModel stage's parameters by Megatron name), each of its
                               distributed optimizers' torch Adam state, fp32 master shards
                               and each shard's (model parameter, start, end) in its flattened
                               parameter, and the step counts (taken; applied)

A checkpoint resumes at the layout that wrote it (TP, PP, EP and DP the same) from each rank's
own file, as it was. At another layout every rank reads every file (resharded): the masters and
Adam's moments go into whole Hugging Face tensors by each shard's parameter range and
convert.pieces at the writing rank's Shard, and this rank's shards are cut from them by the same
mapping at its own Shard; the model's weights are the masters in its dtype, Adam's step count the
checkpoint's. hpsft export reads any of them in one process: hf_weights reassembles each
Hugging Face tensor from the first data-parallel replica's shards with convert.pieces, the
mapping training loads by. The files hold pickled objects beside the tensors (a checkpoint is
code, as DeepSpeed's is: docs/checkpoints.md).
"""

import dataclasses
import math
from pathlib import Path

import torch
import torch.distributed as dist

from hpsft.utils.errors import UserInputError

FOLDER = "megatron"


def rank_file(folder: Path, rank: int) -> Path:
    return folder / FOLDER / f"rank_{rank:05d}.pt"


def layout_of(mesh) -> dict:
    return {"world": mesh.world_size, "tp": mesh.tp_size, "pp": mesh.pp_size, "ep": mesh.ep_size}


def master_params(chained) -> list:
    """A distributed optimizer's fp32 master shards in torch's state-dict order (its groups' params in turn)."""
    return [p for group in chained.optimizer.param_groups for p in group["params"]]


def master_ranges(model, chained) -> list[tuple[str, int, int]]:
    """(the model parameter's name, start, end) of each master shard of master_params: the
    elements [start, end) of that parameter's flattened view this data-parallel rank updates
    (Megatron's DistributedOptimizer: model_param_group_index_map gives the shard's place in
    the optimizer's groups, _get_model_param_range_map its range in the parameter)."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = {id(p): i for i, p in enumerate(master_params(chained))}
    ranges = [None] * len(order)
    for param, (group, index) in chained.model_param_group_index_map.items():
        place = chained._get_model_param_range_map(param)["param"]
        ranges[order[id(chained.optimizer.param_groups[group]["params"][index])]] = (names[id(param)], place.start,
                                                                                    place.end)
    if None in ranges:
        raise RuntimeError("a master shard of Megatron's distributed optimizer has no model parameter")
    return ranges


def save(engine, folder: Path) -> None:
    """This rank's file (every rank writes its own; a collective: all ranks have written when it returns)."""
    from megatron.core import parallel_state as ps

    from hpsft.engine.megatron.convert import Shard

    (folder / FOLDER).mkdir(parents=True, exist_ok=True)
    if dist.get_rank() == 0:
        engine.hf_config.to_json_file(folder / FOLDER / "config.json")
    optimizers = [{"adam": chained.optimizer.state_dict(),
                   "master": [p.detach().clone() for p in master_params(chained)],
                   "ranges": master_ranges(engine.module, chained)}
                  for chained in engine.optimizer.chained_optimizers]
    state = {"layout": layout_of(engine.mesh), "shard": dataclasses.asdict(Shard.of_this_rank()),
             "dense_primary": ps.get_data_parallel_rank() == 0,
             "expert_primary": ps.get_expert_data_parallel_rank() == 0,
             "model": {name: p.detach().clone() for name, p in engine.module.named_parameters()},
             "optimizers": optimizers, "steps": engine.steps, "updates": engine.updates}
    torch.save(state, rank_file(folder, dist.get_rank()))
    dist.barrier()


@torch.no_grad()
def load(engine, folder: Path) -> tuple[int, int]:
    """This rank's state: from the file its rank wrote when the layout is the one that wrote the
    checkpoint, else resharded from every rank's file (resharded); the step count and the
    applied steps' count."""
    files = sorted((folder / FOLDER).glob("rank_*.pt"))
    if not files:
        raise UserInputError(f"{folder}: no Megatron engine state ({FOLDER}/rank_*.pt): written by another engine")
    first = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)
    if first["layout"] != layout_of(engine.mesh):
        return resharded(engine, folder, files)
    state = torch.load(rank_file(folder, dist.get_rank()), map_location="cpu", weights_only=False)
    params = dict(engine.module.named_parameters())
    for name, tensor in state["model"].items():
        params[name].copy_(tensor)
    for chained, saved in zip(engine.optimizer.chained_optimizers, state["optimizers"], strict=True):
        chained.optimizer.load_state_dict(saved["adam"])
        for master, value in zip(master_params(chained), saved["master"], strict=True):
            master.copy_(value)
    dist.barrier()
    return state["steps"], state["updates"]


MOMENTS = ("exp_avg", "exp_avg_sq")


def hf_positions(arch, shard, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """For each Megatron parameter (name: shape) of a rank at `shard`, the place of each of its
    elements in the Hugging Face tensors laid end to end in hf_tensor_names' order (int64, the
    parameter's shape), by convert.pieces; -1 where it holds none (padded vocabulary rows)."""
    from hpsft.engine.megatron.convert import hf_tensor_names, pieces

    positions = {name: torch.full(shape, -1, dtype=torch.int64) for name, shape in shapes.items()}
    offset = 0
    for name, shape in hf_tensor_names(arch):
        places = torch.arange(offset, offset + math.prod(shape)).view(shape)
        for piece in pieces(arch, name, shard):
            positions[piece.param][piece.dst] = places[piece.src]
        offset += math.prod(shape)
    return positions


def resharded(engine, folder: Path, files: list[Path]) -> tuple[int, int]:
    """Another layout's checkpoint into this rank: the fp32 master weights and Adam's moments of
    every rank's distributed-optimizer shards laid into whole Hugging Face tensors (each
    shard's parameter and range from its file, that parameter's elements' Hugging Face places
    from convert.pieces at the writing rank's Shard), then this rank's shards cut from them the
    same way at its own Shard; the model's weights are the masters in its dtype. Adam's step
    count is the checkpoint's (one for every parameter)."""
    from hpsft.engine.megatron.convert import Shard, hf_tensor_names

    arch = engine.module.hf_architecture
    total = sum(math.prod(shape) for _, shape in hf_tensor_names(arch))
    whole = {key: torch.zeros(total, dtype=torch.float32) for key in ("master", *MOMENTS)}
    written = torch.zeros(total, dtype=torch.bool)
    steps = set()
    for path in files:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        if "ranges" not in state["optimizers"][0]:
            raise UserInputError(f"{folder}: written before the Megatron engine recorded its optimizer shards' "
                                 "places; it resumes only at the layout that wrote it")
        positions = hf_positions(arch, Shard(**state["shard"]),
                                 {name: tensor.shape for name, tensor in state["model"].items()})
        for saved in state["optimizers"]:
            adam = saved["adam"]["state"]
            for i, ((name, start, end), master) in enumerate(zip(saved["ranges"], saved["master"], strict=True)):
                places = positions[name].view(-1)[start:end]
                held = places >= 0
                whole["master"][places[held]] = master[held]
                written[places[held]] = True
                for key in MOMENTS:
                    whole[key][places[held]] = adam[i][key][held] if i in adam else 0.0
                steps.add(float(adam[i]["step"]) if i in adam else 0.0)
    if not written.all():
        raise UserInputError(f"{folder}: the ranks' files give {int(written.sum())} of the model's {total} "
                             "optimizer elements: a rank's file is missing")
    if len(steps) != 1:
        raise RuntimeError(f"{folder}: the optimizer shards' Adam step counts differ: {sorted(steps)}")
    step = steps.pop()

    shapes = {name: p.shape for name, p in engine.module.named_parameters()}
    positions = hf_positions(arch, Shard.of_this_rank(), shapes)

    def cut(key: str, places: torch.Tensor) -> torch.Tensor:
        return torch.where(places >= 0, whole[key][places.clamp_min(0)], 0.0)

    for name, param in engine.module.named_parameters():
        param.copy_(cut("master", positions[name]).to(param.dtype))
    for chained in engine.optimizer.chained_optimizers:
        masters = master_params(chained)
        adam = chained.optimizer.state_dict()
        for i, ((name, start, end), master) in enumerate(zip(master_ranges(engine.module, chained), masters,
                                                             strict=True)):
            places = positions[name].view(-1)[start:end]
            master.copy_(cut("master", places))
            adam["state"][i] = {"step": torch.tensor(step), **{key: cut(key, places) for key in MOMENTS}}
        chained.optimizer.load_state_dict(adam)
    dist.barrier()
    return state["steps"], state["updates"]  # every rank's file has the same counts


def hf_weights(folder: Path) -> dict[str, torch.Tensor] | None:
    """The checkpoint's weights as whole fp32 Hugging Face tensors by the module's names (a tied
    head under lm_head.weight too, as the module's state dict has it), read in one process;
    None when `folder` holds no Megatron engine checkpoint."""
    from transformers import AutoConfig

    from hpsft.engine.megatron.architecture import architecture_of
    from hpsft.engine.megatron.convert import Shard, hf_tensor_names, is_expert_tensor, pieces

    if not (folder / FOLDER / "config.json").exists():
        return None
    arch = architecture_of(AutoConfig.from_pretrained(folder / FOLDER))
    states = [torch.load(path, map_location="cpu", mmap=True, weights_only=False)
              for path in sorted((folder / FOLDER).glob("rank_*.pt"))]
    weights = {}
    for name, shape in hf_tensor_names(arch):
        whole = torch.empty(shape, dtype=torch.float32)
        written = 0
        for state in states:
            if not state["expert_primary" if is_expert_tensor(name) else "dense_primary"]:
                continue
            for piece in pieces(arch, name, Shard(**state["shard"])):
                if arch.tied_embeddings and piece.param == "output_layer.weight":
                    continue  # the last stage's copy of the embedding
                whole[piece.src] = state["model"][piece.param][piece.dst]
                written += whole[piece.src].numel()
        if written != whole.numel():
            raise UserInputError(f"{folder}: the ranks' files give {written} of the {whole.numel()} elements of "
                                 f"{name}: a rank's file is missing")
        weights[name] = whole
    if arch.tied_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights
