"""The Ray path: one driver, a group of TrainingWorker actors (gloo, CPU, 2 workers), on
the tiny random model with SmolLM2's tokenizer (conftest.tiny_chat_model): every training test
here compares two paths or two runs of the same steps, which needs no pretrained weights.

One local Ray instance serves every test of this module: drivers run in this process or
join it with ray.address. The job-submission test starts its own head (it needs the
dashboard) and stops it by its PID.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from hpsft.config import load_config
from hpsft.utils.distributed import free_port
from tests.conftest import (REPO, RAY_ENV, assert_ok, assert_same_steps, base_overrides, chat_parquet, cli_command,
                            ray_env, read_metrics, rel_diff, run_cli, train_env, train_steps, write_parquet)
from tests.tracking_files import (assert_holds_the_jsonl_scalars, only_run_log, profiled_steps, wandb_offline_env,
                                  wandb_records)
from tests.test_spmd_training import max_rel_weight_diff, weights

ray = pytest.importorskip("ray")

# Two ranks share the two cores of a test machine (and leave room for a restarted group).
RAY_WORKERS = {"ray.n_workers_per_node": 2, "ray.cpus_per_worker": 0.5}


def private_ray_tmpdir() -> str:
    """A temp dir of our own (short: Ray's socket paths must fit): Ray records the newest
    cluster there, and a plain ray.init() elsewhere on the machine would join ours."""
    return tempfile.mkdtemp(prefix="rt", dir="/tmp")


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray instance for this module; its actors inherit this process's environment."""
    temp_dir = private_ray_tmpdir()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**ray_env(), "RAY_TMPDIR": temp_dir}.items():
            patch.setenv(key, value)
        # "local": a new instance, even where a `ray start` head (or its stale /tmp/ray/ray_current_cluster) is around
        ray.init(address="local", num_cpus=2, include_dashboard=False)
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory, chat_rows):
    """16 train and 8 validation conversations."""
    return chat_parquet(tmp_path_factory.mktemp("ray_data"), chat_rows)


def ray_config(model, data, out_dir, **extra):
    train, val = data
    return load_config(None, base_overrides(model, train, val, out_dir, **{**RAY_WORKERS, **extra}))


def run_driver(config, during_fit=None):
    """Train with a RaySFTTrainer in this process; `during_fit(trainer)` runs in a thread."""
    from hpsft.ray import RaySFTTrainer

    trainer = RaySFTTrainer(config)
    try:
        if during_fit is not None:
            threading.Thread(target=during_fit, args=(trainer,), daemon=True).start()
        trainer.fit()
    finally:
        trainer.close()
    return trainer


@pytest.mark.skipif(os.environ.get("HPSFT_TEST_PRELOADED") == "0", reason="HPSFT_TEST_PRELOADED=0: cold workers")
def test_this_modules_ray_workers_start_preloaded(ray_address):
    """conftest.ray_env: Ray starts a worker through tests/preloaded.py, so a task finds the
    server's imports done (a cold worker imports only Ray). Catches the suite's Ray workers
    starting cold again (~11 CPU s each), e.g. a Ray that no longer reads the job config's
    py_executable."""
    @ray.remote(num_cpus=0.5)
    def imported() -> bool:
        return "deepspeed" in sys.modules

    assert ray.get(imported.remote(), timeout=120)


@pytest.mark.slow
def test_worker_group_scatters_per_rank_arguments_and_names_a_failing_rank(ray_address):
    from hpsft.ray import ClassWithInitArgs, PerRank, RayWorkerGroup, WorkerFailedError
    from hpsft.ray.resource_pool import RayResourcePool

    group = RayWorkerGroup(RayResourcePool(1, 2, 0.5, 60), ClassWithInitArgs(dict, kwargs={"shared": 1}))
    try:
        assert group.setdefault(PerRank(["a", "b"]), PerRank([10, 11])).get() == [10, 11]
        assert group.get("shared").get() == [1, 1]
        with pytest.raises(WorkerFailedError,
                           match=r"worker rank \d \(node [\d.]+ \(\w+\), pid \d+\) failed in pop: KeyError"):
            group.pop("missing").get()
        assert group.actors == []  # a failed call kills the group: its ranks may be stuck in a collective
    finally:
        group.shutdown()


