"""hpsft under Slurm: scripts/train_slurm.sbatch submitted with sbatch to a private
one-node cluster (tests/slurm_cluster.py), 2 tasks under srun, must train exactly like
the same config under torchrun with 2 processes. On the tiny random model with SmolLM2's
tokenizer (conftest.tiny_chat_model): the jobs are compared with torchrun, not judged alone."""

import re
import shutil
import sys
import tempfile
import time

import psutil
import pytest

from hpsft.utils.distributed import free_port
from tests.conftest import (REPO, RAY_ENV, assert_ok, assert_same_steps, base_overrides, chat_parquet,
                            preloaded_executable, preloaded_ray_workers, read_metrics, run_cli, train_env, train_steps)
from tests.slurm_cluster import slurm_cluster  # noqa: F401  (fixture)

SBATCH_SCRIPT = REPO / "scripts" / "train_slurm.sbatch"
# The jobs' config (ZeRO-2, 4 steps; the first job trains 2 of them and exports).
JOB_CONFIG = {"engine.zero_stage": 2, "trainer.total_steps": 4, "trainer.export_hf": "false"}


def job_env(cluster) -> dict:
    """The environment a job of `cluster` gets (sbatch exports it): the venv's python (started
    preloaded: its tasks are forked runs of this pytest process's server, tests/preloaded.py),
    the prebuilt DeepSpeed ops, SLURM_CONF of the private cluster, and no rank variables of a
    launcher this test may run under (a job must derive its own)."""
    python = preloaded_executable()  # first: it may start the server train_env() names
    env = cluster.env(train_env())
    env["HPSFT_PYTHON"] = python
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def data(tmp_path_factory, chat_rows):
    """tiny_data's 16 train and 8 validation conversations, for every test of this module."""
    return chat_parquet(tmp_path_factory.mktemp("slurm_data"), chat_rows)


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory, tiny_chat_model, data) -> dict:
    """step -> metrics of the jobs' config under torchrun with 2 processes: one reference run
    for both jobs (the 2-step job compares its steps with the first 2: the LR schedule over 4
    steps differs only in the updates after step 2)."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    assert_ok(run_cli("hpsft.train", base_overrides(tiny_chat_model, *data, out, **JOB_CONFIG), nproc=2))
    return train_steps(out)


def run_two_task_job(tmp_path, slurm_cluster, tiny_chat_model, data, out, **extra) -> tuple[str, str]:
    """scripts/train_slurm.sbatch as a 2-task job on one node, waited for: (job id, its output)."""
    train, val = data
    log = tmp_path / "slurm-%j.out"
    submit = slurm_cluster.run_with_env(
        job_env(slurm_cluster), "sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
        "--cpus-per-task=1", f"--chdir={REPO}", f"--output={log}", str(SBATCH_SCRIPT),
        *base_overrides(tiny_chat_model, train, val, out, **extra))
    job_id = submit.stdout.strip().split(";")[0]
    state = slurm_cluster.wait_job(job_id, timeout=300)
    job_log = tmp_path / f"slurm-{job_id}.out"
    output = job_log.read_text(errors="replace") if job_log.exists() else "(no job output file)"
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{output[-6000:]}\n{slurm_cluster.logs()}"
    assert f"hpsft: job {job_id} nodes=localhost tasks=2" in output
    return job_id, output


@pytest.mark.slow
def test_sbatch_two_tasks_trains_like_torchrun(tmp_path, slurm_cluster, tiny_chat_model, data,  # noqa: F811
                                               torchrun_run):
    """A 2-task job trains both its steps as torchrun's 2 ranks do (no bug was planted here:
    the Slurm path's own code, deriving ranks from SLURM_* variables, gives the same ranks as
    torchrun on one node whatever slip it has; a job whose tasks do not form one world fails
    the shard-count check)."""
    slurm_out = tmp_path / "slurm_run"
    t0 = time.monotonic()
    job_id, _ = run_two_task_job(tmp_path, slurm_cluster, tiny_chat_model, data, slurm_out,
                                 **{**JOB_CONFIG, "trainer.total_steps": 2, "trainer.export_hf": "true"})
    slurm_seconds = time.monotonic() - t0

    # 2 ranks really ran under srun: one ZeRO optimizer shard per rank in the final checkpoint.
    metrics = read_metrics(slurm_out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert (slurm_out / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    assert sorted(p.name for p in (slurm_out / "checkpoints" / "global_step_2").glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    # The same config under torchrun, 2 processes: the same samples, losses and unclipped gradient
    # norms of both steps (step 2's are taken at the weights step 1 trained).
    assert_same_steps(train_steps(slurm_out), torchrun_run, [1, 2], rtol=1e-5)
    print(f"slurm job {job_id}: {slurm_seconds:.1f} s")


@pytest.mark.slow
def test_sbatch_two_tasks_train_the_megatron_engine_at_pp2_like_torchrun(  # noqa: F811
        tmp_path, slurm_cluster, tiny_chat_model, data, torchrun_run):
    """engine.name=megatron, PP=2 over the job's 2 tasks (srun's SLURM_* ranks into Megatron's
    parallel state): both steps' samples, loss and unclipped grad norm equal torchrun's
    2-rank DeepSpeed run of the same global batch (1e-5, as test_megatron_engine compares
    Megatron PP=2 with DeepSpeed), one engine file per rank in the checkpoint."""
    pytest.importorskip("megatron.core")
    slurm_out = tmp_path / "megatron_pp2"
    run_two_task_job(tmp_path, slurm_cluster, tiny_chat_model, data, slurm_out,
                     **{**JOB_CONFIG, "trainer.total_steps": 2, "engine.name": "megatron",
                        "engine.pipeline_parallel_size": 2})
    assert sorted(p.name for p in (slurm_out / "checkpoints" / "global_step_2" / "megatron").glob("rank_*.pt")) == [
        "rank_00000.pt", "rank_00001.pt"]
    assert_same_steps(train_steps(slurm_out), torchrun_run, [1, 2], rtol=1e-5)


PROBE = ("import os; from hpsft.utils.distributed import init_distributed, rank, world_size; init_distributed(); "
         "print(f'{os.environ.get(\"PROBE\")} rank={rank()} world={world_size()} "
         "master={os.environ[\"MASTER_ADDR\"]}', flush=True)")


@pytest.mark.slow
def test_batch_step_process_is_alone_and_srun_tasks_are_ranks(tmp_path, slurm_cluster):  # noqa: F811
    """In a 2-task job, a process started by the batch script itself (SLURM_PROCID=0,
    SLURM_NTASKS=2, no srun step) is a single process, not rank 0 of 2 waiting forever
    for a rank 1; the tasks of an srun step are ranks 0 and 1 of 2."""
    script = tmp_path / "probe.sbatch"
    script.write_text(f"""#!/usr/bin/env bash
