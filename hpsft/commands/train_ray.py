"""Ray entry point: python -m hpsft.train_ray [--config FILE] key=value ...

Same config keys and run directory as `python -m hpsft.train`, plus the `ray` section.
Without ray.address it starts a new local Ray instance with this machine's CPUs/GPUs (on
127.0.0.1, no dashboard: docs/security.md), unless RAY_ADDRESS names a cluster (as `ray job
submit` does for its job); with ray.address it joins that cluster.
"""

import argparse
import importlib.util
import os
import sys

from hpsft.config import load_config
from hpsft.utils.errors import PREEMPTED_EXIT_CODE, Preempted, UserInputError, report_user_error


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


def ray_installed() -> bool:
    """Whether Ray (the [ray] extra: the SPMD path runs without it) can be imported, found
    without importing it: `connect` must set Ray's environment before the import."""
    try:
        return importlib.util.find_spec("ray") is not None
    except ValueError:  # sys.modules["ray"] is None: importing it fails
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpsft.train_ray", description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config file (e.g. configs/sft.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. ray.n_workers_per_node=4")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not ray_installed():
        print("hpsft: error: python -m hpsft.train_ray needs Ray, which is not installed: pip install 'hpsft[ray]' "
              "(or train without Ray: python -m hpsft.train)", file=sys.stderr, flush=True)
        return 2
    try:
        config = load_config(args.config, args.overrides)
        from hpsft.utils.distributed import workers_mesh  # torch, not ray: before connect() is fine

        workers_mesh(config.ray, config.engine)  # a mesh the workers cannot hold: refused before Ray starts
        connect(config.ray.address)  # before anything imports ray (its settings are read at import)
    except UserInputError as err:  # a ConfigError is one
        return report_user_error(err)
    # After connect(), outside its try: an error there must not reach an except clause naming
    # classes not imported yet (it became an UnboundLocalError).
    from hpsft.ray import RaySFTTrainer, WorkerFailedError, WorkerLostError

    try:
        trainer = RaySFTTrainer(config)
        try:
            trainer.fit()
        finally:
            trainer.close()
    except UserInputError as err:  # a ConfigError is one
        return report_user_error(err)
    except (WorkerLostError, WorkerFailedError) as err:
        if isinstance(err, WorkerFailedError):  # where it failed, then the one-line summary last
            print(f"hpsft: the worker's traceback:\n{err.remote_traceback}", file=sys.stderr)
        print(f"hpsft: error: {err}", file=sys.stderr, flush=True)
        return 1
    except Preempted as stop:  # its checkpoint saved; stop signals ignored since the ranks agreed (preemption.py)
        print(f"hpsft: {stop}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