@pytest.mark.slow
def test_worker_group_call_timeout_names_the_hung_ranks_and_kills_them(ray_address):
    """A call still unanswered after ray.call_timeout_s (every rank waits for good on an Event
    never set) raises WorkerHungError naming the ranks, and kills them though they are busy:
    their CPUs are free again. The trainer restarts on it as on any lost group:
    test_a_hung_worker_then_one_lost_while_the_group_is_rebuilt_each_use_up_a_restart."""
    from ray.exceptions import RayActorError

    from hpsft.ray import ClassWithInitArgs, RayWorkerGroup, WorkerHungError
    from hpsft.ray.resource_pool import RayResourcePool

    # The timeout bounds the group's start-up calls too (actor processes, imports): 120 s for
    # those (a loaded 2-core machine took more than 20), 20 s from the first call on.
    group = RayWorkerGroup(RayResourcePool(1, 2, 0.5, 60), ClassWithInitArgs(threading.Event), call_timeout_s=120)
    group.call_timeout_s = 20
    actors = list(group.actors)
    try:
        assert group.is_set().get() == [False, False]
        with pytest.raises(WorkerHungError, match=r"worker rank 0 \(node [\d.]+ \(\w+\), pid \d+\); rank 1 \(node "
                                                  r"[\d.]+ \(\w+\), pid \d+\) did not finish wait within 20 s "
                                                  r"\(ray.call_timeout_s\)"):
            group.wait().get()
        assert group.actors == []
    finally:
        group.shutdown()
    for actor in actors:
        with pytest.raises(RayActorError):
            ray.get(actor.where.remote(), timeout=60)
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


@pytest.fixture(scope="module")
def mixture(tmp_path_factory, data, chat_rows) -> dict:
    """The config of the runs compared with SPMD: 3 steps of 8 conversations from a 3:1 mixture
    of two training files, validated on two files (per-dataset train and val losses), in
    micro-batches of 2, a checkpoint at step 2."""
    train, val = data
    other = write_parquet([{"messages": c} for c in chat_rows[24:36]],
                          tmp_path_factory.mktemp("ray_other") / "other.parquet")
    return {"trainer.total_steps": 3, "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 2,
            "trainer.save_every": 2, "data.train_files": f"[{{path: {train}, weight: 3}}, {{path: {other}, weight: 1}}]",
            "data.val_files": f"[{val}, {other}]"}


@pytest.fixture(scope="module")
def spmd_run(tmp_path_factory, tiny_chat_model, data, mixture):
    """The mixture config under torchrun with 2 ranks: the reference of the Ray runs on one node
    and on two."""
    out = tmp_path_factory.mktemp("spmd") / "run"
    proc = run_cli("hpsft.train", base_overrides(tiny_chat_model, *data, out, **mixture), nproc=2)
    assert_ok(proc)
    assert "hpsft: launcher torchrun: world size 2, 1 node(s), 2 rank(s) per node" in proc.stdout
    return out


