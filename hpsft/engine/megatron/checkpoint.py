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
own file, as it was. At another layout every rank reads every file, memory-mapped (resharded),
one Hugging Face tensor at a time: its masters and Adam's moments are built whole by each
shard's parameter range and convert.pieces at the writing rank's Shard, this rank's slices cut
from them by the same mapping at its own Shard, and the tensor freed; the model's weights are
the masters in its dtype, Adam's step count the checkpoint's. hpsft export reads any of them in one process: hf_weights reassembles each
Hugging Face tensor from the first data-parallel replica's shards with convert.pieces, the
mapping training loads by. The files hold pickled objects beside the tensors (a checkpoint is
code, as DeepSpeed's is: docs/checkpoints.md).
"""

import dataclasses
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
KEYS = ("master", *MOMENTS)  # what resharding carries of each optimizer element


def flat_positions(shape: torch.Size, dst: tuple) -> torch.Tensor:
    """The index in the flattened parameter (of `shape`) of each element of parameter[dst]
    (int64, that view's shape), from the view's offset and strides: a meta tensor, so nothing
    of the parameter's size is allocated."""
    view = torch.empty(shape, device="meta")[dst]
    flat = torch.tensor(view.storage_offset())
    for size, stride in zip(view.shape, view.stride()):
        flat = flat.unsqueeze(-1) + torch.arange(size) * stride
    return flat


def held_in_range(shape: torch.Size, dst: tuple, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of parameter[dst], the elements an optimizer shard covering [start, end) of the flattened
    parameter holds (a mask of that view's shape) and their offsets in the shard."""
    flat = flat_positions(shape, dst)
    inside = (flat >= start) & (flat < end)
    return inside, flat[inside] - start


def file_shards(state: dict) -> dict[str, tuple[int, int, dict]]:
    """A rank file's distributed-optimizer shards by model parameter name: (start, end, the
    shard's master and moments by KEYS; a moment None before Adam's first step)."""
    shards = {}
    for saved in state["optimizers"]:
        adam = saved["adam"]["state"]
        for i, ((name, start, end), master) in enumerate(zip(saved["ranges"], saved["master"], strict=True)):
            shards[name] = (start, end, {"master": master, **{key: adam[i][key] if i in adam else None
                                                              for key in MOMENTS}})
    return shards


def resharded(engine, folder: Path, files: list[Path]) -> tuple[int, int]:
    """Another layout's checkpoint into this rank, one Hugging Face tensor at a time: its fp32
    master weights and Adam's moments built whole from every rank's file (each shard's
    parameter and range from its file, the parameter's slices of the tensor from
    convert.pieces at the writing rank's Shard), this rank's slices of it cut into its model
    parameters and optimizer shards the same way at its own Shard, then freed; the files are
    memory-mapped, so at most one tensor's three fp32 copies are built at once. The model's
    weights are the masters in its dtype; Adam's step count is the checkpoint's (one for every
    parameter)."""
    from hpsft.engine.megatron.convert import Shard, hf_tensor_names, pieces

    arch = engine.module.hf_architecture
    states = [torch.load(path, map_location="cpu", mmap=True, weights_only=False) for path in files]
    if any("ranges" not in state["optimizers"][0] for state in states):
        raise UserInputError(f"{folder}: written before the Megatron engine recorded its optimizer shards' "
                             "places; it resumes only at the layout that wrote it")
    writers = [(Shard(**state["shard"]), file_shards(state),
                {name: tensor.shape for name, tensor in state["model"].items()}) for state in states]
    steps = {float(saved["adam"]["state"][i]["step"]) if i in saved["adam"]["state"] else 0.0
             for state in states for saved in state["optimizers"] for i in range(len(saved["master"]))}
    if len(steps) != 1:
        raise RuntimeError(f"{folder}: the optimizer shards' Adam step counts differ: {sorted(steps)}")
    step = steps.pop()

    params = dict(engine.module.named_parameters())
    own, adams = {}, []  # this rank's shards by parameter name; each optimizer's state to load
    for chained in engine.optimizer.chained_optimizers:
        adam = chained.optimizer.state_dict()
        for i, ((name, start, end), master) in enumerate(zip(master_ranges(engine.module, chained),
                                                             master_params(chained), strict=True)):
            adam["state"][i] = {"step": torch.tensor(step), **{key: torch.zeros_like(master) for key in MOMENTS}}
            own[name] = (start, end, {"master": master, **{key: adam["state"][i][key] for key in MOMENTS}})
        adams.append((chained, adam))
    for name, param in params.items():  # padded vocabulary rows: in no Hugging Face tensor, zero
        param.zero_()
        if name in own:
            own[name][2]["master"].zero_()

    shard = Shard.of_this_rank()
    for hf_name, shape in hf_tensor_names(arch):
        mine = pieces(arch, hf_name, shard)
        if not mine:
            continue
        whole = {key: torch.zeros(shape, dtype=torch.float32) for key in KEYS}
        written = torch.zeros(shape, dtype=torch.bool)
        for writer, shards, shapes in writers:
            for piece in pieces(arch, hf_name, writer):
                if piece.param not in shards:
                    continue  # this writer's optimizer shard holds none of that parameter
                start, end, values = shards[piece.param]
                inside, offsets = held_in_range(shapes[piece.param], piece.dst, start, end)
                for key in KEYS:
                    if values[key] is not None:
                        whole[key][piece.src][inside] = values[key][offsets].float()
                written[piece.src][inside] = True
        if not written.all():
            raise UserInputError(f"{folder}: the ranks' files give {int(written.sum())} of the {written.numel()} "
                                 f"optimizer elements of {hf_name}: a rank's file is missing")
        for piece in mine:
            param = params[piece.param]
            param[piece.dst] = whole["master"][piece.src].to(param.dtype)
            if piece.param in own:
                start, end, targets = own[piece.param]
                inside, offsets = held_in_range(param.shape, piece.dst, start, end)
                for key in KEYS:
                    targets[key][offsets] = whole[key][piece.src][inside]
        del whole, written
    for chained, adam in adams:
        chained.optimizer.load_state_dict(adam)
    dist.barrier()
    return states[0]["steps"], states[0]["updates"]  # every rank's file has the same counts


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
