"""Ray entry point: python -m hpsft.train_ray [--config FILE] key=value ...

Same config keys and run directory as `python -m hpsft.train`, plus the `ray` section.
Without ray.address it starts a local Ray instance with this machine's CPUs/GPUs (no
dashboard), unless RAY_ADDRESS names a cluster (as `ray job submit` does for its job);
with ray.address it joins that cluster.
"""

import argparse
import os
import sys

from hpsft.config import load_config
from hpsft.errors import PREEMPTED_EXIT_CODE, Preempted
from hpsft.train import USER_ERRORS


def connect(address: str | None) -> None:
    import ray

    if address is None and "RAY_ADDRESS" not in os.environ:
        ray.init(include_dashboard=False)
    else:
        ray.init(address=address)  # None: RAY_ADDRESS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpsft.train_ray", description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config file (e.g. configs/sft.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. ray.n_workers_per_node=4")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import ray  # noqa: F401  (the [ray] extra: the SPMD path runs without it)
    except ModuleNotFoundError:
        print("hpsft: error: python -m hpsft.train_ray needs Ray, which is not installed: pip install 'hpsft[ray]' "
              "(or train without Ray: python -m hpsft.train)", file=sys.stderr, flush=True)
        return 2
    try:
        config = load_config(args.config, args.overrides)
        from hpsft.ray import RaySFTTrainer, WorkerFailedError, WorkerLostError  # heavy imports after the config

        connect(config.ray.address)
        trainer = RaySFTTrainer(config)
        try:
            trainer.fit()
        finally:
            trainer.close()
    except USER_ERRORS as err:
        print(f"hpsft: error: {err}", file=sys.stderr, flush=True)
        return 2
    except (WorkerLostError, WorkerFailedError) as err:
        if isinstance(err, WorkerFailedError):  # where it failed, then the one-line summary last
            print(f"hpsft: the worker's traceback:\n{err.remote_traceback}", file=sys.stderr)
        print(f"hpsft: error: {err}", file=sys.stderr, flush=True)
        return 1
    except Preempted as stop:
        from hpsft.trainer.preemption import ignore_stop_signals

        ignore_stop_signals()
        print(f"hpsft: {stop}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