@pytest.mark.slow
def test_ray_matches_spmd(tmp_path, tiny_chat_model, data, ray_address, mixture, spmd_run):
    """2 Ray workers == 2 torchrun ranks: every step's samples, loss and unclipped gradient norm,
    the final weights (fp32), per-dataset train and val losses (the SPMD ranks all-reduce them,
    the driver adds up its workers').
    The Ray run also logs to W&B (offline) from the driver and profiles step 2 on both workers.
    Planted: the driver's loss-token count doubled (hpsft/ray/data_parallel.py): every step's
    grad norm half SPMD's (rel diff 0.5), the losses 3.5e-5 apart by step 3."""
    train, val = data
    spmd, on_ray = spmd_run, tmp_path / "ray"
    tracking = {"trainer.loggers": "[jsonl,wandb]", "trainer.profile_steps": "[2,2]", "trainer.profile_ranks": "[0,1]"}
    proc = subprocess.run(
        cli_command("hpsft.train_ray", base_overrides(
            tiny_chat_model, train, val, on_ray, **mixture, **RAY_WORKERS, **tracking, **{"ray.address": ray_address})),
        cwd=REPO, env={**ray_env(), **wandb_offline_env(tmp_path)},
        capture_output=True, text=True, timeout=600,
    )
    assert_ok(proc)
    assert_holds_the_jsonl_scalars(wandb_records(only_run_log(on_ray)), on_ray, [1, 2, 3])
    assert profiled_steps(on_ray, 0) == profiled_steps(on_ray, 1) == ["step 2"]
    a, b = read_metrics(spmd), read_metrics(on_ray)
    assert [m["step"] for m in b] == [1, 2, 3]
    assert_same_steps(train_steps(on_ray), train_steps(spmd), [1, 2, 3], rtol=1e-5)
    for x, y in zip(a, b):
        per_dataset = sorted(k for k in x if k.startswith(("train/loss/", "train/loss_tokens/")))
        assert per_dataset and per_dataset == sorted(k for k in y if k.startswith(("train/loss/", "train/loss_tokens/")))
        assert sum(x[f"train/loss_tokens/{n}"] for n in ("train", "other") if f"train/loss_tokens/{n}" in x) == (
            x["train/loss_tokens"])
        for key in per_dataset:
            assert rel_diff(x[key], y[key]) <= 1e-5, (x["step"], key, x[key], y[key])
    for key in ("val/loss", "val/loss/val", "val/loss/other"):
        assert rel_diff(a[-1][key], b[-1][key]) <= 1e-5, key
    assert max_rel_weight_diff(weights(spmd), weights(on_ray)) <= 1e-5
    # Checkpoint mode "ray": engine shards from both workers, one trainer state from the driver.
    checkpoint = on_ray / "checkpoints" / "global_step_3"
    assert sorted(p.name for p in checkpoint.glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert [p.name for p in checkpoint.glob("trainer_state*.pt")] == ["trainer_state.pt"]


ZERO3 = {"engine.zero_stage": 3, "data.train_batch_size": 4, "data.micro_batch_size_per_gpu": 2,
         "trainer.total_steps": 4, "trainer.save_every": 2}


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, tiny_chat_model, data, ray_address):
    """ZeRO-3 under Ray, 4 steps straight, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("zero3") / "straight"
    run_driver(ray_config(tiny_chat_model, data, out, **ZERO3))
    return out


@pytest.mark.slow
def test_a_ray_checkpoint_resumes_under_torchrun_and_back(tmp_path, tiny_chat_model, data, zero3_run):
    """Ray's step-2 checkpoint -> torchrun (2 ranks) trains step 3 and saves it -> a new Ray
    driver resumes that (named by trainer.resume) and trains step 4: every step's counts, loss
    and grad norm, and the final weights, are the uninterrupted Ray run's (1e-5: the two paths give their ranks other
    shards of a batch). A new driver resuming from its own run's latest checkpoint: the SIGTERM
    test below. Planted: the driver's loss-token count doubled: torchrun's step 3 has twice the
    straight Ray run's grad norm, its loss equal."""
    train, val = data
    out = tmp_path / "run"
    checkpoint = zero3_run / "checkpoints" / "global_step_2"
    proc = run_cli("hpsft.train", base_overrides(tiny_chat_model, train, val, out, **{
        **ZERO3, "trainer.resume": checkpoint, "trainer.stop_at_step": 3, "trainer.save_every": 1}), nproc=2)
    assert_ok(proc)
    assert f"resumed from {checkpoint} at step 2 (written by a ray run with 2 data-parallel ranks, now 2)" in proc.stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_3"
    run_driver(ray_config(tiny_chat_model, data, out, **ZERO3, **{"trainer.resume": out / "checkpoints" / "global_step_3"}))
    straight, resumed = train_steps(zero3_run), train_steps(out)
    assert sorted(resumed) == [3, 4]
    assert_same_steps(resumed, straight, [3, 4], rtol=1e-5)
    assert max_rel_weight_diff(weights(zero3_run), weights(out)) <= 1e-5