set -euo pipefail
PROBE=batch {sys.executable} -c "$PROBE_CODE"
PROBE=srun srun --kill-on-bad-exit=1 {sys.executable} -c "$PROBE_CODE"
""")
    env = job_env(slurm_cluster)
    env["PROBE_CODE"] = PROBE
    log = tmp_path / "probe-%j.out"
    job_id = slurm_cluster.run_with_env(env, "sbatch", "--parsable", "--ntasks=2", f"--chdir={REPO}",
                                        f"--output={log}", str(script)).stdout.strip().split(";")[0]
    # Before the fix the batch-step process blocked in rendezvous (30 min timeout).
    state = slurm_cluster.wait_job(job_id, timeout=300)
    output = (tmp_path / f"probe-{job_id}.out").read_text(errors="replace")
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{output[-4000:]}"
    lines = sorted(line for line in output.splitlines() if line.startswith(("batch ", "srun ")))
    assert lines == ["batch rank=0 world=1 master=127.0.0.1",
                     "srun rank=0 world=2 master=127.0.0.1", "srun rank=1 world=2 master=127.0.0.1"], output


@pytest.mark.slow
def test_signal_checkpoints_requeues_and_resumes_the_identical_run(tmp_path, slurm_cluster, tiny_chat_model,  # noqa: F811
                                                                   data, torchrun_run):
    """What --signal=USR1@<s> does before the time limit, sent early with `scancel --signal`:
    every task finishes its step, saves, exits 75; the template requeues the job, which
    resumes from that checkpoint and ends with the losses of a run never interrupted."""
    train, val = data
    slurm_out = tmp_path / "slurm_run"
    env = job_env(slurm_cluster)
    log = tmp_path / "slurm-%j.out"
    job_id = slurm_cluster.run_with_env(
        env, "sbatch", "--parsable", "--ntasks=2", f"--chdir={REPO}", f"--output={log}", str(SBATCH_SCRIPT),
        *base_overrides(tiny_chat_model, train, val, slurm_out, **JOB_CONFIG)).stdout.strip().split(";")[0]
    metrics = slurm_out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, f"no step logged in 300 s\n{slurm_cluster.logs()}"
        time.sleep(0.2)
    slurm_cluster.run_with_env(env, "scancel", "--signal=USR1", job_id)
    state = slurm_cluster.wait_job(job_id, timeout=400)
    output = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{output[-6000:]}\n{slurm_cluster.logs()}"
    # One output file (--open-mode=append): the stopped run, the requeue, the resumed run.
    assert "exit 75): requeueing job" in output, output[-6000:]
    assert "restart=1" in output, output[-6000:]
    resumed = [line for line in output.splitlines() if line.startswith("resumed from ")]
    assert len(resumed) == 1, output[-6000:]
    stop_step = int(re.search(r" at step (\d+)", resumed[0]).group(1))
    assert 1 <= stop_step < 4, resumed

    ours = train_steps(slurm_out)
    assert sorted(ours) == sorted(torchrun_run) == [1, 2, 3, 4]
    assert_same_steps(ours, torchrun_run, range(1, 5), rtol=1e-5)


@pytest.mark.slow
def test_ray_cluster_inside_an_allocation_runs_the_ray_path(tmp_path, slurm_cluster, tiny_chat_model,  # noqa: F811
                                                             tiny_data):
    """scripts/ray_on_slurm.sbatch: a Ray head started by srun on the allocation's node, the
    driver against it, the Ray cluster gone with the job."""
    train, val = tiny_data
    out = tmp_path / "ray_run"
    env = job_env(slurm_cluster)
    env.pop("RAY_ADDRESS", None)  # the job's driver joins the cluster the job starts
    # A temp dir of the job's own (short: Ray's socket paths must fit): the default /tmp/ray
    # would keep a ray_current_cluster file that a later plain ray.init() tries to join.
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    # The venv's own python: the template finds the ray CLI beside it (the workers start preloaded).
    env.update(RAY_ENV, **preloaded_ray_workers(), HPSFT_PYTHON=sys.executable, RAY_PORT=str(free_port()),
               RAY_TMPDIR=ray_tmp)
    log = tmp_path / "ray-%j.out"
    overrides = base_overrides(tiny_chat_model, train, val, out, **{
        "ray.n_workers_per_node": 2, "ray.cpus_per_worker": 0.5, "trainer.export_hf": "false"})
    job_id = slurm_cluster.run_with_env(
        env, "sbatch", "--parsable", "--nodes=1", "--cpus-per-task=2", f"--chdir={REPO}", f"--output={log}",
        str(REPO / "scripts" / "ray_on_slurm.sbatch"), *overrides).stdout.strip().split(";")[0]
    state = slurm_cluster.wait_job(job_id, timeout=400)
    output = (tmp_path / f"ray-{job_id}.out").read_text(errors="replace")
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{output[-6000:]}\n{slurm_cluster.logs()}"
    assert f"Ray head on localhost (127.0.0.1:{env['RAY_PORT']}), 1 nodes" in output, output[-3000:]
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    leftover = [p.pid for p in psutil.process_iter(["cmdline"]) if env["RAY_PORT"] in " ".join(p.info["cmdline"] or [])]
    assert not leftover, f"Ray processes of the job still running: {leftover}"
    shutil.rmtree(ray_tmp, ignore_errors=True)
