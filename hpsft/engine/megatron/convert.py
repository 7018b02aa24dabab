"""Hugging Face weights <-> this rank's Megatron-Core GPTModel shard, one tensor at a time.

A hand mapping per family (Megatron-Bridge declares Python >= 3.12 and pulls CUDA builds):
`pieces(arch, hf_name, shard)` says which slices of one Hugging Face tensor (by the module's
own parameter names, as `hpsft.models.weight_names` lists them) a rank at `shard` holds, and
where in which of its Megatron parameters. Both directions read it:

  load_hf_weights(model, hf_tensor)   each rank fetches the Hugging Face tensors it holds a part
                                      of, one at a time, and copies its slices in
                                      (hf_folder_tensor(folder) reads them from a HF folder)
  gathered_hf_tensors(model)          (name, whole tensor) on rank 0, one at a time, from the
                                      ranks that hold its parts (one data-parallel replica's)

The layout (Megatron's, TP = tensor-parallel size, r = TP rank):
  q/k/v_proj      linear_qkv, per query group g: [q heads of g; k_g; v_g]; a rank holds
                  groups r*G/TP .. (r+1)*G/TP - 1 (their bias likewise)
  o_proj          linear_proj, input columns split over TP
  gate/up_proj    linear_fc1 = [gate rows of r; up rows of r] (each half split over TP)
  down_proj       linear_fc2, input columns split over TP
  embed_tokens    embedding.word_embeddings, vocabulary rows split over TP after padding to
  lm_head         output_layer                model.padded_vocab_size; padded rows are zero
  norms, router, q/k norm, shared-expert gate   replicated
  experts         expert e lives on EP rank e // (E/EP) as local_experts.{e % (E/EP)}, its
                  fc1/fc2 split over TP like the dense MLP's
  layers          layer l on pipeline stage l // (L/PP) as decoder.layers.{l % (L/PP)}
A tied head at PP > 1: the last stage's output_layer is a second copy of the embedding
(Megatron keeps their gradients summed); it is loaded from embed_tokens too and never exported.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from hpsft.engine.megatron.architecture import Architecture

ALL = slice(None)


@dataclass(frozen=True)
class Shard:
    """A rank's place in the layout (the ranks within each parallel group, and their sizes)."""
    tp: int
    tp_size: int
    pp: int
    pp_size: int
    ep: int
    ep_size: int
    etp: int  # the experts' tensor-parallel rank and size (Megatron's default: the TP size)
    etp_size: int

    @classmethod
    def of_this_rank(cls) -> "Shard":
        from megatron.core import parallel_state as ps

        return cls(tp=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                   pp=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
                   ep=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                   etp=ps.get_expert_tensor_parallel_rank(),
                   etp_size=ps.get_expert_tensor_parallel_world_size())


@dataclass(frozen=True)
class Piece:
    param: str  # the Megatron parameter's name on the rank holding it
    dst: tuple  # where in that parameter
    src: tuple  # where in the Hugging Face tensor


def hf_tensor_names(arch: Architecture) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face model's parameters (name, shape), in its module order."""
    h, d, i = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    names = [("model.embed_tokens.weight", (arch.vocab_size, h))]
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        for proj, heads in (("q", arch.num_heads), ("k", arch.num_kv_heads), ("v", arch.num_kv_heads)):
            names.append((f"{p}self_attn.{proj}_proj.weight", (heads * d, h)))
            if arch.qkv_bias:
                names.append((f"{p}self_attn.{proj}_proj.bias", (heads * d,)))
        names.append((f"{p}self_attn.o_proj.weight", (h, arch.num_heads * d)))
        if arch.qk_norm:
            names += [(f"{p}self_attn.q_norm.weight", (d,)), (f"{p}self_attn.k_norm.weight", (d,))]
        moe = arch.moe
        if moe is not None and moe.layers[layer]:
            e, mi = moe.num_experts, moe.ffn_hidden_size
            names += [(f"{p}mlp.gate.weight", (e, h)), (f"{p}mlp.experts.gate_up_proj", (e, 2 * mi, h)),
                      (f"{p}mlp.experts.down_proj", (e, h, mi))]
            if moe.shared_ffn_hidden_size:
                si = moe.shared_ffn_hidden_size
                names += [(f"{p}mlp.shared_expert.gate_proj.weight", (si, h)),
                          (f"{p}mlp.shared_expert.up_proj.weight", (si, h)),
                          (f"{p}mlp.shared_expert.down_proj.weight", (h, si))]
                if moe.shared_gate:
                    names.append((f"{p}mlp.shared_expert_gate.weight", (1, h)))
        else:
            names += [(f"{p}mlp.gate_proj.weight", (i, h)), (f"{p}mlp.up_proj.weight", (i, h)),
                      (f"{p}mlp.down_proj.weight", (h, i))]
        names += [(f"{p}input_layernorm.weight", (h,)), (f"{p}post_attention_layernorm.weight", (h,))]
    names.append(("model.norm.weight", (h,)))
    if not arch.tied_embeddings:
        names.append(("lm_head.weight", (arch.vocab_size, h)))
    return names


