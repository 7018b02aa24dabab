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

import sys

from hpsft.commands import command_parser
from hpsft.models.hf_export import DEFAULT_MAX_SHARD_MB
from hpsft.utils.errors import exits_2_on_user_error


def parse_args(argv):
    parser = command_parser(
        "python -m hpsft.export", __doc__,
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


@exits_2_on_user_error
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from hpsft.trainer.export import export  # torch and DeepSpeed: not for --help

    checkpoint = export(args.checkpoint, args.out_dir, args.model, args.max_shard_mb, args.adapter_only)
    what = "the LoRA adapter of " if args.adapter_only else ""
    print(f"hpsft: exported {what}{checkpoint} to {args.out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
