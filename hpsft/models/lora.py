"""LoRA adapters (PEFT) injected into a Hugging Face causal LM, and the model they make.

The adapters go into the model itself (`peft.inject_adapter_in_model`), not around it: the
model stays the transformers class hpsft packs and exports, its decoder and LM head are where
they were, and its parameter names are the Hugging Face ones with PEFT's layer in between
(`...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`). PEFT marks only the
adapters trainable. Only `nn.Linear` layers of the decoder may be adapted: hpsft's fused loss
reads the LM head's weight as a tensor, so an adapter on it would be silently skipped.

On a vision-language model (Qwen2-VL, Qwen2.5-VL, LLaVA) the adapters go on the language model
only: its vision tower and projector are PEFT's `exclude_modules` (kept in the adapter folder's
config, so PEFT loads the adapters onto the same layers), frozen like the rest of the base. Without
it `all-linear`, or a suffix such as `q_proj` (LLaVA's CLIP tower has q_proj/k_proj/v_proj too),
would silently adapt the tower as well. Every listed target must name a layer of the language
model, or it is refused (a name the decoder does not have would otherwise be silently dropped).

With `model.lora.use_dora` each adapted layer also has PEFT's DoRA magnitude, one value per
output (`...q_proj.lora_magnitude_vector.default.weight`, trained like A and B): the layer's
weight is magnitude * (W + scaling * B @ A) / ||W + scaling * B @ A||, the norm of each output's
row, which PEFT treats as a constant in the backward (the DoRA paper's section 4.3).

Two outputs a LoRA run can be exported to (end of run and `hpsft export`):
- the merged model: each adapted weight W replaced by W + scaling * B @ A (DoRA: that times
  magnitude / its row norms), written under the base model's own names, as a plain Hugging
  Face folder; one equal to the base model is refused (untrained adapters, or a lost merge);
- the adapter alone: PEFT's `adapter_config.json` + `adapter_model.safetensors`, which
  `peft.PeftModel.from_pretrained(base_model, folder)` loads.
"""

import copy
import re
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from hpsft.utils.errors import UserInputError
from hpsft.models.hf_export import written_whole

ADAPTER = "default"  # PEFT's adapter name inside the model; saved files drop it
BASE_LAYER = ".base_layer."
ADAPTER_SUFFIX = f".{ADAPTER}.weight"
ADAPTER_PARTS = {"lora_A": "A", "lora_B": "B", "lora_magnitude_vector": "magnitude"}  # PEFT's module -> merge's part
INSTALL_HINT = "pip install hpsft[lora]"


def import_peft():
    try:
        import peft
    except ImportError:
        raise UserInputError(f"LoRA (model.lora.rank > 0) needs PEFT, which is not installed: {INSTALL_HINT}") from None
    return peft


def peft_lora_config(lora_config, lm: nn.Module):
    """PEFT's LoraConfig for hpsft's `model.lora` section, on `lm` (its vision tower left out)."""
    peft = import_peft()
    targets = lora_config.target_modules
    return peft.LoraConfig(
        r=lora_config.rank, lora_alpha=lora_config.alpha, lora_dropout=lora_config.dropout, bias="none",
        use_dora=lora_config.use_dora, target_modules="all-linear" if list(targets) == ["all-linear"] else list(targets),
        exclude_modules=vision_exclusion(lm),
    )


def vision_exclusion(lm: nn.Module) -> str | None:
    """A vision-language model's tower and projector as PEFT's exclude_modules regex (matched against
    whole module names), None for a text model."""
    from hpsft.models.packed_vision_lm import VISION_MODULES, check_vision_supported, is_vision_language

    if not is_vision_language(lm):
        return None
    check_vision_supported(lm)  # an unknown class's tower is not known: refused, not adapted
    return "(" + "|".join(re.escape(path) for path in VISION_MODULES[type(lm).__name__]) + r")(\..*)?"


