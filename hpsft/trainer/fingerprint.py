"""The run fingerprint: what defines a run, recorded in every checkpoint and compared on resume.

A resume continues the data order, the optimizer state and the step count of the run that
wrote the checkpoint. With other training data, another model, other tokenization or
another global batch, the loaded data position points into different sequences and the
run silently becomes a mix of two: such a resume is refused, naming the keys that differ,
unless trainer.resume_force=true (then a warning names them).

What is in it (flat `key: value`, JSON): the model (its path, a hash of config.json, and
each weight file's size with a hash of its first and last MiB: cheap on big models, and
unlike names and sizes alone it tells two fine-tunes of one architecture apart), the
tokenizer's vocabulary size, the sha256 of every training file's content (not its path:
a moved file is the same data; a custom dataset's path that is no file: the path), the
mixture weights (when the training files have weights) and the custom dataset class (its
file's sha256 and name, when one is used), the effective chat template and the tokenization
options, the global batch size, shuffling and the seed, the loss terms that change the
objective, and the LoRA settings of a LoRA run (`model.lora`: which parameters exist and are
trained; absent without LoRA, so full fine-tuning checkpoints of earlier versions keep their
fingerprint; `use_dora` in it only when true, for the same reason). Source names are not:
they name metrics only.

What is not, because changing it on resume is harmless or meant: logging, save cadence,
keep_last_checkpoints, output and export options, total_steps/total_epochs (extending a
run), validation files, the optimizer's settings (e.g. a lower learning rate after
non-finite steps), and how the global batch is split (data-parallel size, micro-batches,
token budget, ZeRO stage): a resume with another data-parallel size is supported.

Recorded but not compared (LAYOUT_KEYS): the tensor-parallel size, which says how the
checkpoint's files are laid out (one per TP rank); a resume may change it
(docs/tensor_parallel.md).
"""

import dataclasses
import hashlib
from pathlib import Path

from hpsft.data.preparation import MANIFEST, is_store
from hpsft.data.rows import DataError
from hpsft.data.shards import expand_entry
from hpsft.utils.files import sha256

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLED_BYTES = 1 << 20


def sampled_sha256(path: Path) -> str:
    """sha256 of the size and the first and last MiB of a file (whole files up to 2 MiB)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(SAMPLED_BYTES))
        if size > SAMPLED_BYTES:
            f.seek(max(SAMPLED_BYTES, size - SAMPLED_BYTES))
            digest.update(f.read())
    return digest.hexdigest()


def text_sha256(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def model_fingerprint(path: str) -> dict:
    folder = Path(path)
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    return {
        "model.path": str(folder.resolve()),
        "model.config.json sha256": sha256(folder / "config.json"),
        "model weight files": {p.name: {"bytes": p.stat().st_size, "sampled sha256": sampled_sha256(p)}
                               for p in weights},
    }


def source_fingerprint(path: str) -> str:
    """A data file's sha256; a folder or glob of them: the sha256 of their sha256s in order; a
    prepared token store: its manifest's (which names its inputs and what each shard holds); a
    custom dataset's path that is none of these: the path."""
    if Path(path).is_file():
        return sha256(Path(path))
    if is_store(path):
        return sha256(Path(path) / MANIFEST)
    try:
        files = expand_entry(path)
    except DataError:
        return path
    return hashlib.sha256("".join(sha256(f) for f in files).encode()).hexdigest()


def data_fingerprint(data) -> dict:
    """The training data; keys for mixing and custom classes only when used, so that the
    checkpoints of runs without them still match."""
    found = {"data.train_files sha256": [source_fingerprint(s.path) for s in data.train_sources()]}
    if data.mixture_weights() is not None:
        found["data.train_files weights"] = data.mixture_weights()
    if data.custom_cls.path is not None:
        found["data.custom_cls"] = {"sha256": sha256(Path(data.custom_cls.path)), "name": data.custom_cls.name}
    return found


def run_fingerprint(config, tokenizer) -> dict:
    """The fingerprint of the run `config` describes; `tokenizer` carries the chat template
    actually used (the model's own, or data.chat_template)."""
    data, loss = config.data, config.loss
    return {
        **model_fingerprint(config.model.path),
        "tokenizer vocabulary size": len(tokenizer),
        **data_fingerprint(data),
        "chat template sha256": text_sha256(tokenizer.chat_template),
        **{f"data.{name}": getattr(data, name) for name in (
            "tools_key", "max_length", "truncation", "bad_rows", "train_batch_size", "shuffle")},
        # Unset (None) column keys read what these defaults read before the keys could be unset.
        **{f"data.{name}": getattr(data, name) or default for name, default in (
            ("messages_key", "messages"), ("prompt_key", "prompt"), ("response_key", "response"))},
        # Absent at their defaults, so checkpoints written before the keys existed still match.
        **{f"data.{name}": getattr(data, name) for name in (
            "role_key", "content_key", "query_key", "system_key", "history_key") if getattr(data, name) is not None},
        **({"data.layout": data.layout} if data.layout != "auto" else {}),
        # Absent at its default, so checkpoints written before the key existed still match.
        **({"data.multiturn": data.multiturn} if data.multiturn != "auto" else {}),
        "trainer.seed": config.trainer.seed,
        "loss.z_loss_weight": loss.z_loss_weight,
        "loss.label_smoothing": loss.label_smoothing,
        **({"model.lora": lora_fingerprint(config.model.lora)} if config.model.lora.rank else {}),
        # Its checkpoints leave the tower out (frozen): the export reads it from the folder. Absent
        # when false, so checkpoints written before the key existed still match.
        **({"model.freeze_vision": True} if config.model.freeze_vision else {}),
        "engine.tensor_parallel_size": config.engine.tensor_parallel_size,
    }


def lora_fingerprint(lora) -> dict:
    """model.lora's settings; use_dora, quantize_base and double_quant only when not the default,
    so that LoRA checkpoints written before those keys existed still match."""
    settings = dataclasses.asdict(lora)
    if not lora.use_dora:
        del settings["use_dora"]
    if lora.quantize_base == "none":
        del settings["quantize_base"]
    if lora.double_quant:  # the default (nf4 checkpoints written before the key existed were double-quantised)
        del settings["double_quant"]
    return settings


# Keys run_fingerprint records that a resume may change: the layout, not the run.
LAYOUT_KEYS = ("engine.tensor_parallel_size",)


def shown(value) -> str:
    """A value as a difference line shows it: hashes cut to 12 characters."""
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]
    if isinstance(value, list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return "absent" if value is None else str(value)


def differences(recorded: dict, current: dict) -> list[str]:
    """`key: old -> new` for every key whose value differs (or is only in one of them), but
    the LAYOUT_KEYS."""
    keys = list(recorded) + [key for key in current if key not in recorded]
    return [f"{key}: {shown(recorded.get(key))} -> {shown(current.get(key))}"
            for key in keys if recorded.get(key) != current.get(key) and key not in LAYOUT_KEYS]