def chunk(n: int, rank: int, size: int) -> slice:
    """Rank's contiguous 1/size of n."""
    k = n // size
    return slice(rank * k, (rank + 1) * k)


def vocabulary_piece(arch: Architecture, param: str, shard: Shard) -> list[Piece]:
    from hpsft.engine.megatron.model import padded_vocab_size

    rows = padded_vocab_size(arch.vocab_size, shard.tp_size) // shard.tp_size
    start = shard.tp * rows
    valid = max(0, min(rows, arch.vocab_size - start))
    return [Piece(param, (slice(0, valid),), (slice(start, start + valid),))] if valid else []


def qkv_pieces(arch: Architecture, param: str, proj: str, shard: Shard) -> list[Piece]:
    """q, k or v of this rank's query groups into linear_qkv's [q_g; k_g; v_g] blocks."""
    d, groups = arch.head_dim, arch.num_kv_heads
    per_group = arch.num_heads // groups  # query heads per key/value head
    block = (per_group + 2) * d
    offset, width = {"q": (0, per_group * d), "k": (per_group * d, d), "v": ((per_group + 1) * d, d)}[proj]
    local_groups = groups // shard.tp_size
    out = []
    for j in range(local_groups):
        g = shard.tp * local_groups + j
        out.append(Piece(param, (slice(j * block + offset, j * block + offset + width),),
                         (slice(g * width, (g + 1) * width),)))
    return out


def gated_fc1_pieces(param: str, half: str, rows: int, tp: int, tp_size: int, src_prefix: tuple = ()) -> list[Piece]:
    """gate or up (rows each) into linear_fc1 = [gate shard; up shard]; src_prefix selects an
    expert of a fused [E, 2 * rows, H] tensor (whose rows are [gate; up])."""
    local = rows // tp_size
    dst = slice(0, local) if half == "gate" else slice(local, 2 * local)
    src = chunk(rows, tp, tp_size)
    if src_prefix and half == "up":
        src = slice(rows + src.start, rows + src.stop)
    return [Piece(param, (dst,), (*src_prefix, src))]