def add_lora(lm: nn.Module, lora_config, seed: int) -> nn.Module:
    """Inject the adapters into `lm` in place (B = 0: the model computes what it did) and freeze
    everything else. The adapters' random A matrices come from `seed`, whatever the process
    drew before (a Ray actor and an SPMD rank build the same adapters)."""
    peft = import_peft()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft.inject_adapter_in_model(peft_lora_config(lora_config, lm), lm, adapter_name=ADAPTER)
        except ValueError as err:  # e.g. PEFT's "Target modules {...} not found in the base model"
            raise UserInputError(f"model.lora.target_modules={list(lora_config.target_modules)}: {err}") from None
    check_adapted_layers(lm, lora_config)
    check_every_target_adapted(lm, lora_config)
    return lm


def check_every_target_adapted(lm: nn.Module, lora_config) -> None:
    """Each listed target names at least one adapted layer (PEFT's rule: the whole module name, or
    its ending after a dot); PEFT itself only refuses a list of which nothing matched."""
    targets = list(lora_config.target_modules)
    if targets == ["all-linear"]:
        return
    adapted = list(lora_layers(lm))
    excluded = vision_exclusion(lm)
    for target in targets:
        if any(name == target or name.endswith(f".{target}") for name in adapted):
            continue
        in_tower = excluded is not None and any(
            re.fullmatch(excluded, name) and (name == target or name.endswith(f".{target}"))
            for name, _ in lm.named_modules())
        where = ("only layers of the vision tower or projector, which LoRA leaves frozen (the adapters go on the "
                 "language model)" if in_tower else "no layer of the model")
        raise UserInputError(f"model.lora.target_modules={targets}: {target!r} names {where}; list the language "
                             "model's linear layers (e.g. q_proj, v_proj) or use [all-linear]")


def gather_dora_base_weights(lm: nn.Module) -> None:
    """Under ZeRO-3, each DoRA magnitude's forward gathers its layer's base weight: PEFT's DoRA
    layer reads that weight (for the rows' norms) outside the base layer's own forward, where
    ZeRO-3 would hand it the empty partition (DeepSpeed's external parameters). Not shown needed:
    with DeepSpeed's default reuse distance the weight stayed gathered from the base layer's forward,
    which runs just before (tests/test_lora.py passed without this)."""
    import deepspeed

    for layer in lora_layers(lm).values():
        if layer.use_dora[ADAPTER]:
            deepspeed.zero.register_external_parameter(layer.lora_magnitude_vector[ADAPTER],
                                                       layer.get_base_layer().weight)


def check_adapted_layers(lm: nn.Module, lora_config) -> None:
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    head = lm.get_output_embeddings()
    for name, module in lm.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if module is head:
            raise UserInputError(
                f"model.lora.target_modules={list(lora_config.target_modules)} adapts the LM head ({name}): hpsft's "
                "fused loss reads the head's weight directly and would not see the adapter; leave it out"
            )
        if type(module) is not LoraLinear:
            raise UserInputError(
                f"model.lora.target_modules={list(lora_config.target_modules)} adapts {name}, a "
                f"{type(module.get_base_layer()).__name__}: hpsft trains and merges adapters on nn.Linear layers "
                "only; name linear layers"
            )


def lora_layers(lm: nn.Module) -> dict:
    """Module name -> PEFT LoRA layer, for every adapted layer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: module for name, module in lm.named_modules() if isinstance(module, BaseTunerLayer)}


def adapter_names(lm: nn.Module) -> list[str]:
    """The adapters' parameter names in `lm` (the trainable ones)."""
    return [name for name, param in lm.named_parameters() if param.requires_grad]


def base_name(name: str) -> str:
    """The base model's name of a parameter of an adapted model (`x.base_layer.weight` -> `x.weight`)."""
    return name.replace(BASE_LAYER, ".")


