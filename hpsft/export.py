"""Export any checkpoint to a Hugging Face folder: python -m hpsft.export CHECKPOINT OUT_DIR

CHECKPOINT is a `checkpoints/global_step_N` folder or a run's output_dir (its newest intact
checkpoint). One process on the CPU, whatever the number of ranks and the ZeRO stage (0-3)
that wrote it: the engine that wrote it reads its fp32 weights back (DeepSpeed's: reassembled
from ZeRO's shards lazily, one tensor at a time; with tensor parallelism the TP slices are
merged first, into a scratch folder beside OUT_DIR), and they are written as the end of a run
writes hf/ (safetensors shards, config, tokenizer with the run's chat template).

A LoRA run's checkpoint holds its adapters only (its settings are in run_fingerprint.json);
the base weights are read from the model folder, which must be the one it was trained on.
By default (--merge) the adapters are merged into the base weights: a plain Hugging Face
folder. With --adapter-only: PEFT's adapter folder (adapter_config.json,
adapter_model.safetensors, and the tokenizer), for peft.PeftModel.from_pretrained(base, folder).
"""

import argparse
import sys
import tempfile
from pathlib import Path

from hpsft.utils.errors import UserInputError, exits_2_on_user_error
from hpsft.models.hf_export import DEFAULT_MAX_SHARD_MB, weight_names


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m hpsft.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  hpsft export runs/default/checkpoints/global_step_20 /tmp/step20\n"
               "  hpsft export runs/lora /tmp/lora-adapter --adapter-only   # a LoRA run's adapter alone")
    parser.add_argument("checkpoint", help="a checkpoints/global_step_N folder, or a run's output_dir")
    parser.add_argument("out_dir", help="the Hugging Face folder to write (must not exist, or be empty)")
    parser.add_argument("--model", default=None,
                        help="the model folder whose config and tokenizer to use (default: the run's model.path)")
    parser.add_argument("--max-shard-mb", type=int, default=DEFAULT_MAX_SHARD_MB,
                        help=f"largest safetensors file (default {DEFAULT_MAX_SHARD_MB})")
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument("--merge", dest="adapter_only", action="store_false",
                      help="a LoRA run: merge the adapters into the base weights (the default)")
    lora.add_argument("--adapter-only", dest="adapter_only", action="store_true",
                      help="a LoRA run: write PEFT's adapter folder only (loads with PeftModel.from_pretrained)")
    parser.set_defaults(adapter_only=False)
    return parser.parse_args(argv)


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


def checkpoint_weights(checkpoint: Path, lm, scratch: Path):
    """(name, fp32 tensor) of what the Hugging Face folder stores, each reassembled from the
    ZeRO shards when asked; the checkpoint must hold exactly `lm`'s state dict."""
    lazy = checkpoint_tensors(checkpoint, set(lm.state_dict()), scratch)  # tied weights under each name, as saved
    for name in weight_names(lm):
        yield name, lazy[name].contiguous()


def check_trained_base(folder: Path, recorded: dict) -> None:
    """A LoRA checkpoint's base weights come from the model folder: it must be the one trained on."""
    from hpsft.trainer.fingerprint import differences, model_fingerprint

    keys = ("model.config.json sha256", "model weight files")
    changed = differences({k: recorded.get(k) for k in keys}, {k: model_fingerprint(str(folder))[k] for k in keys})
    if changed:
        raise UserInputError(
            f"model folder {folder} is not the base model the LoRA adapters were trained on ({'; '.join(changed)}): "
            "give that model with --model PATH"
        )


def lora_weights(checkpoint: Path, lm, folder: Path, adapter_only: bool, scratch: Path):
    """A LoRA checkpoint's (name, tensor) pairs: the adapters alone, or the base model (read from
    `folder` tensor by tensor) with the adapters merged in."""
    from safetensors import safe_open

    from hpsft.models.lora import adapter_names, base_name, merged_weights
    from hpsft.models.partitioned import weight_files

    names = adapter_names(lm)
    lazy = checkpoint_tensors(checkpoint, set(names), scratch)
    if adapter_only:
        return {name: lazy[name].contiguous() for name in names}
    files = weight_files(folder, "for a LoRA export (base weights read tensor by tensor)")
    file_of = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            file_of.update(dict.fromkeys(f.keys(), file))

    def adapted_model_weights():
        for name in weight_names(lm):
            if name in lazy:
                yield name, lazy[name].contiguous()
                continue
            with safe_open(file_of[base_name(name)], framework="pt") as f:
                yield name, f.get_tensor(base_name(name)).float()

    return merged_weights(lm, adapted_model_weights())


def export(checkpoint_path: str, out_dir: str, model_path: str | None = None,
           max_shard_mb: int = DEFAULT_MAX_SHARD_MB, adapter_only: bool = False) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from hpsft.config import LoraConfig
    from hpsft.data.rows import chat_template_text
    from hpsft.models import load_tokenizer, write_hf_folder
    from hpsft.models.loading import check_model_path
    from hpsft.models.lora import add_lora, write_adapter_folder
    from hpsft.utils.progress import progress_bar
    from hpsft.trainer.checkpoint import CheckpointManager

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
        lm = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
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
            # A bar on a terminal: reassembling a large model from its shards takes minutes.
            weights = progress_bar(True, iterable=checkpoint_weights(checkpoint, lm, Path(scratch)),
                                   total=len(weight_names(lm)), desc="export", unit="tensor")
        else:
            if not adapter_only:
                check_trained_base(folder, recorded)
            weights = lora_weights(checkpoint, lm, folder, adapter_only, Path(scratch))
        if adapter_only:
            write_adapter_folder(lm, weights, str(folder), tokenizer, out)
        else:
            write_hf_folder(model_config, generation_config, weights, tokenizer, out, max_shard_mb)
    return checkpoint


@exits_2_on_user_error
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    checkpoint = export(args.checkpoint, args.out_dir, args.model, args.max_shard_mb, args.adapter_only)
    what = "the LoRA adapter of " if args.adapter_only else ""
    print(f"hpsft: exported {what}{checkpoint} to {args.out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
