"""The `hpsft` command: one entry point, a subcommand per task.

    hpsft train --config configs/sft.yaml key=value ...      SPMD training (alone, torchrun, deepspeed, srun)
    hpsft <subcommand> --help                                its options, with an example

Each subcommand is a module of hpsft/commands/ with its own command line (`hpsft train` is
`python -m hpsft.train`, a shim of hpsft/commands/train.py), imported only when chosen: `hpsft --help` stays quick and needs none of the optional extras.
"""

import importlib
import sys

# name -> (module whose main(argv) runs it, what it does)
SUBCOMMANDS = {
    "train": ("hpsft.commands.train", "train, SPMD: one process per rank (alone, torchrun, deepspeed, srun)"),
    "train-ray": ("hpsft.commands.train_ray", "train with a driver and a Ray worker group (needs hpsft[ray])"),
    "export": ("hpsft.commands.export", "any checkpoint -> a Hugging Face model folder"),
    "inspect-data": ("hpsft.commands.inspect_data", "show what a config trains on: loss mask, lengths, refused rows"),
    "generate": ("hpsft.commands.generate", "sample replies from a model folder or a run's export"),
    "samples": ("hpsft.commands.samples", "a run's replies before and after training, on held-out prompts"),
    "plot": ("hpsft.commands.plot", "a run's metrics -> PNG charts (needs hpsft[plot])"),
    "prepare-data": ("hpsft.commands.prepare_data", "chat data (yours, or the packaged corpora) -> parquet + a report"),
    "prepare-model": ("hpsft.commands.prepare_model", "a GGUF file or HF folder (or the packaged model) -> a checked HF folder"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return "usage: hpsft <subcommand> [options]\n\nsubcommands:\n" + "\n".join(lines) + \
        "\n\n`hpsft <subcommand> --help` lists a subcommand's options, with an example."


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"hpsft: error: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
