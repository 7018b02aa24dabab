"""A group of Ray actors, one data-parallel rank each, running the SPMD path's worker class.

Each actor gets the torchrun environment of its rank (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/MASTER_PORT of rank 0's node), joins torch.distributed, builds the worker and
then runs its methods. The worker's public methods appear on the group: a call goes to
every rank and returns a GroupFuture; `.get()` collects the results in rank order. An
argument wrapped in PerRank is scattered (rank r gets element r); any other goes to all.
"""

import os
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayTaskError

from hpsft import distributed
from hpsft.ray.resource_pool import RayResourcePool


@dataclass(frozen=True)
class ClassWithInitArgs:
    """A class and its constructor arguments: built inside each actor, not on the driver."""

    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


class PerRank(list):
    """One value per rank: rank r receives element r."""


class WorkerDiedError(RuntimeError):
    """A worker's process is gone (killed, out of memory, its node lost)."""


class WorkerFailedError(RuntimeError):
    """A worker's method raised an exception."""


@ray.remote
class RankActor:
    def node_address_and_free_port(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), distributed.free_port()

    def pid(self) -> int:
        return os.getpid()

    def build(self, worker: ClassWithInitArgs, rank_env: dict, backend: str | None) -> None:
        os.environ.update(rank_env)
        distributed.init_distributed(backend, own_store=True)
        self.worker = worker.cls(*worker.args, **worker.kwargs)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)


class GroupFuture:
    def __init__(self, group: "RayWorkerGroup", method: str, refs: list):
        self.group, self.method, self.refs = group, method, refs

    def get(self) -> list:
        """Every rank's result, in rank order.

        The first rank to fail ends the wait at once, not when the slowest finishes: the
        others may be blocked in a collective with it and never return, so the whole
        group is killed and the error names the failed rank and the cause.
        """
        rank_of = {ref: rank for rank, ref in enumerate(self.refs)}
        results = [None] * len(self.refs)
        pending = list(self.refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as err:
                where = self.group.describe(rank)
                self.group.shutdown()
                raise WorkerDiedError(f"worker rank {rank} ({where}) died during {self.method}: {err}") from None
            except RayTaskError as err:
                where = self.group.describe(rank)
                self.group.shutdown()
                raise WorkerFailedError(
                    f"worker rank {rank} ({where}) failed in {self.method}: {type(err.cause).__name__}: {err.cause}"
                ) from err.cause
        return results


class RayWorkerGroup:
    def __init__(self, pool: RayResourcePool, worker: ClassWithInitArgs, backend: str | None = None):
        self.pool, self.worker_class = pool, worker.cls
        placements = pool.placements()
        self.actors = [
            RankActor.options(
                num_cpus=pool.bundle["CPU"], num_gpus=pool.bundle.get("GPU", 0),
                scheduling_strategy=p.scheduling_strategy(),
            ).remote()
            for p in placements
        ]
        self.pids = None
        self.pids = self.submit("pid", lambda actor: actor.pid).get()
        master_addr, master_port = self.submit(
            "node_address_and_free_port", lambda actor: actor.node_address_and_free_port).get()[0]
        envs = [{
            "RANK": str(p.rank), "WORLD_SIZE": str(pool.world_size),
            # A GPU actor sees only its own GPU unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
            # is set: distributed.cuda_device_index picks device 0 or LOCAL_RANK accordingly.
            "LOCAL_RANK": str(p.local_rank),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        } for p in placements]
        self.submit("build", lambda actor: actor.build, worker, PerRank(envs), backend).get()

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    def describe(self, rank: int) -> str:
        return f"pid {self.pids[rank]}" if self.pids else "starting"

    def submit(self, name: str, actor_method, *args, **kwargs) -> GroupFuture:
        """Call `actor_method(actor)` on every rank, scattering PerRank arguments."""
        if not self.actors:
            raise RuntimeError(f"{name}: this worker group was shut down (after a worker failure?)")
        refs = []
        for rank, actor in enumerate(self.actors):
            rank_args = [a[rank] if isinstance(a, PerRank) else a for a in args]
            rank_kwargs = {k: v[rank] if isinstance(v, PerRank) else v for k, v in kwargs.items()}
            refs.append(actor_method(actor).remote(*rank_args, **rank_kwargs))
        return GroupFuture(self, name, refs)

    def __getattr__(self, method: str):
        """The worker class's public methods, run on every rank: group.train_batch(...).get()."""
        worker_class = self.__dict__.get("worker_class")
        if method.startswith("_") or not callable(getattr(worker_class, method, None)):
            raise AttributeError(f"{getattr(worker_class, '__name__', None)} has no public method {method!r}")
        return lambda *args, **kwargs: self.submit(method, lambda actor: actor.call, method, *args, **kwargs)

    def shutdown(self) -> None:
        """Kill every actor and free their resources (idempotent)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        self.pool.release()
