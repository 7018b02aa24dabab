"""A group of Ray actors, one data-parallel rank each, running the SPMD path's worker class.

Each actor gets the torchrun environment of its rank (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/MASTER_PORT of rank 0's node), is seeded as an SPMD rank is, joins
torch.distributed, builds the worker and then runs its methods. The worker's public
methods appear on the group: a call goes to every rank and returns a GroupFuture; `.get()`
collects the results in rank order. An argument wrapped in PerRank is scattered (rank r
gets element r); any other goes to all.

A failed call names the rank, its node and pid: WorkerFailedError (the method raised; it
carries the remote traceback), WorkerDiedError (the process is gone), WorkerHungError (no
answer within ray.call_timeout_s). The last two are WorkerLostError: the driver may build
a new group and go on from the last checkpoint.
"""

import os
import re
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayTaskError

from hpsft.utils import distributed
from hpsft.ray.resource_pool import RayResourcePool

# Test hooks (tests/test_ray.py) set in the driver's environment reach every rank's process.
TEST_HOOK_PREFIX = "HPSFT_TEST_"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# How long a failed call waits for Ray to report another rank's death, which would be the
# cause (Ray notices a process exit within about a second).
DEATH_NOTICE_S = 5.0


@dataclass(frozen=True)
class ClassWithInitArgs:
    """A class and its constructor arguments: built inside each actor, not on the driver."""

    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


class PerRank(list):
    """One value per rank: rank r receives element r."""


class WorkerLostError(RuntimeError):
    """A worker can no longer take part (dead or hung): a new group may take over."""


class WorkerDiedError(WorkerLostError):
    """A worker's process is gone (killed, out of memory, its node lost)."""


class WorkerHungError(WorkerLostError):
    """A worker did not answer a call within ray.call_timeout_s."""


class WorkerFailedError(RuntimeError):
    """A worker's method raised an exception; `remote_traceback` is where, in that process."""

    def __init__(self, message: str, remote_traceback: str):
        super().__init__(message)
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class RankProcess:
    """Where a rank runs."""

    node_ip: str
    node_id: str
    pid: int
    gpu_ids: tuple


def cuda_device_of(gpu_ids, cuda_visible_devices: str | None) -> int:
    """The CUDA index, among the devices this process sees, of the GPU Ray gave it: 0 when
    Ray narrowed CUDA_VISIBLE_DEVICES to that GPU, its position in CUDA_VISIBLE_DEVICES or
    its own id when RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES left the node's list alone."""
    if len(gpu_ids) != 1:
        raise RuntimeError(f"a rank needs exactly one GPU; Ray gave this one {list(gpu_ids)}")
    gpu = str(gpu_ids[0])
    if cuda_visible_devices is None:
        return int(gpu)
    visible = [d.strip() for d in cuda_visible_devices.split(",")]
    if gpu not in visible:
        raise RuntimeError(f"Ray gave this rank GPU {gpu}, not in CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}")
    return visible.index(gpu)