def kill_a_worker_after_step(step: int, record: dict):
    """A during_fit action: SIGKILL rank 1's process once `step` has been logged."""

    def action(trainer):
        metrics = Path(trainer.run_dir) / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= step):
            time.sleep(0.05)
        record["pid"] = trainer.worker.group.pids[1]
        record["killed_at"] = time.monotonic()
        os.kill(record["pid"], signal.SIGKILL)

    return action


@pytest.mark.slow
def test_killed_worker_stops_the_driver_naming_the_rank(tmp_path, tiny_chat_model, data, ray_address):
    from hpsft.ray import WorkerDiedError

    record = {}
    config = ray_config(tiny_chat_model, data, tmp_path / "run", **{"trainer.total_steps": 6})
    with pytest.raises(WorkerDiedError) as err:
        run_driver(config, during_fit=kill_a_worker_after_step(1, record))
    assert time.monotonic() - record["killed_at"] < 20
    assert re.search(rf"worker rank 1 \(node [\d.]+ \(\w+\), pid {record['pid']}\) died", str(err.value))
    # The whole group is gone, not left blocked in a collective: its resources are free again.
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def signal_the_driver_after_step(step: int):
    """A during_fit action: SIGTERM to this (the driver's) process once `step` has been logged."""

    def action(trainer):
        metrics = Path(trainer.run_dir) / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= step):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    return action


@pytest.mark.slow
def test_sigterm_to_the_driver_saves_the_step_reached_and_a_new_driver_resumes(tmp_path, tiny_chat_model, data, zero3_run):
    """SIGTERM after step 2 is logged: the group finishes step 3, saves it (not a save_every
    step), and a new driver's resume reproduces the uninterrupted run."""
    from hpsft.utils.errors import Preempted

    out = tmp_path / "run"
    with pytest.raises(Preempted, match="after step 3"):
        run_driver(ray_config(tiny_chat_model, data, out, **ZERO3), during_fit=signal_the_driver_after_step(2))
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_3"
    assert sorted(train_steps(out)) == [1, 2, 3]
    run_driver(ray_config(tiny_chat_model, data, out, **ZERO3))
    assert_same_steps(train_steps(out), train_steps(zero3_run), range(1, 5), rtol=1e-6)
    assert max_rel_weight_diff(weights(zero3_run), weights(out)) <= 1e-6


