"""Write a Hugging Face model folder from weights streamed one tensor at a time.

The weights go to safetensors shards of at most `max_shard_mb` in Hugging Face's own layout
(one `model.safetensors`, or `model-0000K-of-0000N.safetensors` plus
`model.safetensors.index.json`, as `save_pretrained` shards): the writer holds one shard,
never the whole model, so the caller may gather the tensors one by one (ZeRO-3) or read them
lazily from a checkpoint (hpsft.export).
"""

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from hpsft.utils.files import umask_mode

DEFAULT_MAX_SHARD_MB = 1024
# What AutoProcessor reads besides the tokenizer (a vision-language folder's image processor,
# its processor settings and chat template): copied as they are, since the run does not change them.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json",
                   "chat_template.jinja", "video_preprocessor_config.json")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_names(lm: nn.Module) -> list[str]:
    """The names a Hugging Face folder stores for this model, in module order: every parameter
    once (a tied LM head is stored under the input embedding's name only, as save_pretrained
    does) and the persistent buffers."""
    names = [name for name, _ in lm.named_parameters()]
    for prefix, module in lm.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def write_safetensors_shards(weights: Iterable[tuple[str, torch.Tensor]], folder: Path, max_shard_mb: int) -> None:
    """Write (name, tensor) pairs in order into shards of at most `max_shard_mb` (a tensor
    larger than that gets a shard of its own); one shard is `model.safetensors`."""
    max_bytes = max_shard_mb * 2**20
    shard_names: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        save_file(shard, folder / f"shard-{len(shard_names)}.tmp", metadata={"format": "pt"})
        shard_names.append(list(shard))
        shard.clear()

    for name, tensor in weights:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_bytes:
            flush()
            shard_bytes = 0
        shard[name] = tensor.contiguous()
        shard_bytes += size
        total_bytes += size
    if shard or not shard_names:
        flush()

    if len(shard_names) == 1:
        os.replace(folder / "shard-0.tmp", folder / SINGLE_FILE)
        return
    weight_map = {}
    for i, names in enumerate(shard_names):
        file = f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors"
        os.replace(folder / f"shard-{i}.tmp", folder / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_hf_folder(config, generation_config, weights: Iterator[tuple[str, torch.Tensor]], tokenizer,
                    out_dir: Path, max_shard_mb: int = DEFAULT_MAX_SHARD_MB,
                    model_folder: str | Path | None = None) -> None:
    """Save config, weights and tokenizer (with its chat template) so that
    `from_pretrained(out_dir)` loads them, written whole or not at all (see written_whole); the
    processor files `model_folder` has (PROCESSOR_FILES) are copied, so that AutoProcessor loads
    the folder of a vision-language run."""
    with written_whole(out_dir) as tmp:
        config.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        write_safetensors_shards(weights, tmp, max_shard_mb)
        tokenizer.save_pretrained(tmp)
        if model_folder is not None:
            copy_processor_files(Path(model_folder), tmp)


def copy_processor_files(model_folder: Path, out_dir: Path) -> None:
    """The PROCESSOR_FILES of `model_folder` (those it has) into `out_dir`."""
    for name in PROCESSOR_FILES:
        if (model_folder / name).is_file():
            shutil.copyfile(model_folder / name, out_dir / name)


@contextlib.contextmanager
def written_whole(out_dir: Path):
    """A temporary sibling folder to write into, renamed to `out_dir` (replacing it) once the
    block has succeeded: a crash mid-write leaves no complete-looking folder."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        yield tmp
        tmp.chmod(umask_mode(0o777))  # mkdtemp's 0700 would ignore the user's umask
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
