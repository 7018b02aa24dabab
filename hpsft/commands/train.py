"""SPMD entry point: python -m hpsft.train [--config FILE] key=value ...

Works alone (one process), under torchrun, the deepspeed launcher and srun.
"""

import argparse
import os
import sys
import traceback

from hpsft.commands import command_parser
from hpsft.config import load_config
from hpsft.utils.errors import PREEMPTED_EXIT_CODE, Preempted, UserInputError, report_user_error


def parse_args(argv):
    parser = command_parser(
        "python -m hpsft.train", __doc__,
        epilog="examples:\n"
               "  python -m hpsft.train --config configs/sft.yaml trainer.total_steps=100 optim.lr=1e-4\n"
               "  torchrun --nproc_per_node 2 -m hpsft.train --config configs/sft.yaml engine.zero_stage=3\n"
               "every key and its default: hpsft/config/schema.py")
    parser.add_argument("--config", default=None, help="YAML config file (e.g. configs/sft.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=1e-5")
    # The deepspeed launcher appends --local_rank=N; the rank also arrives as LOCAL_RANK.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def failed(status: int) -> int:
    """End a failed rank of a multi-process run now. The other ranks may be blocked in a
    collective with this one: the interpreter's normal teardown (the process group's
    destructor, non-daemon threads) could wait on them, and they wait on this process. Once
    it is gone, its broken connections fail the others' collectives (gloo), its launcher ends
    them (torchrun, the deepspeed launcher, `srun --kill-on-bad-exit`), or at the latest
    engine.collective_timeout_s does."""
    dist = sys.modules.get("torch.distributed")  # not imported by a run that failed at its config
    if dist is not None and dist.is_initialized() and dist.get_world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config, args.overrides)
        from hpsft.trainer import SFTTrainer  # heavy imports after the config is known good

        SFTTrainer(config).fit()
    except UserInputError as err:  # a ConfigError is one
        return failed(report_user_error(err))
    except Preempted as stop:  # its checkpoint saved; stop signals ignored since the ranks agreed (preemption.py)
        print(f"hpsft: {stop}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except Exception:  # a bug: its traceback, then the same quick exit
        traceback.print_exc()
        return failed(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
