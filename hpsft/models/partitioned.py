"""Build a Hugging Face causal LM partitioned for ZeRO-3: no rank ever holds the whole model.

The model is constructed inside the engine's model_init() (`deepspeed.zero.Init`: each module's
parameters are split across the ranks as the module is created). transformers' own ZeRO-3 `from_pretrained` would then have
rank 0 read every weight file into memory at once, so the weights are copied here one tensor
at a time instead: every rank gathers one parameter, rank 0 copies it from the safetensors
file (memory-mapped, read tensor by tensor), and the parameter is partitioned again.
"""

import ctypes
import ctypes.util
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hpsft.utils.errors import UserInputError

INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path, reader: str = "with engine.zero_stage=3") -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise UserInputError(
        f"model.path={folder}: no safetensors weights (model.safetensors or {INDEX_FILE}); {reader} hpsft "
        "loads only safetensors: convert the folder, e.g. with save_pretrained"
    )


def model_name_of(lm: nn.Module) -> Callable[[str], str]:
    """A saved weight's name -> the model's name for it, by transformers' own renamings (those
    from_pretrained applies, get_model_conversion_mapping): e.g. Qwen2-VL's `model.layers.*`, as its
    save_pretrained writes them, -> `model.language_model.layers.*`. Its converters (weights fused
    or split, e.g. MoE experts) are not applied: such a name stays as saved, and
    check_weights_match refuses it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(lm) if isinstance(t, WeightRenaming)]
    names = lm.state_dict(keep_vars=True)  # where the base-model prefix is added or dropped
    return lambda name: rename_source_key(name, renamings, [], lm.base_model_prefix, names)[0]


def saved_weight_index(folder: Path, model_name: Callable[[str], str], reader: str) -> dict[str, tuple[Path, str]]:
    """The model's name -> (safetensors file, saved key) of every weight in `folder` (its files'
    headers only), the saved names renamed by `model_name` (model_name_of)."""
    from safetensors import safe_open

    where = {}
    for file in weight_files(folder, reader):
        with safe_open(file, framework="pt") as f:
            where.update({model_name(saved): (file, saved) for saved in f.keys()})
    return where


def read_saved_fp32(file: Path, saved: str) -> torch.Tensor:
    """One saved tensor (an entry of saved_weight_index), read alone, in fp32."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return f.get_tensor(saved).float()


def check_weights_match(lm: nn.Module, folder: Path, files: list[Path], model_name: Callable[[str], str],
                        reader: str = "engine.zero_stage=3", fix: str = "use engine.zero_stage=2 for this folder") -> None:
    """Every parameter and persistent buffer of `lm` is in the files (under model_name), with its
    shape, and nothing else is: checked on every rank from the files' headers, before any collective."""
    from safetensors import safe_open

    tensors = dict(lm.named_parameters(remove_duplicate=False)) | dict(lm.named_buffers())
    found, problems = set(), []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for saved in f.keys():
                name = model_name(saved)
                if name not in tensors:
                    problems.append(f"{file.name} holds {saved!r}, which the model does not have")
                    continue
                shape = tuple(f.get_slice(saved).get_shape())
                expected = tuple(getattr(tensors[name], "ds_shape", tensors[name].shape))
                if shape != expected:
                    problems.append(f"{saved!r} is {list(shape)} in {file.name}, the model's is {list(expected)}")
                found.add(id(tensors[name]))
    state = lm.state_dict(keep_vars=True)
    missing = [name for name, tensor in state.items() if id(tensor) not in found]
    if missing:
        problems.append(f"no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if problems:
        raise UserInputError(
            f"model.path={folder}: its weights do not match the model's parameters ({'; '.join(problems[:5])}); "
            f"{reader} loads weights stored under the model's own names, or names transformers' "
            f"from_pretrained renames to them (as save_pretrained writes them); {fix}"
        )


def release_freed_memory() -> None:
    """Hand the heap memory freed by the build back to the system: glibc keeps the many
    per-module temporaries' chunks otherwise, and the rank's resident memory stays well above
    what it holds (measured on SmolLM2-135M: 570 MiB resident for 310 MiB of tensors)."""
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


def empty_causal_lm(folder: Path, attn_implementation: str, trust_remote_code: bool, model_class=None) -> nn.Module:
    """The model of `folder` in fp32 with its weights not initialised, to be built inside the
    engine's model_init() (deepspeed.zero.Init, with the config the engine then runs), which
    partitions it as it is built; load_weights_partitioned then fills it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    # What transformers' own ZeRO-3 build does, without its random initialisation of every
    # weight (a gather per module), since every weight is loaded next.
    with no_init_weights():
        return (model_class or AutoModelForCausalLM).from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)


def is_partitioned(lm: nn.Module) -> bool:
    """Whether `lm` was built partitioned (its parameters are ZeRO-3's)."""
    return any(hasattr(p, "ds_id") for p in lm.parameters())


@torch.no_grad()
def load_weights_partitioned(lm: nn.Module, folder: Path) -> None:
    """Every weight of `folder` into the partitioned model `lm` (once its model_init() has ended),
    one tensor at a time."""
    import deepspeed
    from safetensors import safe_open

    lm.tie_weights()
    files = weight_files(folder)
    model_name = model_name_of(lm)
    check_weights_match(lm, folder, files, model_name)
    tensors = dict(lm.named_parameters(remove_duplicate=False)) | dict(lm.named_buffers())
    rank0 = torch.distributed.get_rank() == 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # the file's order: the same on every rank
                target = tensors[model_name(name)]
                if not hasattr(target, "ds_id"):  # a buffer: not partitioned, every rank reads it
                    target.copy_(f.get_tensor(name))
                    continue
                with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                    if rank0:
                        target.data.copy_(f.get_tensor(name))
    release_freed_memory()