def wait_for_dashboard(url: str, head: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.poll() is None, f"ray start --head exited with {head.returncode}"
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the Ray head's dashboard at {url} did not answer within {timeout} s")


def agent_log(temp_dir: str) -> str:
    log = Path(temp_dir) / "session_latest" / "logs" / "dashboard_agent.log"
    return log.read_text(errors="replace") if log.is_file() else ""


def wait_for_job_agent(port: int, head: subprocess.Popen, temp_dir: str, timeout: float = 180) -> bool:
    """True once the head's dashboard agent (which runs submitted jobs) answers on its port;
    False when it could not bind a port. `ray job submit` answers "No available agent" until
    then, and forever when the bind failed: a CI run failed so (30 submits over 418 s, the head
    alive), and a port taken before the agent starts does the same (its log: "address already
    in use"; it never registers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.poll() is None, f"ray start --head exited with {head.returncode}"
        if "address already in use" in agent_log(temp_dir):
            return False
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/healthz", timeout=2).read()
            return True
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the Ray head's dashboard agent did not answer on port {port} within {timeout} s; "
                f"the end of its log:\n{agent_log(temp_dir)[-3000:]}")


def stop_head(head: subprocess.Popen) -> None:
    head.send_signal(signal.SIGTERM)  # `ray start --block` drains and stops what it started
    head.wait(timeout=60)


@contextlib.contextmanager
def local_ray_head(env: dict):
    """`ray start --head` with its dashboard and job agent on free loopback ports; yields the
    dashboard's URL and the head's temp dir. Started again on new ports (at most 3 times) when a
    port was taken before the agent bound it."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    for _ in range(3):
        temp_dir = tempfile.mkdtemp(prefix="rayhead", dir="/tmp")  # short: Ray's socket paths must fit
        dashboard_port, agent_port = free_port(), free_port()
        head = subprocess.Popen(
            [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(free_port()),
             "--num-cpus", "2", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
             # Not the default agent/metrics ports: this module's own Ray instance holds those.
             f"--dashboard-agent-listen-port={agent_port}",
             *(f"--{name}={free_port()}" for name in (
                 "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")),
             "--disable-usage-stats", "--temp-dir", temp_dir],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        agent_bound = False
        try:
            dashboard = f"http://127.0.0.1:{dashboard_port}"
            wait_for_dashboard(dashboard, head)
            agent_bound = wait_for_job_agent(agent_port, head, temp_dir)
            if agent_bound:
                yield dashboard, temp_dir
        finally:
            stop_head(head)
            shutil.rmtree(temp_dir, ignore_errors=True)
        if agent_bound:
            return
    pytest.fail("three Ray heads in a row lost a port to another process before their agent bound it")


@pytest.mark.slow
def test_ray_job_submit_to_a_local_head(tmp_path, tiny_chat_model, data):
    """scripts/ray_submit.sh against `ray start --head` (with its dashboard), from another
    directory than the repository, uploads the repository as the job's working directory and
    writes a run; an argument with spaces and brackets arrives intact."""
    train, _ = data
    env = {**train_env(), **RAY_ENV}
    env.pop("RAY_ADDRESS", None)
    with local_ray_head(env) as (dashboard, temp_dir):
        out = tmp_path / "run"
        deadline = time.monotonic() + 60  # the agent answers a moment before the head lists it
        while True:
            proc = subprocess.run(
                [str(REPO / "scripts" / "ray_submit.sh"),
                 *base_overrides(tiny_chat_model, train, None, out, **RAY_WORKERS, **{
                     "trainer.total_steps": 2, "trainer.loggers": "[jsonl, tensorboard]"})],
                cwd=tmp_path, env={**env, "RAY_ADDRESS": dashboard, "PYTHON": sys.executable},
                capture_output=True, text=True, timeout=600,
            )
            if "No available agent to submit job" not in proc.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert_ok(proc)
        assert "succeeded" in proc.stdout + proc.stderr
        assert [m["step"] for m in read_metrics(out)] == [1, 2]
        assert (out / "config.yaml").is_file() and (out / "hf" / "model.safetensors").is_file()
        assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_2"
        assert any((out / "tensorboard").iterdir())  # the list with a space reached the job whole
        # The job ran the uploaded copy: Ray unpacked the repository into the head's temp dir.
        assert list(Path(temp_dir).glob("**/working_dir_files/*/hpsft/train_ray.py")), "no uploaded working dir"


@pytest.mark.slow
def test_placement_timeout_lists_each_nodes_total_and_free_resources(ray_address):
    """Two nodes asked of a one-node instance: the error says what a node's bundle asks and
    what every node has, and the pending placement group is removed."""
    from hpsft.ray.resource_pool import RayResourcePool

    with pytest.raises(RuntimeError) as err:
        RayResourcePool(2, 1, 0.5, 2)
    message = str(err.value)
    assert "Ray could not place 2 node(s) with {'CPU': 0.5} each" in message
    assert "within 2 s (ray.placement_timeout_s)" in message
    per_node = r"Per node: node [\d.]+ \(\w{8}\): total \{'CPU': 2\.0\}, free \{'CPU': [\d.]+\}\."
    assert re.search(per_node, message), message
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


@pytest.mark.parametrize("gpu_ids, visible, expected", [
    ([3], "3", 0),  # Ray narrowed CUDA_VISIBLE_DEVICES to the rank's GPU
    ([3], None, 3),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, the node's GPUs all visible
    (["5"], "4,5,6", 1),  # NOSET, the node started with its own CUDA_VISIBLE_DEVICES
])
def test_a_ray_rank_takes_the_gpu_ray_gave_it(gpu_ids, visible, expected):
    from hpsft.ray.worker_group import cuda_device_of

    assert cuda_device_of(gpu_ids, visible) == expected


def test_a_ray_gpu_outside_the_visible_devices_is_refused():
    from hpsft.ray.worker_group import cuda_device_of

    with pytest.raises(RuntimeError, match="GPU 2, not in CUDA_VISIBLE_DEVICES='0,1'"):
        cuda_device_of([2], "0,1")


HUNG_BY_COLLECTIVE_TIMEOUT = r"worker rank 0 \(node [\d.]+ \(\w+\), pid \d+\) gave up waiting for the other ranks"
DIED_WHILE_REBUILT = r"worker rank 1 \(node [\d.]+ \(\w+\), pid \d+\) died during load_checkpoint"


@pytest.mark.slow
def test_a_hung_worker_then_one_lost_while_the_group_is_rebuilt_each_use_up_a_restart(
        tmp_path, tiny_chat_model, data, zero3_run, capsys, monkeypatch):
    """Rank 1 sleeps for good at the start of step 3: rank 0's collective gives up after
    engine.collective_timeout_s (no ray.call_timeout_s), the group is dropped as hung. Rank 1
    then exits while the new group loads step 2's checkpoint: that second loss is the second
    restart (not an escape from the loop); the third group ends as the straight run. (A hung
    call ended by ray.call_timeout_s is the same WorkerHungError:
    test_worker_group_call_timeout_names_the_hung_ranks_and_kills_them.)"""
    monkeypatch.setenv("HPSFT_TEST_WORKER_FAULT", f"hang:1:3:{tmp_path / 'once_a'},"
                                                  f"exit:1:load_checkpoint:{tmp_path / 'once_b'}")
    out = tmp_path / "run"
    run_driver(ray_config(tiny_chat_model, data, out, **ZERO3, **{
        "ray.max_restarts": 2, "ray.call_timeout_s": "null", "engine.collective_timeout_s": 20}))
    printed = capsys.readouterr().out
    first, second = printed.index("restart 1/2"), printed.index("restart 2/2")
    assert re.search(HUNG_BY_COLLECTIVE_TIMEOUT, printed[:first]), printed[-3000:]
    assert re.search(DIED_WHILE_REBUILT, printed[first:second]), printed[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'global_step_2'} at step 2" in printed[second:]
    restarted = train_steps(out)
    assert sorted(restarted) == [1, 2, 3, 4]
    assert_same_steps(restarted, train_steps(zero3_run), range(1, 5), rtol=1e-6)
    assert max_rel_weight_diff(weights(zero3_run), weights(out)) <= 1e-6


# ---- two Ray nodes -------------------------------------------------------------------

# One rank per node; each node could hold both ranks (2 CPUs), so only the group's
# placement puts them on different nodes.
TWO_NODES = {"ray.nnodes": 2, "ray.n_workers_per_node": 1, "ray.cpus_per_worker": 1}
PLACEMENT_LINE = re.compile(r"rank (\d+): node ([\d.]+) \((\w+)\), pid (\d+)")


@pytest.fixture(scope="module")
def two_nodes():
    """A local Ray cluster: a head that runs nothing and two worker nodes of 2 CPUs.
    Yields its address and the two worker nodes' ids."""
    from ray.cluster_utils import Cluster

    temp_dir = private_ray_tmpdir()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**ray_env(), "RAY_TMPDIR": temp_dir}.items():
            patch.setenv(key, value)  # the nodes' processes, and so the workers, inherit them
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        try:
            nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
            cluster.wait_for_nodes()
            yield cluster.address, {node.node_id for node in nodes}
        finally:
            cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def run_ray_cli(model, data, mixture, out, address, env=None, **extra):
    """The Ray entry point with the mixture config in a fresh driver process against the
    cluster at `address`."""
    train, val = data
    return subprocess.run(
        cli_command("hpsft.train_ray",
                    base_overrides(model, train, val, out, **{**mixture, **TWO_NODES, "ray.address": address, **extra})),
        cwd=REPO, env={**ray_env(), **(env or {})}, capture_output=True, text=True, timeout=900,
    )


def placement(stdout: str) -> dict:
    """rank -> (Ray node id, pid) from the driver's 'ray worker group' lines."""
    return {int(m[1]): (m[3], int(m[4])) for m in PLACEMENT_LINE.finditer(stdout)}


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, tiny_chat_model, data, mixture, two_nodes):
    """The mixture config straight on the two nodes (3 steps, a checkpoint at step 2)."""
    out = tmp_path_factory.mktemp("two_nodes") / "straight"
    proc = run_ray_cli(tiny_chat_model, data, mixture, out, two_nodes[0])
    assert_ok(proc)
    return out, proc.stdout


