"""Export any checkpoint to a Hugging Face folder: python -m hpsft.export CHECKPOINT OUT_DIR

CHECKPOINT is a `checkpoints/global_step_N` folder or a run's output_dir (its newest intact
checkpoint). One process on the CPU, whatever the number of ranks and the ZeRO stage (1-3)
that wrote it: DeepSpeed's zero_to_fp32 reassembles the fp32 weights from the shards, read
lazily one tensor at a time, and they are written as the end of a run writes hf/ (safetensors
shards, config, tokenizer with the run's chat template).
"""

import argparse
import sys
from pathlib import Path

from hpsft.errors import UserInputError, exits_2_on_user_error
from hpsft.models.hf_export import DEFAULT_MAX_SHARD_MB, weight_names


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m hpsft.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoints/global_step_N folder, or a run's output_dir")
    parser.add_argument("out_dir", help="the Hugging Face folder to write (must not exist, or be empty)")
    parser.add_argument("--model", default=None,
                        help="the model folder whose config and tokenizer to use (default: the run's model.path)")
    parser.add_argument("--max-shard-mb", type=int, default=DEFAULT_MAX_SHARD_MB,
                        help=f"largest safetensors file (default {DEFAULT_MAX_SHARD_MB})")
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


def checkpoint_weights(checkpoint: Path, lm):
    """(name, fp32 tensor) of what the Hugging Face folder stores, each reassembled from the
    ZeRO shards when asked; the checkpoint must hold exactly `lm`'s state dict."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if not list(checkpoint.glob("*optim_states.pt")):
        raise UserInputError(f"{checkpoint}: no ZeRO optimizer shards (*optim_states.pt); only checkpoints of "
                             "engine.zero_stage 1-3 can be exported")
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name, lazy_mode=True)
    expected = set(lm.state_dict())  # tied weights under each of their names, as DeepSpeed restores them
    missing, unexpected = expected - set(lazy), set(lazy) - expected
    if missing or unexpected:
        raise UserInputError(
            f"{checkpoint} does not hold this model's weights (missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}): was it written by another model, or by hpsft before parameters were "
            "named as in Hugging Face? Give the right model with --model PATH"
        )
    for name in weight_names(lm):
        yield name, lazy[name].contiguous()


def export(checkpoint_path: str, out_dir: str, model_path: str | None = None,
           max_shard_mb: int = DEFAULT_MAX_SHARD_MB) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from hpsft.data.dataset import chat_template_text
    from hpsft.models import load_tokenizer, write_hf_folder
    from hpsft.models.loading import check_model_path
    from hpsft.progress import progress_bar

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"{out} exists and is not an empty folder: give a new path, or remove it first")
    checkpoint = find_checkpoint(Path(checkpoint_path))
    chat_template, trust_remote_code = None, False
    if model_path is None:
        config = run_config(checkpoint)
        model_path, trust_remote_code = config.model.path, config.model.trust_remote_code
        chat_template = config.data.chat_template
    folder = check_model_path(model_path, trust_remote_code)
    model_config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model_config.dtype = torch.float32  # the weights zero_to_fp32 recovers
    with torch.device("meta"):  # names, shapes and ties only: no memory
        lm = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(str(folder), trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = chat_template_text(chat_template)
    generation_config = None
    if (folder / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(folder)
    # A bar on a terminal: reassembling a large model from its shards takes minutes.
    weights = progress_bar(True, iterable=checkpoint_weights(checkpoint, lm), total=len(weight_names(lm)),
                           desc="export", unit="tensor")
    write_hf_folder(model_config, generation_config, weights, tokenizer, out, max_shard_mb)
    return checkpoint


@exits_2_on_user_error
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    checkpoint = export(args.checkpoint, args.out_dir, args.model, args.max_shard_mb)
    print(f"hpsft: exported {checkpoint} to {args.out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
