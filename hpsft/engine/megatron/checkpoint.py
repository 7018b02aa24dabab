"""The Megatron engine's checkpoints: one file per rank under <tag>/megatron/, and the Hugging
Face config beside them.

  megatron/config.json         the Hugging Face config of the trained model (for export)
  megatron/rank_00000.pt ...   each rank's: its layout and place (convert.Shard, whether it is
                               its replica's first data-parallel rank), its model shard (the
                               GPTModel stage's parameters by Megatron name), each of its
                               distributed optimizers' torch Adam state and fp32 master
                               shards, and the step counts (taken; applied)

A checkpoint resumes at the layout that wrote it (TP, PP, EP and DP the same); another layout
is refused by name (resharding Megatron's distributed-optimizer state is not built yet:
docs/megatron.md). hpsft export reads any of them in one process: hf_weights reassembles each
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


def save(engine, folder: Path) -> None:
    """This rank's file (every rank writes its own; a collective: all ranks have written when it returns)."""
    from megatron.core import parallel_state as ps

    from hpsft.engine.megatron.convert import Shard

    (folder / FOLDER).mkdir(parents=True, exist_ok=True)
    if dist.get_rank() == 0:
        engine.hf_config.to_json_file(folder / FOLDER / "config.json")
    optimizers = [{"adam": chained.optimizer.state_dict(),
                   "master": [p.detach().clone() for group in chained.optimizer.param_groups for p in group["params"]]}
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
    """This rank's state from the file its rank wrote; the step count and the applied steps' count."""
    path = rank_file(folder, dist.get_rank())
    if not path.exists():
        raise UserInputError(f"{folder}: no Megatron engine state for rank {dist.get_rank()} ({path.name}): "
                             "written by another engine or another number of ranks")
    state = torch.load(path, map_location="cpu", weights_only=False)
    ours = layout_of(engine.mesh)
    if state["layout"] != ours:
        theirs = state["layout"]
        raise UserInputError(
            f"{folder} was written at world {theirs['world']}, TP {theirs['tp']}, PP {theirs['pp']}, EP {theirs['ep']}; "
            f"this run is world {ours['world']}, TP {ours['tp']}, PP {ours['pp']}, EP {ours['ep']}: the Megatron engine "
            "resumes at the layout that wrote a checkpoint (set engine.tensor_parallel_size / "
            "pipeline_parallel_size / expert_parallel_size and the number of ranks as then), or export it "
            "(hpsft export) and start a new run from the Hugging Face folder")
    params = dict(engine.module.named_parameters())
    for name, tensor in state["model"].items():
        params[name].copy_(tensor)
    for chained, saved in zip(engine.optimizer.chained_optimizers, state["optimizers"], strict=True):
        chained.optimizer.load_state_dict(saved["adam"])
        masters = [p for group in chained.optimizer.param_groups for p in group["params"]]
        for master, value in zip(masters, saved["master"], strict=True):
            master.copy_(value)
    dist.barrier()
    return state["steps"], state["updates"]


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