def pieces(arch: Architecture, name: str, shard: Shard) -> list[Piece]:
    """What a rank at `shard` holds of the Hugging Face tensor `name` (empty: nothing)."""
    first, last = shard.pp == 0, shard.pp == shard.pp_size - 1
    if name == "model.embed_tokens.weight":
        held = vocabulary_piece(arch, "embedding.word_embeddings.weight", shard) if first else []
        if arch.tied_embeddings and last and shard.pp_size > 1:
            held += vocabulary_piece(arch, "output_layer.weight", shard)  # the last stage's copy
        return held
    if name == "lm_head.weight":
        return vocabulary_piece(arch, "output_layer.weight", shard) if last else []
    if name == "model.norm.weight":
        return [Piece("decoder.final_layernorm.weight", (ALL,), (ALL,))] if last else []

    _, _, layer, rest = name.split(".", 3)
    per_stage = arch.num_layers // shard.pp_size
    if int(layer) // per_stage != shard.pp:
        return []
    p = f"decoder.layers.{int(layer) % per_stage}."
    whole = lambda param: [Piece(p + param, (ALL,), (ALL,))]  # noqa: E731 (a replicated tensor)
    tp, tps = shard.tp, shard.tp_size
    dense = {
        "input_layernorm.weight": lambda: whole("input_layernorm.weight"),
        "post_attention_layernorm.weight": lambda: whole("pre_mlp_layernorm.weight"),
        "self_attn.q_norm.weight": lambda: whole("self_attention.q_layernorm.weight"),
        "self_attn.k_norm.weight": lambda: whole("self_attention.k_layernorm.weight"),
        "self_attn.o_proj.weight": lambda: [Piece(p + "self_attention.linear_proj.weight", (ALL,),
                                                  (ALL, chunk(arch.num_heads * arch.head_dim, tp, tps)))],
        "mlp.gate_proj.weight": lambda: gated_fc1_pieces(p + "mlp.linear_fc1.weight", "gate", arch.ffn_hidden_size,
                                                         tp, tps),
        "mlp.up_proj.weight": lambda: gated_fc1_pieces(p + "mlp.linear_fc1.weight", "up", arch.ffn_hidden_size,
                                                       tp, tps),
        "mlp.down_proj.weight": lambda: [Piece(p + "mlp.linear_fc2.weight", (ALL,),
                                               (ALL, chunk(arch.ffn_hidden_size, tp, tps)))],
        "mlp.gate.weight": lambda: whole("mlp.router.weight"),
        "mlp.shared_expert_gate.weight": lambda: whole("mlp.shared_experts.gate_weight"),
    }
    if rest in dense:
        return dense[rest]()
    if rest.startswith("self_attn.") and rest.endswith(("_proj.weight", "_proj.bias")):
        proj, kind = rest[len("self_attn.")], rest.rsplit(".", 1)[1]
        return qkv_pieces(arch, p + f"self_attention.linear_qkv.{kind}", proj, shard)
    if rest.startswith("mlp.shared_expert."):
        si = arch.moe.shared_ffn_hidden_size
        fc1 = p + "mlp.shared_experts.linear_fc1.weight"
        if rest == "mlp.shared_expert.down_proj.weight":
            return [Piece(p + "mlp.shared_experts.linear_fc2.weight", (ALL,), (ALL, chunk(si, tp, tps)))]
        return gated_fc1_pieces(fc1, "gate" if "gate_proj" in rest else "up", si, tp, tps)
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return expert_pieces(arch, p, rest, shard)
    raise KeyError(f"no Megatron mapping for the Hugging Face tensor {name!r}")


def expert_pieces(arch: Architecture, prefix: str, rest: str, shard: Shard) -> list[Piece]:
    """This EP rank's experts of a fused [E, ...] Hugging Face tensor, each split over the
    experts' TP group as the dense MLP is."""
    moe = arch.moe
    local = moe.num_experts // shard.ep_size
    out = []
    for j in range(local):
        e = shard.ep * local + j
        p = f"{prefix}mlp.experts.local_experts.{j}."
        if rest == "mlp.experts.down_proj":
            out.append(Piece(p + "linear_fc2.weight", (ALL,),
                             (e, ALL, chunk(moe.ffn_hidden_size, shard.etp, shard.etp_size))))
        else:
            for half in ("gate", "up"):
                out += gated_fc1_pieces(p + "linear_fc1.weight", half, moe.ffn_hidden_size, shard.etp,
                                        shard.etp_size, src_prefix=(e,))
    return out


def is_expert_tensor(name: str) -> bool:
    return ".mlp.experts." in name


def check_stage_layers(model, arch: Architecture, shard: Shard) -> None:
    """The mapping's layer placement (l // (L/PP)) must be Megatron's own for this stage."""
    per_stage = arch.num_layers // shard.pp_size
    numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
    expected = list(range(shard.pp * per_stage, (shard.pp + 1) * per_stage))
    if numbers != expected:
        raise RuntimeError(f"pipeline stage {shard.pp} holds layers {numbers}, the mapping expects {expected}")


@torch.no_grad()
def load_hf_weights(model, hf_tensor: Callable[[str], torch.Tensor]) -> None:
    """Fill this rank's model from Hugging Face tensors: `hf_tensor(name)` returns one (by the
    HF module's parameter name), called only for the tensors this rank holds a part of, once
    each. Every element of every Megatron parameter is written (padded vocabulary rows with 0)."""
    arch, shard = model.hf_architecture, Shard.of_this_rank()
    check_stage_layers(model, arch, shard)
    params = dict(model.named_parameters())
    written = {name: 0 for name in params}
    for param in params.values():
        param.zero_()
    for name, shape in hf_tensor_names(arch):
        held = pieces(arch, name, shard)
        if not held:
            continue
        tensor = hf_tensor(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"Hugging Face tensor {name}: shape {tuple(tensor.shape)}, the config says {shape}")
        for piece in held:
            target = params[piece.param][piece.dst]
            target.copy_(tensor[piece.src])
            written[piece.param] += target.numel()
        del tensor
    padded = {"embedding.word_embeddings.weight", "output_layer.weight"}
    missing = [n for n, count in written.items() if count != params[n].numel() and n not in padded]
    if missing:
        raise RuntimeError(f"Megatron parameters not (wholly) written from the Hugging Face weights: {missing}")


