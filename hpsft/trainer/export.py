"""A checkpoint -> a Hugging Face folder (hpsft export, hpsft/commands/export.py): the fp32
weights read back by the engine that wrote it (engine.checkpoint_weights), a LoRA run's
adapters merged into the base model's weights or written alone as PEFT's adapter folder."""

import tempfile
from pathlib import Path

from hpsft.models.hf_export import DEFAULT_MAX_SHARD_MB, weight_names
from hpsft.utils.errors import UserInputError


def find_checkpoint(path: Path) -> Path:
    from hpsft.trainer.checkpoint import CheckpointManager, manifest_problem, step_of

    if step_of(path.name) is not None and path.is_dir():
        problem = manifest_problem(path)
        if problem is not None:
            raise UserInputError(f"{path}: the checkpoint is damaged ({problem}); export an earlier one")
        return path
    latest = CheckpointManager(path).latest()
    if latest is None:
        raise UserInputError(f"{path}: neither a global_step_<N> checkpoint folder nor a run directory with checkpoints")
    return latest


def run_config(checkpoint: Path):
    """The config of the run that wrote the checkpoint (<output_dir>/config.yaml)."""
    from hpsft.config import load_config

    file = checkpoint.parent.parent / "config.yaml"
    if not file.is_file():
        raise UserInputError(f"{file} is missing: give the model folder with --model PATH")
    return load_config(file, [])


def checkpoint_tensors(checkpoint: Path, expected: set[str], scratch: Path) -> dict:
    """The checkpoint's fp32 tensors as its engine reads them back (reassembled from shards
    lazily, each when asked; hpsft.engine.checkpoint_weights), with `scratch` for any files that
    takes on the way; it must hold exactly `expected`."""
    from hpsft.engine import checkpoint_weights

    lazy = checkpoint_weights(checkpoint, scratch)
    missing, unexpected = expected - set(lazy), set(lazy) - expected
    if missing or unexpected:
        raise UserInputError(
            f"{checkpoint} does not hold this model's weights (missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}): was it written by another model, or by hpsft before parameters were "
            "named as in Hugging Face? Give the right model with --model PATH"
        )
    return lazy


def checkpoint_weights(checkpoint: Path, lm, scratch: Path, frozen_from=None):
    """(name, fp32 tensor) of what the Hugging Face folder stores, each reassembled from the
    ZeRO shards when asked; the checkpoint must hold exactly `lm`'s state dict, less the frozen
    parameters `frozen_from` (name -> a reader of the model folder's tensor) gives."""
    frozen_from = frozen_from or {}
    # tied weights under each name, as saved
    lazy = checkpoint_tensors(checkpoint, set(lm.state_dict()) - set(frozen_from), scratch)
    for name in weight_names(lm):
        yield name, (lazy[name] if name in lazy else frozen_from[name]()).contiguous()


def frozen_vision_readers(lm, folder: Path) -> dict:
    """A model.freeze_vision=true run's vision tower and projector, which its checkpoints leave out
    (frozen parameters are the model folder's): for each of their parameter names, a function
    reading its fp32 tensor from the folder, whose saved names are renamed as from_pretrained
    renames them (partitioned.model_name_of: e.g. a LLaVA folder's `vision_tower.*`)."""
    from functools import partial

    from hpsft.models.packed_vision_lm import VISION_MODULES
    from hpsft.models.partitioned import model_name_of, read_saved_fp32, saved_weight_index

    prefixes = tuple(f"{path}." for path in VISION_MODULES[type(lm).__name__])
    names = {name for name, _ in lm.named_parameters(remove_duplicate=False) if name.startswith(prefixes)}
    where = saved_weight_index(folder, model_name_of(lm),
                               "for the frozen vision tower of a model.freeze_vision=true checkpoint")
    if names - set(where):
        raise UserInputError(f"model folder {folder} lacks the frozen vision weights {sorted(names - set(where))[:5]} "
                             "that the checkpoint leaves out: give the model trained on with --model PATH")
    return {name: partial(read_saved_fp32, *where[name]) for name in names}


def check_trained_base(folder: Path, recorded: dict, what: str = "the LoRA adapters") -> None:
    """A LoRA checkpoint's base weights (a frozen tower's) come from the model folder: it must be the one trained on."""
    from hpsft.trainer.fingerprint import differences, model_fingerprint

    keys = ("model.config.json sha256", "model weight files")
    changed = differences({k: recorded.get(k) for k in keys}, {k: model_fingerprint(str(folder))[k] for k in keys})
    if changed:
        raise UserInputError(
            f"model folder {folder} is not the base model {what} were trained on ({'; '.join(changed)}): "
            "give that model with --model PATH"
        )