@pytest.mark.slow
def test_two_nodes_one_rank_each_match_spmd(two_nodes, two_node_run, spmd_run):
    """One rank on each of two Ray nodes == 2 torchrun ranks on one: every step's samples, loss
    and unclipped gradient norm, and the final weights.
    Planted: the driver's loss-token count doubled: every step's grad norm half SPMD's."""
    out, stdout = two_node_run
    assert "hpsft: launcher ray: world size 2, 2 node(s), 1 rank(s) per node" in stdout
    ranks = placement(stdout)
    assert sorted(ranks) == [0, 1]
    node_of = {rank: node for rank, (node, _) in ranks.items()}
    assert node_of[0] != node_of[1], ranks  # one rank per node: the head (no CPUs) runs none
    assert set(node_of.values()) == two_nodes[1]

    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    assert_same_steps(train_steps(out), train_steps(spmd_run), [1, 2, 3], rtol=1e-5)
    assert max_rel_weight_diff(weights(spmd_run), weights(out)) <= 1e-5


@pytest.mark.slow
def test_two_nodes_a_worker_raising_shows_its_traceback_node_and_rank(tmp_path, tiny_chat_model, data, mixture,
                                                                    two_nodes):
    proc = run_ray_cli(tiny_chat_model, data, mixture, tmp_path / "run", two_nodes[0],
                       env={"HPSFT_TEST_WORKER_FAULT": "raise:1:2"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    node, pid = placement(proc.stdout)[1]
    # One summary line (Ray's copies of the workers' own output may come after it).
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpsft: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.fullmatch(rf"hpsft: error: worker rank 1 \(node [\d.]+ \({node[:8]}\), pid {pid}\) failed in "
                        r"train_batch: InjectedFault: HPSFT_TEST_WORKER_FAULT: rank 1 fails at step 2", errors[0])
    # The remote traceback, down to the line that raised, printed by the driver before the summary.
    start = proc.stderr.index("hpsft: the worker's traceback:")
    traceback = proc.stderr[start:proc.stderr.index(errors[0], start)]
    assert "training_worker.py" in traceback and "in train_batch" in traceback
    assert "faults.py" in traceback and "in strike" in traceback
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]


@pytest.mark.slow
def test_two_nodes_a_worker_killed_mid_step_restarts_from_the_last_checkpoint(
        tmp_path, tiny_chat_model, data, mixture, two_nodes, two_node_run):
    """Rank 1's process ends at the start of step 3: a new group on the two nodes goes back
    to step 2's checkpoint and finishes with the straight run's samples, losses, gradient norms
    and weights."""
    straight_dir, _ = two_node_run
    out = tmp_path / "run"
    proc = run_ray_cli(tiny_chat_model, data, mixture, out, two_nodes[0], env={
        "HPSFT_TEST_WORKER_FAULT": f"exit:1:3:{tmp_path / 'killed_once'}"}, **{"ray.max_restarts": 1})
    assert_ok(proc)
    assert re.search(r"worker rank 1 \(node [\d.]+ \(\w+\), pid \d+\) died during train_batch", proc.stdout)
    assert "restart 1/1" in proc.stdout
    assert f"resumed from {out / 'checkpoints' / 'global_step_2'} at step 2" in proc.stdout
    ranks = placement(proc.stdout.split("restart 1/1")[1])  # the new group
    assert len({node for node, _ in ranks.values()}) == 2
    restarted = train_steps(out)
    assert sorted(restarted) == [1, 2, 3]
    assert_same_steps(restarted, train_steps(straight_dir), [1, 2, 3], rtol=1e-6)
    assert max_rel_weight_diff(weights(straight_dir), weights(out)) <= 1e-6