def merged_weights(lm: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], lora_config=None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's (name, tensor) pairs with every adapter folded in: W + scaling * B @ A
    (transposed for fan-in-fan-out layers), for DoRA times magnitude / the row norms of that,
    computed in fp32 and stored in W's dtype (PEFT's merge). With `lora_config.quantize_base`
    nf4 or int8 (QLoRA) W is the dequantised weight the layer trained with: its quantised base
    layer's, or (`lm` not quantised, as `hpsft export` builds it) the dense W quantised and
    dequantised again (qlora.dequantized).

    `weights` are the adapted model's tensors in its own names and order (`weight_names(lm)`):
    a layer's base weight and its adapter tensors arrive together, so one layer is held at a
    time. Merged weights all equal to the base ones are an error, raised after the last.
    """
    layers = lora_layers(lm)
    held: dict[str, dict[str, torch.Tensor]] = {}
    changed = False
    for name, tensor in weights:
        if BASE_LAYER in name:
            prefix, _, rest = name.partition(BASE_LAYER)
            if rest != "weight":  # the bias: unchanged by LoRA
                yield base_name(name), tensor
                continue
            part = "W"
        elif name.endswith(ADAPTER_SUFFIX) and name.removesuffix(ADAPTER_SUFFIX).rpartition(".")[2] in ADAPTER_PARTS:
            prefix, _, module = name.removesuffix(ADAPTER_SUFFIX).rpartition(".")
            part = ADAPTER_PARTS[module]
        else:
            yield name, tensor
            continue
        layer = layers[prefix]
        parts = held.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == 4 if layer.use_dora[ADAPTER] else len(parts) == 3:
            del held[prefix]
            if lora_config is not None and lora_config.quantize_base != "none":
                from hpsft.models.qlora import dequantized

                base = layer.get_base_layer()
                parts["W"] = (base.dequantized() if hasattr(base, "dequantized")
                              else dequantized(prefix, parts["W"], lora_config))
            merged = merged_weight(layer, parts)
            changed = changed or not torch.equal(merged, parts["W"])
            yield f"{prefix}.weight", merged
    if held:
        raise RuntimeError(f"adapted layers without all of base weight and adapters: {sorted(held)}")
    if not changed:
        raise UserInputError("the merged model equals the base model, weight for weight: its adapters change nothing "
                             "(untrained: B = 0 as initialised); export the adapter alone with --adapter-only")


def merged_weight(layer, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One layer's W + scaling * B @ A (DoRA: times magnitude / its row norms) from its `parts`."""
    delta = parts["B"].float() @ parts["A"].float()
    if layer.fan_in_fan_out:
        delta = delta.T
    weight = parts["W"].float() + layer.scaling[ADAPTER] * delta
    if "magnitude" in parts:  # one norm per output: rows of W, columns of a fan-in-fan-out W
        output_dim = 1 if layer.fan_in_fan_out else 0
        norm = torch.linalg.norm(weight, dim=1 - output_dim, keepdim=True)
        weight = parts["magnitude"].float().unsqueeze(1 - output_dim) / norm * weight
    return weight.to(parts["W"].dtype)


def write_adapter_folder(lm: nn.Module, adapter: dict[str, torch.Tensor], base_model_path: str, tokenizer,
                         out_dir: Path) -> None:
    """PEFT's adapter folder (adapter_config.json, adapter_model.safetensors) and the tokenizer,
    as `PeftModel.save_pretrained` writes it; `adapter` maps `adapter_names(lm)` to tensors."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    # PEFT's own renaming (adapter name dropped), under the prefix a PeftModel's keys carry.
    saved = get_peft_model_state_dict(lm, state_dict=adapter, adapter_name=ADAPTER)
    saved = {f"base_model.model.{name}": tensor.contiguous() for name, tensor in saved.items()}
    if len(saved) != len(adapter):
        raise RuntimeError(f"PEFT kept {len(saved)} of the {len(adapter)} adapter tensors")
    config = copy.copy(lm.peft_config[ADAPTER])  # the live model's stays as it is
    config.base_model_name_or_path = str(Path(base_model_path).resolve())
    config.inference_mode = True
    with written_whole(out_dir) as tmp:
        config.save_pretrained(tmp)
        save_file(saved, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)


def describe(lm: nn.Module) -> str:
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in lm.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in lm.parameters())
    return f"LoRA on {len(lora_layers(lm))} layers: {trainable:,} trainable parameters of {total:,}"

