"""A private one-node Slurm cluster for tests (fixture `slurm_cluster`).

Everything lives in one temp dir: a munged with its own key/socket/pid/log/seed files,
a slurm.conf whose state, spool, pid and log paths point inside that dir, and
`slurmctld -D` + `slurmd -D -N localhost`, each started in its own session (setsid).
Clients (sbatch, srun, squeue, ...) find this cluster only through `SLURM_CONF`, which
`cluster.env()` sets; a system Slurm, if any, is never read, started or stopped.

Teardown cancels this cluster's jobs, stops exactly the daemons it started (their
process groups, by PID) plus any leftover process carrying this cluster's marker
variable in its environment (slurmstepd and job tasks, which leave the daemons' process
groups), then removes the temp dir. Missing binaries skip the tests: install them with
`.ci/install_system_packages.sh`.
"""

import getpass
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
# Set in the environment of every daemon (and so of slurmstepd) and of every job this
# fixture submits: teardown finds leftover processes of this cluster by it.
MARKER = "HPSFT_TEST_SLURM_CLUSTER"


def missing_binaries() -> list[str]:
    # /usr/sbin holds the daemons and is not on every user's PATH.
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return "(no file)"


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}

    # -- environment -------------------------------------------------------------------
    def env(self, base: dict | None = None) -> dict:
        """`base` (default: this process's environment) pointed at this cluster. SLURM_*
        variables of an enclosing job (pytest itself run under Slurm) are dropped: they
        would otherwise leak into the job this cluster runs."""
        env = {k: v for k, v in (base if base is not None else os.environ).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        env[MARKER] = str(self.root)
        return env

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return self.run_with_env(self.env(), *cmd, check=check, timeout=timeout)

    def run_with_env(self, env: dict, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a client command with `env` (from `self.env(...)`, which points at this cluster)."""
        proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}\n{self.logs()}")
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {name} log (tail)\n{tail(self.root / 'log' / f'{name}.log')}"
                         for name in ("munged", "slurmctld", "slurmd"))

    # -- start -------------------------------------------------------------------------
    def write_files(self) -> None:
        for d in ("munge", "log", "state", "spool", "run"):
            (self.root / d).mkdir()
        # munged refuses a key readable by others; clients must reach the socket's dir.
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "munge").chmod(0o755)
        self.root.chmod(0o755)

        user = getpass.getuser()
        root = self.root
        self.conf.write_text(f"""\
# Written by tests/slurm_cluster.py: a private one-node cluster on 127.0.0.1.
ClusterName=hpsfttest
SlurmctldHost=localhost(127.0.0.1)
SlurmUser={user}
SlurmdUser={user}
# Free ports: never collide with a system Slurm (6817/6818) or another test session.
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (default 120 s): keep the tests quick.
AuthInfo=socket={self.munge_socket},cred_expire=10
# No cgroups here (containers, no systemd): track processes by parent PID, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
# Trust the CPUs= below even on a machine with fewer cores.
SlurmdParameters=config_overrides
# Random first job id: hpsft derives MASTER_PORT from the job id, so two test sessions
# on one machine (each with its own cluster) do not both start at job 1 / port 20001.
FirstJobId={random.randint(1000, 19000)}
# Finished jobs stay visible to `scontrol show job` for 10 minutes (no accounting here).
MinJobAge=600
KillWait=5
InactiveLimit=0
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")

    def start_daemon(self, name: str, cmd: list[str]) -> None:
        # start_new_session: setsid, so the daemon's process group is ours to signal and
        # nothing else's; its stdout/stderr go to a file for error messages.
        out = open(self.root / "log" / f"{name}.stdout", "wb")
        self.procs[name] = subprocess.Popen(cmd, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def wait_for(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode} while waiting for {what}\n"
                                       f"{tail(self.root / 'log' / f'{name}.stdout')}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout} s waiting for {what}\n{self.logs()}")

    def node_state(self) -> str:
        proc = self.run("sinfo", "-h", "-n", "localhost", "-o", "%T", check=False, timeout=10)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def start(self) -> None:
        self.write_files()
        m = self.root / "munge"
        self.start_daemon("munged", ["munged", "-F", f"--key-file={m / 'munge.key'}", f"--socket={self.munge_socket}",
                                     f"--pid-file={m / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                                     f"--seed-file={m / 'munged.seed'}"])
        self.wait_for("the munge socket", self.munge_socket.exists, 15)
        self.start_daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self.start_daemon("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)])
        self.wait_for("node localhost to be idle (sinfo)", lambda: self.node_state() == "idle", 60)

    # -- jobs --------------------------------------------------------------------------
    def job_state(self, job_id: str) -> str:
        """JobState from `scontrol show job` (no accounting here, so no sacct)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields["JobState"]

    def wait_job(self, job_id: str, timeout: float) -> str:
        """Poll `squeue -j` (sbatch --wait backs off to ~20 s) until the job has left the
        queue, then return its final state. Cancels the job on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False, timeout=10)
            state = proc.stdout.strip()
            # Finished jobs either vanish from squeue or show a terminal state.
            if proc.returncode == 0 and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED"):
                return self.job_state(job_id)
            time.sleep(0.5)
        self.run("scancel", job_id, check=False)
        raise TimeoutError(f"job {job_id} not finished after {timeout} s (cancelled)\n{self.logs()}")

    # -- stop --------------------------------------------------------------------------
    def marked_pids(self) -> list[int]:
        """Processes whose environment carries this cluster's marker (slurmstepd, job
        tasks): ours by construction, whatever process group they moved to."""
        needle = f"{MARKER}={self.root}".encode() + b"\0"
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if needle in (entry / "environ").read_bytes() + b"\0":
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                pass
        return pids

    def stop(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            # Cancel this cluster's jobs first so slurmd ends their steps cleanly.
            self.run("scancel", f"--user={getpass.getuser()}", check=False, timeout=10)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            try:  # children left in the group after the leader exited
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.marked_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm/munge binaries not installed ({', '.join(missing)}): run .ci/install_system_packages.sh")
    # A short path under /tmp: the munge socket path must stay under the 108-byte limit.
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="hpsft-slurm-")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