@ray.remote
class RankActor:
    def where(self) -> RankProcess:
        context = ray.get_runtime_context()
        return RankProcess(ray.util.get_node_ip_address(), context.get_node_id(), os.getpid(),
                           tuple(ray.get_gpu_ids()))

    def free_port(self) -> int:
        return distributed.free_port()

    def build(self, worker: ClassWithInitArgs, rank_env: dict, backend: str | None, seed: int,
              collective_timeout_s: float) -> None:
        from hpsft.trainer.rng import seed_everything

        os.environ.update(rank_env)
        gpu_ids = ray.get_gpu_ids()
        if gpu_ids:  # DeepSpeed and distributed.cuda_device_index take the device from LOCAL_RANK
            os.environ["LOCAL_RANK"] = str(cuda_device_of(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES")))
        seed_everything(seed)  # as every SPMD rank seeds itself in SFTTrainer.__init__
        distributed.init_distributed(backend, collective_timeout_s, own_store=True)
        self.worker = worker.cls(*worker.args, **worker.kwargs)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)


def collective_timed_out(cause: BaseException) -> bool:
    """Whether a rank's error is its collective giving up on a peer that never came (gloo:
    "Timed out waiting ...ms for recv operation"; NCCL's watchdog: "collective operation
    timeout"): the peer hung, which a restart can cure, unlike a bug of the rank itself."""
    return "timed out" in str(cause).lower() or "operation timeout" in str(cause).lower()


class GroupFuture:
    def __init__(self, group: "RayWorkerGroup", method: str, refs: list, timeout_s: float | None):
        self.group, self.method, self.refs, self.timeout_s = group, method, refs, timeout_s

    def get(self) -> list:
        """Every rank's result, in rank order.

        The first rank to fail ends the wait at once, not when the slowest finishes: the
        others may be blocked in a collective with it and never return, so the whole
        group is killed and the error names the failed rank and the cause. So does a call
        still unanswered after the group's call timeout.
        """
        rank_of = {ref: rank for rank, ref in enumerate(self.refs)}
        results = [None] * len(self.refs)
        pending = list(self.refs)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while pending:
            wait_s = None if deadline is None else max(deadline - time.monotonic(), 0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:
                ranks = sorted(rank_of[ref] for ref in pending)
                where = "; ".join(f"rank {r} ({self.group.describe(r)})" for r in ranks)
                self.group.shutdown()
                raise WorkerHungError(f"worker {where} did not finish {self.method} within "  # hung or waiting on it
                                      f"{self.timeout_s:g} s (ray.call_timeout_s)")
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as err:
                where = self.group.describe(rank)
                self.group.shutdown()
                raise WorkerDiedError(f"worker rank {rank} ({where}) died during {self.method}: {err}") from None
            except RayTaskError as err:
                # A rank whose peer died mid-collective fails too (gloo/NCCL: connection closed),
                # often before Ray reports the death: the death is the cause, and restartable.
                died = self.dead_rank(pending, rank_of)
                if died is not None:
                    where = self.group.describe(died)
                    self.group.shutdown()
                    raise WorkerDiedError(f"worker rank {died} ({where}) died during {self.method} (rank {rank} "
                                          f"then failed: {type(err.cause).__name__})") from None
                where = self.group.describe(rank)
                self.group.shutdown()
                cause = err.cause
                if collective_timed_out(cause):
                    raise WorkerHungError(
                        f"worker rank {rank} ({where}) gave up waiting for the other ranks in a collective during "
                        f"{self.method} (engine.collective_timeout_s): a rank hung ({type(cause).__name__}: {cause})"
                    ) from None
                raise WorkerFailedError(
                    f"worker rank {rank} ({where}) failed in {self.method}: {type(cause).__name__}: {cause}",
                    ANSI_ESCAPE.sub("", str(err)),
                ) from None
        return results

    @staticmethod
    def dead_rank(pending: list, rank_of: dict) -> int | None:
        """The first of the `pending` calls' ranks found dead within DEATH_NOTICE_S."""
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_NOTICE_S) if pending else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError:
                return rank_of[ref]
            except RayTaskError:
                pass
        return None


class RayWorkerGroup:
    def __init__(self, pool: RayResourcePool, worker: ClassWithInitArgs, backend: str | None = None,
                 seed: int = 0, call_timeout_s: float | None = None, collective_timeout_s: float = 300.0):
        self.pool, self.worker_class, self.call_timeout_s = pool, worker.cls, call_timeout_s
        placements = pool.placements()
        self.actors = [
            RankActor.options(
                num_cpus=pool.bundle["CPU"], num_gpus=pool.bundle.get("GPU", 0),
                scheduling_strategy=p.scheduling_strategy(),
            ).remote()
            for p in placements
        ]
        self.processes: list[RankProcess] | None = None
        self.processes = self.submit("where", lambda actor: actor.where).get()
        master_port = self.submit("free_port", lambda actor: actor.free_port).get()[0]
        test_hooks = {k: v for k, v in os.environ.items() if k.startswith(TEST_HOOK_PREFIX)}
        envs = [{
            **test_hooks,
            "RANK": str(p.rank), "WORLD_SIZE": str(pool.world_size),
            "LOCAL_RANK": str(p.local_rank),  # on a GPU, RankActor.build makes it the rank's device
            "MASTER_ADDR": self.processes[0].node_ip, "MASTER_PORT": str(master_port),
        } for p in placements]
        self.submit("build", lambda actor: actor.build, worker, PerRank(envs), backend, seed,
                    collective_timeout_s).get()

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def describe(self, rank: int) -> str:
        if not self.processes:
            return "starting"
        p = self.processes[rank]
        return f"node {p.node_ip} ({p.node_id[:8]}), pid {p.pid}"

    def placement_lines(self) -> list[str]:
        """One line per rank: which node (address and Ray node id) and process it runs in."""
        return [f"rank {rank}: node {p.node_ip} ({p.node_id}), pid {p.pid}"
                + (f", GPU {','.join(map(str, p.gpu_ids))}" if p.gpu_ids else "")
                for rank, p in enumerate(self.processes)]

    def node_groups(self, groups: list[list[int]]) -> list[str]:
        """One line per group of consecutive ranks (the tensor-parallel groups, Mesh.groups("tp")):
        its ranks and the node they run on. A group over two nodes stops the worker group: its
        collectives, at every layer, would cross the network (RayResourcePool puts a node's ranks
        in one bundle; ray.n_workers_per_node is a multiple of the TP size)."""
        lines = []
        for ranks in groups:
            first, last = ranks[0], ranks[-1]
            nodes = {(self.processes[r].node_ip, self.processes[r].node_id) for r in ranks}
            if len(nodes) > 1:
                self.shutdown()
                raise RuntimeError(f"ranks {first}-{last} (one tensor-parallel group) run on "
                                   f"{len(nodes)} nodes: {sorted(nodes)}")
            (ip, node_id), = nodes
            lines.append(f"ranks {first}-{last}: node {ip} ({node_id})")
        return lines

    def submit(self, name: str, actor_method, *args, **kwargs) -> GroupFuture:
        """Call `actor_method(actor)` on every rank, scattering PerRank arguments."""
        if not self.actors:
            raise RuntimeError(f"{name}: this worker group was shut down (after a worker failure?)")
        refs = []
        for rank, actor in enumerate(self.actors):
            rank_args = [a[rank] if isinstance(a, PerRank) else a for a in args]
            rank_kwargs = {k: v[rank] if isinstance(v, PerRank) else v for k, v in kwargs.items()}
            refs.append(actor_method(actor).remote(*rank_args, **rank_kwargs))
        return GroupFuture(self, name, refs, self.call_timeout_s)

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
