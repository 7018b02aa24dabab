"""Process-group set-up for every launcher: none, torchrun, the deepspeed launcher, srun."""

import os
import socket
import subprocess
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_from_slurm() -> None:
    """srun starts one task per rank but sets no torch variables: derive them."""
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
            check=True, capture_output=True, text=True,
        ).stdout.split()
        os.environ["MASTER_ADDR"] = nodes[0]
    # A port derived from the job id: every task computes the same one without talking.
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Initialise torch.distributed (through DeepSpeed) from the launcher's environment;
    a collective waits `timeout_s` for the other ranks before failing."""
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
    import deepspeed

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