def gathered_hf_tensors(model, tensor_of: Callable[[str, torch.nn.Parameter], torch.Tensor] = None
                        ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, whole Hugging Face tensor) on rank 0 and (name, None) elsewhere, one tensor at a
    time in the HF module order; a collective (every rank iterates to the end). Each part comes
    from the first data-parallel replica holding it (the experts' data-parallel group for
    experts) over point-to-point sends to rank 0. `tensor_of(name, param)` picks what is
    gathered (default the weights; e.g. the gradients)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tensor_of = tensor_of or (lambda name, param: param)
    arch, me = model.hf_architecture, dist.get_rank()
    params = dict(model.named_parameters())
    mine = (Shard.of_this_rank(), ps.get_data_parallel_rank() == 0, ps.get_expert_data_parallel_rank() == 0)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    device = next(model.parameters()).device
    for name, shape in hf_tensor_names(arch):
        whole = torch.empty(shape, dtype=next(model.parameters()).dtype) if me == 0 else None
        for rank, (shard, dense_primary, expert_primary) in enumerate(everyone):
            if not (expert_primary if is_expert_tensor(name) else dense_primary):
                continue
            for piece in pieces(arch, name, shard):
                if arch.tied_embeddings and piece.param == "output_layer.weight":
                    continue  # the last stage's copy of the embedding
                if rank == me:
                    part = tensor_of(piece.param, params[piece.param])[piece.dst].detach()
                    if me == 0:
                        whole[piece.src].copy_(part)
                    else:
                        dist.send(part.contiguous(), dst=0)
                elif me == 0:
                    part = torch.empty(whole[piece.src].shape, dtype=whole.dtype, device=device)
                    dist.recv(part, src=rank)
                    whole[piece.src].copy_(part)
        yield name, whole


# The per-expert names Hugging Face checkpoints store MoE experts under (what save_pretrained
# writes and the Hub holds; transformers 5 fuses them into gate_up_proj / down_proj at load):
# (fused module tensor) -> (checkpoint tensor of expert e) for its [gate; up] halves or down.
LEGACY_EXPERTS = {
    "mixtral": {"gate_up_proj": ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
                "down_proj": ("block_sparse_moe.experts.{e}.w2.weight",)},
    "qwen2_moe": {"gate_up_proj": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
                  "down_proj": ("mlp.experts.{e}.down_proj.weight",)},
}
LEGACY_ROUTER = {"mixtral": "block_sparse_moe.gate.weight"}


def hf_folder_tensor(folder, arch: Architecture) -> Callable[[str], torch.Tensor]:
    """`tensor(name)` for load_hf_weights from a Hugging Face folder's safetensors, read one
    tensor at a time (memory-mapped): a module name as stored (hpsft's exports), or, for MoE
    experts and Mixtral's router, from the per-expert checkpoint layout (save_pretrained, the
    Hub): the fused [E, 2I, H] gate_up_proj as [w_gate_e; w_up_e] per expert, down_proj [E, H, I]."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (json.loads(index.read_text())["weight_map"] if index.exists()
             else {name: "model.safetensors" for name in safe_open(folder / "model.safetensors", "pt").keys()})

    def read(name: str) -> torch.Tensor:
        with safe_open(folder / files[name], "pt") as f:
            return f.get_tensor(name)

    def tensor(name: str) -> torch.Tensor:
        if name in files:
            return read(name)
        layer = re.match(r"model\.layers\.(\d+)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)$", name)
        if layer is None or arch.family not in LEGACY_EXPERTS:
            raise KeyError(f"{folder}: no tensor {name!r} in its safetensors")
        prefix = f"model.layers.{layer.group(1)}."
        if layer.group(2) == "gate.weight":
            return read(prefix + LEGACY_ROUTER[arch.family])
        parts = LEGACY_EXPERTS[arch.family][layer.group(3)]
        return torch.stack([torch.cat([read(prefix + part.format(e=e)) for part in parts])
                            for e in range(arch.moe.num_experts)])

    return tensor
