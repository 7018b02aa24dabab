"""Ray entry point: python -m hpsft.train_ray [--config FILE] key=value ...

Same config keys and run directory as `python -m hpsft.train`, plus the `ray` section.
Without ray.address it starts a new local Ray instance with this machine's CPUs/GPUs (on
127.0.0.1, no dashboard: docs/security.md), unless RAY_ADDRESS names a cluster (as `ray job
submit` does for its job); with ray.address it joins that cluster.
"""

import argparse
import os
import sys

from hpsft.config import load_config
from hpsft.errors import PREEMPTED_EXIT_CODE, Preempted
from hpsft.train import USER_ERRORS


def connect(address: str | None) -> None:
    """Join the cluster the user named, or start a new local instance of this run's own: every
    port of it on 127.0.0.1, no dashboard, no usage statistics sent to Ray (docs/security.md)."""
    local = address is None and "RAY_ADDRESS" not in os.environ
    if local:
        # ray.init turns _node_ip_address=127.0.0.1 into the machine's address, and then its
        # servers (GCS, raylet, workers, metrics) listen on every interface; Ray's single-machine
        # mode (its default on macOS/Windows) keeps them all on loopback. Read when ray is imported.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if local:
        # "local": a new instance; ray.init() would join any cluster a `ray start` left on this machine.
        ray.init(address="local", include_dashboard=False)
    else:
        ray.init(address=address)  # None: RAY_ADDRESS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpsft.train_ray", description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config file (e.g. configs/sft.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. ray.n_workers_per_node=4")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config, args.overrides)
        connect(config.ray.address)  # before anything imports ray
        from hpsft.ray import RaySFTTrainer, WorkerDiedError, WorkerFailedError
        trainer = RaySFTTrainer(config)
        try:
            trainer.fit()
        finally:
            trainer.close()
    except USER_ERRORS as err:
        print(f"hpsft: error: {err}", file=sys.stderr, flush=True)
        return 2
    except (WorkerDiedError, WorkerFailedError) as err:
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
