"""No rank waits forever on another: a failure on one rank ends the others within seconds,
and collectives do not depend on one rank's data (ZeRO-3 with token accuracy)."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpsft.utils.distributed import free_port
from tests.conftest import REPO, base_overrides, cli_command, read_metrics, run_cli, train_env, write_parquet
from tests.test_spmd_training import assert_ok


def processes_naming(text: str) -> list[int]:
    """PIDs of live processes whose command line contains `text` (zombies excluded)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if text.encode() in (proc / "cmdline").read_bytes() and "State:\tZ" not in (proc / "status").read_text():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def plain_ranks_command(args: list[str], nproc: int) -> list[str]:
    """`nproc` ranks started by a shell with nothing watching them (an srun without
    --kill-on-bad-exit, a hand-rolled launcher): only the ranks themselves can end a failed run."""
    port = free_port()
    ranks = " ".join(
        f"RANK={r} LOCAL_RANK={r} WORLD_SIZE={nproc} MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
        f"{sys.executable} -m hpsft.train {' '.join(args)} & pids=\"$pids $!\";" for r in range(nproc))
    return ["bash", "-c", f"{ranks} status=0; for pid in $pids; do wait $pid || status=$?; done; exit $status"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "none"])
def test_a_failure_on_one_rank_ends_every_rank_within_seconds(tmp_path, tiny_chat_model, tiny_data, launcher):
    """Rank 1 raises in step 2 while rank 0 enters the step's collectives; the collective
    timeout is far away (600 s), so only the failure's own propagation can end rank 0.
    (The SmolLM2-shaped tiny model: the failure's path needs no pretrained weights.)"""
    train, _ = tiny_data
    out = tmp_path / "run"
    args = base_overrides(tiny_chat_model, train, None, out, **{
        "data.train_batch_size": 4, "trainer.total_steps": 3, "trainer.export_hf": "false",
        "engine.collective_timeout_s": 600})
    command = cli_command("hpsft.train", args, nproc=2) if launcher == "torchrun" else plain_ranks_command(args, 2)
    env = {**train_env(), "HPSFT_TEST_WORKER_FAULT": "raise:1:2"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, failed_at = [], []

    def read_output():
        for line in proc.stdout:
            lines.append(line)
            if "HPSFT_TEST_WORKER_FAULT: rank 1 fails at step 2" in line and not failed_at:
                failed_at.append(time.monotonic())

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=500)
    finally:
        if proc.poll() is None:
            for pid in processes_naming(str(out)):
                os.kill(pid, 9)
            proc.kill()
    ended_at = time.monotonic()
    reader.join(timeout=10)
    output = "".join(lines)
    assert failed_at, output[-6000:]
    print(f"{launcher}: every rank ended {ended_at - failed_at[0]:.1f} s after rank 1's failure")
    assert ended_at - failed_at[0] < 60, output[-6000:]
    assert proc.returncode != 0
    assert "InjectedFault" in output and "Traceback" in output  # the failing rank's own report
    assert processes_naming(str(out)) == []
    assert [m["step"] for m in read_metrics(out)] == [1]
    assert not (out / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_zero3_token_accuracy_with_over_2048_loss_tokens_on_one_rank_completes(tmp_path, tiny_chat_model):
    """One rank's micro-batch has > 2,048 loss tokens, the other's a handful: computing the
    accuracy must make the same collectives on both (ZeRO-3 gathers parameters collectively).
    The SmolLM2-shaped tiny model: its tied head (49152 x 64) is partitioned by ZeRO-3 as
    SmolLM2's is. Planted: count_correct calling the head module (`head(hidden[r])`, which
    gathers its weight once per chunk on this rank only): the run failed, rank 1 aborted and
    rank 0's next ZeRO-3 parameter fetch ended in a gloo connection reset."""
    long_answer = " ".join(f"word{i}" for i in range(650))  # ~2,700 assistant tokens
    rows = [
        {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": long_answer}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    ]
    train = write_parquet(rows, tmp_path / "train.parquet")
    out = tmp_path / "run"
    proc = run_cli("hpsft.train", base_overrides(tiny_chat_model, train, None, out, **{
        "data.train_batch_size": 2, "data.micro_batch_size_per_gpu": 1, "data.max_length": 4096,
        "data.shuffle": "false", "engine.zero_stage": 3, "loss.token_accuracy": "true",
        "trainer.total_steps": 1, "trainer.export_hf": "false", "engine.collective_timeout_s": 120}),
        nproc=2, timeout=500)
    assert_ok(proc)
    [metrics] = read_metrics(out)
    assert 2048 + 10 < metrics["train/loss_tokens"] < 4096
    assert 0.0 <= metrics["train/token_accuracy"] <= 1.0
