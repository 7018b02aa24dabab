"""Process-group set-up for every launcher: none, torchrun, the deepspeed launcher, srun."""

import dataclasses
import itertools
import os
import shutil
import socket
import subprocess
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hpsft.utils.errors import UserInputError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_of(host: str) -> str:
    """`host`'s IPv4 address, or the name itself when it does not resolve here."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except socket.gaierror:
        return host


def cuda_device_index() -> int:
    """The GPU of this rank among the ones it sees: LOCAL_RANK when every rank of the node
    sees all of its GPUs (--gpus-per-node, torchrun), 0 when the launcher gave each rank
    its own single device (srun --gpus-per-task=1, Ray without NOSET_CUDA_VISIBLE_DEVICES)."""
    local_rank, visible = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): give each "
                           "rank one GPU or all of the node's")
    return local_rank


def env_from_slurm() -> None:
    """srun starts one task per rank but sets no torch variables: derive them."""
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        # The first node of the step (where task 0 runs), as an address: a short host name
        # may not resolve, or resolve differently, on the other nodes' interfaces.
        nodes = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ.get("SLURM_STEP_NODELIST", os.environ["SLURM_JOB_NODELIST"])],
            check=True, capture_output=True, text=True,
        ).stdout.split()
        os.environ["MASTER_ADDR"] = address_of(nodes[0])
    # A port derived from the job id: every task computes the same one without talking.
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def init_store_on_master_addr(timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store, which rank 0 serves on MASTER_ADDR only: torch's own (env://)
    listens on every interface, which only a launcher serving other nodes needs."""
    addr, port, rank = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
    if rank != 0:
        return dist.TCPStore(addr, port, int(os.environ["WORLD_SIZE"]), False, timeout=timeout)
    listener = socket.create_server((addr, port), family=socket.getaddrinfo(addr, port)[0][0])
    try:
        return dist.TCPStore(addr, port, int(os.environ["WORLD_SIZE"]), True, timeout=timeout,
                             master_listen_fd=listener.fileno())
    finally:
        listener.detach()  # the store owns the socket now