def lora_weights(checkpoint: Path, lm, folder: Path, adapter_only: bool, scratch: Path, lora_config):
    """A LoRA checkpoint's (name, tensor) pairs: the adapters alone, or the base model (read from
    `folder` tensor by tensor; QLoRA's quantised and dequantised as in training) with the adapters
    merged in."""
    from hpsft.models.lora import adapter_names, base_name, merged_weights
    from hpsft.models.partitioned import model_name_of, read_saved_fp32, saved_weight_index

    names = adapter_names(lm)
    # A QLoRA checkpoint holds no NF4 base weight (frozen, left out as frozen parameters are): the
    # merge reads the folder's and quantises them again, as training did (bit for bit the same).
    lazy = checkpoint_tensors(checkpoint, set(names), scratch)
    if adapter_only:
        return {name: lazy[name].contiguous() for name in names}
    # The folder's saved names renamed as from_pretrained renames them (e.g. Qwen2-VL's saved
    # model.layers.* are the model's model.language_model.layers.*).
    where = saved_weight_index(folder, model_name_of(lm), "for a LoRA export (base weights read tensor by tensor)")

    def adapted_model_weights():
        for name in weight_names(lm):
            if name in lazy:
                yield name, lazy[name].contiguous()
                continue
            yield name, read_saved_fp32(*where[base_name(name)])

    return merged_weights(lm, adapted_model_weights(), lora_config)


def export(checkpoint_path: str, out_dir: str, model_path: str | None = None,
           max_shard_mb: int = DEFAULT_MAX_SHARD_MB, adapter_only: bool = False) -> Path:
    import torch
    from transformers import AutoConfig, GenerationConfig

    from hpsft.config import LoraConfig
    from hpsft.data.rows import chat_template_text
    from hpsft.models import load_tokenizer, write_hf_folder
    from hpsft.models.loading import auto_model_class, check_model_path
    from hpsft.models.lora import add_lora, write_adapter_folder
    from hpsft.trainer.checkpoint import CheckpointManager
    from hpsft.utils.progress import progress_bar

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"{out} exists and is not an empty folder: give a new path, or remove it first")
    checkpoint = find_checkpoint(Path(checkpoint_path))
    recorded = CheckpointManager.load_run_fingerprint(checkpoint) or {}
    lora_settings = recorded.get("model.lora")
    if adapter_only and lora_settings is None:
        raise UserInputError(f"{checkpoint} is not from a LoRA run (its run_fingerprint.json has no model.lora): "
                             "there is no adapter to write alone; export it without --adapter-only")
    chat_template, trust_remote_code = None, False
    if model_path is None:
        config = run_config(checkpoint)
        model_path, trust_remote_code = config.model.path, config.model.trust_remote_code
        chat_template = config.data.chat_template
    folder = check_model_path(model_path, trust_remote_code)
    model_config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model_config.dtype = torch.float32  # the weights the checkpoint holds
    with torch.device("meta"):  # names, shapes and ties only: no memory
        # The class training built (a vision-language folder's has the tower): its names are the checkpoint's.
        lm = auto_model_class(folder, trust_remote_code).from_config(model_config, trust_remote_code=trust_remote_code)
        if lora_settings is not None:
            add_lora(lm, LoraConfig(**lora_settings), seed=0)  # the adapters' names and shapes
    tokenizer = load_tokenizer(str(folder), trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = chat_template_text(chat_template)
    generation_config = None
    if (folder / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(folder)
    # A TP checkpoint's weights are merged into files here first (checkpoint_tensors): as large as
    # the model, so beside the output rather than in /tmp; gone when the export ends.
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.scratch.", dir=out.parent) as scratch:
        if lora_settings is None:
            frozen_from = None
            if recorded.get("model.freeze_vision"):
                check_trained_base(folder, recorded, "the frozen vision tower's checkpoint")
                frozen_from = frozen_vision_readers(lm, folder)
            # A bar on a terminal: reassembling a large model from its shards takes minutes.
            weights = progress_bar(True, iterable=checkpoint_weights(checkpoint, lm, Path(scratch), frozen_from),
                                   total=len(weight_names(lm)), desc="export", unit="tensor")
        else:
            if not adapter_only:
                check_trained_base(folder, recorded)
            weights = lora_weights(checkpoint, lm, folder, adapter_only, Path(scratch),
                                   LoraConfig(**lora_settings))
        if adapter_only:
            write_adapter_folder(lm, weights, str(folder), tokenizer, out)
        else:
            write_hf_folder(model_config, generation_config, weights, tokenizer, out, max_shard_mb, folder)
    return checkpoint
