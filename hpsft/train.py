"""SPMD entry point: python -m hpsft.train [--config FILE] key=value ...

Works alone (one process), under torchrun, the deepspeed launcher and srun.
"""

import argparse
import sys

from hpsft.config import ConfigError, load_config
from hpsft.errors import PREEMPTED_EXIT_CODE, Preempted, UserInputError

# Bad input the user can fix: reported as one line, no traceback.
USER_ERRORS = (ConfigError, UserInputError)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m hpsft.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m hpsft.train --config configs/sft.yaml trainer.total_steps=100 optim.lr=1e-4\n"
               "  torchrun --nproc_per_node 2 -m hpsft.train --config configs/sft.yaml engine.zero_stage=3\n"
               "every key and its default: hpsft/config/schema.py")
    parser.add_argument("--config", default=None, help="YAML config file (e.g. configs/sft.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=1e-5")
    # The deepspeed launcher appends --local_rank=N; the rank also arrives as LOCAL_RANK.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config, args.overrides)
        from hpsft.trainer import SFTTrainer  # heavy imports after the config is known good

        SFTTrainer(config).fit()
    except USER_ERRORS as err:
        print(f"hpsft: error: {err}", file=sys.stderr, flush=True)
        return 2
    except Preempted as stop:
        from hpsft.trainer.preemption import ignore_stop_signals

        ignore_stop_signals()
        print(f"hpsft: {stop}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
