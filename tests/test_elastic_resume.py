"""Resume with another data-parallel size: the position in the sample stream, and
DeepSpeed's ZeRO state resharded through its universal checkpoint form; and with another
DeepSpeed stage in one process."""

import pytest
import torch

from tests.conftest import REPO, base_overrides, read_metrics, run_cli, write_parquet, write_tiny_llama
from tests.test_spmd_training import assert_ok, rel_diff

STEPS = 4  # the straight run saves at step 2 (the first resume's start), the resumed ones every step
LOSS_RTOL = 1e-6  # fp32: measured below 2e-7 (the dp sizes sum gradients in other orders)


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    import random

    import numpy as np

    from hpsft.trainer.sft_trainer import rng_state, seed_everything, set_rng_state

    seed_everything(7)
    torch.save({"rng": rng_state()}, tmp_path / "state.pt")
    expected = (random.random(), np.random.rand(), np.random.randn(), torch.rand(1).item())
    set_rng_state(torch.load(tmp_path / "state.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.rand(), np.random.randn(), torch.rand(1).item()) == expected


@pytest.fixture(scope="module")
def data(tmp_path_factory, chat_rows):
    root = tmp_path_factory.mktemp("elastic_data")
    return write_parquet([{"messages": c} for c in chat_rows[:16]], root / "train.parquet")


def overrides(model_path, train, out_dir, zero_stage, **extra) -> list[str]:
    # 4 sequences per step: 1 rank runs 2 micro-batches of 2, 2 ranks 1 each.
    return base_overrides(model_path, train, None, out_dir, **{
        "engine.zero_stage": zero_stage, "data.train_batch_size": 4, "data.micro_batch_size_per_gpu": 2,
        "trainer.total_steps": STEPS, "trainer.save_every": 2, "trainer.export_hf": "false", **extra})


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_resume_with_another_data_parallel_size_continues_the_straight_run(tmp_path, model_path, data, zero_stage):
    """1 rank saves step 2 -> 2 ranks resume it, train step 3 and save it -> 1 rank resumes
    that and trains step 4: every step has the straight 1-rank run's samples (token counts)
    and loss. (A chain, not resumes from straight runs of both sizes: one 2-rank run less
    per stage. A straight 2-rank run gives the 1-rank losses: test_dp_and_micro_batch_invariance.)"""
    straight = tmp_path / "straight"
    assert_ok(run_cli("hpsft.train", overrides(model_path, data, straight, zero_stage)))
    expected = {m["step"]: m for m in read_metrics(straight)}
    source = straight
    for saved_dp, resumed_dp, step in ((1, 2, 2), (2, 1, 3)):
        checkpoint = source / "checkpoints" / f"global_step_{step}"
        out = tmp_path / f"resumed_dp{resumed_dp}"
        proc = run_cli("hpsft.train", overrides(model_path, data, out, zero_stage, **{
            "trainer.resume": checkpoint, "trainer.save_every": 1}), nproc=resumed_dp)
        assert_ok(proc)
        assert (f"resumed from {checkpoint} at step {step} (written by a spmd run with {saved_dp} data-parallel "
                f"ranks, now {resumed_dp})") in proc.stdout
        converted = {f"global_step_{step}.universal", "latest_universal"}
        assert not converted & {p.name for p in checkpoint.parent.iterdir()}  # the conversion is cleaned up
        resumed = {m["step"]: m for m in read_metrics(out)}
        assert sorted(resumed) == list(range(step + 1, STEPS + 1))
        for s in resumed:
            assert resumed[s]["train/tokens"] == expected[s]["train/tokens"], (resumed_dp, s)
            error = rel_diff(expected[s]["train/loss"], resumed[s]["train/loss"])
            print(f"zero{zero_stage} dp {saved_dp}->{resumed_dp} step {s}: loss rel err {error:.2e}")
            assert error <= LOSS_RTOL, (resumed_dp, s, error)
        source = out


@pytest.mark.parametrize("writer, reader", [("ds2", "default"), ("default", "ds2")])
def test_a_checkpoint_resumes_exactly_with_and_without_zero(tmp_path, writer, reader):
    """engine.zero_stage=2 in one process runs without ZeRO (DeepSpeedEngine.zero_stage_to_run),
    and wrote ZeRO checkpoints before: one written with DeepSpeed's ZeRO-2 continues without
    ZeRO, and one written without ZeRO continues under ZeRO-2 (what a run on more ranks does),
    each as the engine that wrote it continues (both through the universal layout)."""
    out = tmp_path / "runs.pt"
    proc = run_cli(None, [str(write_tiny_llama(tmp_path / "tiny-llama")), str(tmp_path / "checkpoints"), str(out),
                          writer, reader],
                   script=str(REPO / "tests" / "dist_scripts" / "checkpoint_across_stages.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "converted to DeepSpeed's universal checkpoint" in proc.stdout
    runs = torch.load(out)
    assert [runs[name]["deepspeed_stage"] for name in ("writer", "resumed")] == ([2, 0] if writer == "ds2" else [0, 2])
    torch.testing.assert_close(torch.tensor(runs["resumed"]["grad_norms"]), torch.tensor(runs["writer"]["grad_norms"]),
                               rtol=1e-6, atol=0)
    for name, weight in runs["writer"]["weights"].items():
        torch.testing.assert_close(runs["resumed"]["weights"][name], weight, rtol=1e-6, atol=1e-7, msg=name)