def init_distributed(backend: str | None = None, timeout_s: float = 300.0, own_store: bool = False) -> None:
    """Initialise torch.distributed (through DeepSpeed) from the launcher's environment;
    a collective waits `timeout_s` for the other ranks before failing.

    `own_store`: hpsft chose MASTER_ADDR (a Ray worker group): rank 0 serves the rendezvous
    there only (init_store_on_master_addr), as it does for a process started without a launcher.
    """
    if dist.is_initialized():
        return
    # Only inside an srun step (SLURM_STEP_ID set): the batch script's own process (or a
    # shell under salloc) also has SLURM_PROCID=0 and SLURM_NTASKS=N, and taking those
    # would make a lone process wait for N-1 ranks that never start.
    if "RANK" not in os.environ and "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ \
            and "SLURM_NTASKS" in os.environ:
        env_from_slurm()
    if "RANK" not in os.environ:  # a single process started without any launcher
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        own_store = True
    import deepspeed

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(cuda_device_index())
    timeout = timedelta(seconds=timeout_s)
    if own_store:  # DeepSpeed then adopts the initialised group
        dist.init_process_group(backend, store=init_store_on_master_addr(timeout), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass(frozen=True)
class Mesh:
    """Where the ranks of a run sit in its DP x PP x TP x SP layout (SP is Megatron-Core's CP):

        rank = ((pp_rank * DP + dp_rank) * SP + sp_rank) * TP + tp_rank

    TP varies fastest, then SP, DP, PP: Megatron-Core's default order "tp-cp-ep-dp-pp" (with SP as
    its CP; EP does not enter the dense layout), so its parallel_state groups and these agree. A
    TP group is a run of TP consecutive ranks (the ranks of one node first: its collectives run
    at every layer, forward and backward; DeepSpeed's AutoTP lays out its mesh the same way, so
    its data-parallel group, the ranks of one TP coordinate, holds every DP and SP rank). An SP
    group is the SP ranks of one TP coordinate, TP apart (consecutive without TP). A pipeline
    stage is a block of DP x SP x TP consecutive ranks. The ranks of one data-parallel rank (its
    TP x SP x PP ranks: a replica) get the same rows of each global batch.

    Expert parallelism (EP) spreads an MoE layer's experts over EP of the DP x SP ranks of a
    pipeline stage (the ranks of one TP coordinate, TP apart), as Megatron-Core carves its
    expert-model-parallel group with the expert tensor-parallel size equal to TP: it changes
    where experts live, not the dense layout above.

    `rank` is this process's; None on a driver outside the world (the Ray driver), which loads
    whole global batches for the ranks."""

    dp_size: int
    tp_size: int = 1
    sp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    rank: int | None = 0

    @classmethod
    def of_world(cls, world_size: int, rank: int | None, tp_size: int = 1, sp_size: int = 1, pp_size: int = 1,
                 ep_size: int = 1, world: str | None = None) -> "Mesh":
        """The mesh of `world_size` ranks with these model-parallel sizes (the engine section's),
        refused by name when they do not fit. `world`: what the ranks are, in the message."""
        world = world or f"the world size {world_size}"
        replica = tp_size * sp_size * pp_size
        if world_size % replica:
            sizes = [f"engine.{kind}_parallel_size={size}" for kind, size in
                     (("pipeline", pp_size), ("tensor", tp_size), ("sequence", sp_size)) if size > 1]
            dims = ["data-parallel size"] + [f"{kind}-parallel size" for kind, size in
                                             (("pipeline", pp_size), ("tensor", tp_size), ("sequence", sp_size))
                                             if size > 1 or kind != "pipeline"]
            raise UserInputError(f"{' x '.join(sizes)} does not divide {world}: the world is {' x '.join(dims)}")
        mesh = cls(world_size // replica, tp_size, sp_size, pp_size, ep_size, rank)
        if (mesh.dp_size * sp_size) % ep_size:
            raise UserInputError(
                f"engine.expert_parallel_size={ep_size} does not divide the {mesh.dp_size * sp_size} data-parallel x "
                f"sequence-parallel ranks of each pipeline stage, over which the experts are spread (as in "
                "Megatron-Core: tensor x expert x pipeline-parallel size divides the world)")
        return mesh

    @property
    def world_size(self) -> int:
        return self.dp_size * self.replica_size

    @property
    def replica_size(self) -> int:
        """The ranks of one data-parallel rank (TP x SP x PP): they get the same rows. A count every
        rank takes of its whole share (the loss tokens of its rows) sums to this many times the
        global count over the world."""
        return self.tp_size * self.sp_size * self.pp_size

    @property
    def weight_replicas(self) -> int:
        """The ranks holding the same weights (of one TP shard and pipeline stage), over which
        gradients are summed: DP x SP (Megatron-Core's data-parallel group with context parallel)."""
        return self.dp_size * self.sp_size

    def at(self, rank: int) -> "Mesh":
        """This mesh, seen from `rank`."""
        return dataclasses.replace(self, rank=rank)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def sp_rank(self) -> int:
        return self.rank // self.tp_size % self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.sp_size) % self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.sp_size * self.dp_size)

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp_size % self.ep_size

    @property
    def reports_counts(self) -> bool:
        """Whether this rank reports its share of the step's counts and sums (loss tokens, NLL,
        ...): the ranks of a replica train the same rows, so one of each TP group counts them, on
        the last pipeline stage, where the loss is. Every SP rank reports: each its own slices'."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1

    @property
    def loading_ranks(self) -> int:
        """How many processes each load a part of every global batch: one per data-parallel rank,
        or the driver alone (rank None), which loads whole batches."""
        return 1 if self.rank is None else self.dp_size

    @property
    def data_part(self) -> int:
        """Which of the loading_ranks parts of each global batch this process loads (its
        data-parallel rank; the driver: the only part)."""
        return 0 if self.rank is None else self.dp_rank

    def groups(self, *dims: str) -> list[list[int]]:
        """The ranks of every group that varies along `dims` (of "tp", "sp", "dp", "pp") and
        agrees on the others, each in rank order, groups by their first rank: the same on every
        rank (Megatron-Core's RankGenerator.get_ranks for the same dims, CP for SP)."""
        sizes = {"tp": self.tp_size, "sp": self.sp_size, "dp": self.dp_size, "pp": self.pp_size}
        strides = {"tp": 1, "sp": self.tp_size, "dp": self.tp_size * self.sp_size,
                   "pp": self.tp_size * self.sp_size * self.dp_size}
        fixed = [dim for dim in sizes if dim not in dims]
        groups = []
        for others in itertools.product(*(range(sizes[d]) for d in fixed)):
            base = sum(index * strides[d] for d, index in zip(fixed, others))
            groups.append(sorted(base + sum(index * strides[d] for d, index in zip(dims, varying))
                                 for varying in itertools.product(*(range(sizes[d]) for d in dims))))
        return sorted(groups)

    def expert_parallel_ranks(self) -> list[list[int]]:
        """Every expert-parallel group's ranks: EP ranks of one TP coordinate and pipeline stage,
        TP apart (Megatron-Core's with its expert tensor-parallel size TP), groups by first rank."""
        stage = self.dp_size * self.sp_size * self.tp_size
        return sorted([pp * stage + (edp * self.ep_size + ep) * self.tp_size + tp for ep in range(self.ep_size)]
                      for pp in range(self.pp_size) for edp in range(self.dp_size * self.sp_size // self.ep_size)
                      for tp in range(self.tp_size))

    def coordinates(self) -> str:
        extra = (f", pp {self.pp_rank}" if self.pp_size > 1 else "") + (f", ep {self.ep_rank}" if self.ep_size > 1
                                                                       else "")
        return f"rank {self.rank}: dp {self.dp_rank}, tp {self.tp_rank}, sp {self.sp_rank}{extra}"

    def description(self) -> str:
        """The sizes, as the start-up line prints them (PP and EP when they are > 1)."""
        return (f"DP {self.dp_size}" + (f" x PP {self.pp_size}" if self.pp_size > 1 else "")
                + f" x TP {self.tp_size} x SP {self.sp_size}" + (f" x EP {self.ep_size}" if self.ep_size > 1 else ""))


def mesh(engine_config) -> Mesh:
    """This process's place in the world laid out by the config section `engine` (its
    *_parallel_size keys), after init_distributed: built once at start-up, handed to everything
    that counts ranks."""
    return Mesh.of_world(world_size(), rank(), engine_config.tensor_parallel_size,
                         engine_config.sequence_parallel_size, engine_config.pipeline_parallel_size,
                         engine_config.expert_parallel_size)


def workers_mesh(ray_config, engine_config) -> Mesh:
    """The mesh of a Ray worker group (the driver: rank None), checked before Ray starts. Rank r
    runs on node r // ray.n_workers_per_node (RayResourcePool), so a TP group (consecutive ranks)
    stays on one node, where its collectives (every layer, forward and backward) are cheapest,
    only if TP divides n_workers_per_node."""
    tp, per_node = engine_config.tensor_parallel_size, ray_config.n_workers_per_node
    if per_node % tp:
        raise UserInputError(f"engine.tensor_parallel_size={tp} does not divide ray.n_workers_per_node={per_node}: "
                             "a tensor-parallel group's ranks run on one node; use a TP size that divides the "
                             "workers per node")
    workers = ray_config.nnodes * per_node
    return Mesh.of_world(workers, None, tp, engine_config.sequence_parallel_size, engine_config.pipeline_parallel_size,
                         engine_config.expert_parallel_size,
                         world=f"the {workers} Ray workers (ray.nnodes x ray.n_workers_per_node)")


def sequence_parallel_group(place: Mesh):
    """This rank's SP process group (a collective: every rank creates every group)."""
    groups = [(ranks, dist.new_group(ranks)) for ranks in place.groups("sp")]
    return next(group for ranks, group in groups if place.rank in ranks)


def tensor_parallel_group(place: Mesh):
    """This rank's TP process group (a collective: every rank creates every group)."""
    groups = [(ranks, dist.new_group(ranks)) for ranks in place.groups("tp")]
    return next(group for ranks, group in groups if place.rank in ranks)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def ranks_sharing(directory: Path) -> tuple[list[int], str]:
    """The ranks that see the same `directory` as this one (every rank on a shared file
    system, the ranks of one node on a node-local one), and a name for this start of the job
    that every rank knows. Each rank leaves a file in `directory/.ranks/<name>/` and lists
    the others'; two barriers, quick on every rank (nothing slow runs before this)."""
    attempt = [uuid.uuid4().hex if rank() == 0 else None]
    if world_size() > 1:
        dist.broadcast_object_list(attempt, src=0)
    folder = directory / ".ranks" / attempt[0]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(rank())).touch()
    barrier()
    team = sorted(int(p.name) for p in folder.iterdir())
    barrier()  # every rank has listed the folder: its first rank removes it
    if rank() == team[0]:
        shutil.rmtree(folder, ignore_errors=True)
    return team, attempt[0]


def on_rank0_then_share(fn):
    """Run `fn` on rank 0 only and share its (picklable) result or its error with every
    rank: other ranks never wait forever on a barrier while rank 0 has already failed."""
    result = [None, None]
    if rank() == 0:
        try:
            result[0] = fn()
        except Exception as err:  # re-raised on every rank below
            result[1] = err
    if world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    if result[1] is not None:
        raise result[1]
    return result[0]


def comm_device() -> torch.device:
    """Where small collective tensors live: NCCL only talks GPU memory."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def all_reduce_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=comm_device())
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def launch_description() -> str:
    """Which launcher started this process, the world size, the nodes and the ranks per node,
    from the variables that launcher sets (after init_distributed)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        name, nodes, per_node = "torchrun", env.get("GROUP_WORLD_SIZE", "?"), env.get("LOCAL_WORLD_SIZE", "?")
    elif "CROSS_SIZE" in env:
        name, nodes, per_node = "deepspeed", env["CROSS_SIZE"], env.get("LOCAL_SIZE", "?")
    elif "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        name = "srun"
        nodes = env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "?"))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "?"))
    elif world_size() == 1:
        name, nodes, per_node = "none", "1", "1"
    else:  # RANK/WORLD_SIZE/MASTER_* exported by hand or by an unknown launcher
        name, nodes, per_node = "environment variables", "?", "?"
    return f"launcher {name}: world size {world_size()}, {nodes} node(s), {per_node} rank(s) per node"
