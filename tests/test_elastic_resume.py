"""Resume with another data-parallel size: the position in the sample stream, and
DeepSpeed's ZeRO state resharded through its universal checkpoint form."""

import pytest
import torch

from tests.conftest import base_overrides, read_metrics, run_cli, write_parquet
from tests.test_spmd_training import assert_ok, rel_diff

STEPS = 4  # straight runs save at step 2 (a resume's start) and at step 4
LOSS_RTOL = 1e-6  # fp32: measured below 2e-7 (the dp sizes sum gradients in other orders)


@pytest.mark.parametrize("weights", [None, [3.0, 1.0]], ids=["concatenated", "mixture"])
def test_a_position_in_samples_gives_every_dp_size_the_same_remaining_steps(weights):
    """From any whole-step position, the steps left in the epoch (the union of every rank's
    batch, or the Ray driver's global batch) are the samples a straight 1-rank run consumes
    next: for the files concatenated and for a weighted mixture of two sources."""
    from torch.utils.data import BatchSampler

    from hpsft.data.sampler import training_sampler
    from hpsft.data.sources import SourcedDataset
    from hpsft.ray.sampler import RankInterleavedSampler

    dataset, global_batch = SourcedDataset([list(range(12)), list(range(7))], ["a", "b"], 8, "lists"), 4

    def remaining_steps(dp: int, epoch: int, position: int) -> list[set]:
        per_rank = []
        for rank in range(dp):
            sampler = training_sampler(dataset, weights, dp, rank, shuffle=True, seed=3)
            sampler.set_position(epoch, position)
            per_rank.append(list(BatchSampler(sampler, global_batch // dp, drop_last=True)))
        assert len({len(batches) for batches in per_rank}) == 1
        return [set().union(*step) for step in zip(*per_rank)]

    def remaining_driver_steps(dp: int, epoch: int, position: int) -> list[set]:
        driver = RankInterleavedSampler(dataset, weights, dp, global_batch // dp, shuffle=True, seed=3)
        driver.set_position(epoch, position)
        return [set(batch) for batch in BatchSampler(driver, global_batch, drop_last=True)]

    for epoch in (0, 1):
        straight = remaining_steps(1, epoch, 0)
        assert len(straight) == 4 and straight != remaining_steps(1, 1 - epoch, 0)
        for dp in (1, 2, 4):
            for steps_done in range(5):
                position = steps_done * global_batch
                assert remaining_steps(dp, epoch, position) == straight[steps_done:], (dp, steps_done)
                assert remaining_driver_steps(dp, epoch, position) == straight[steps_done:], (dp, steps_done)


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


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory, model_path, data):
    """zero stage -> dp size -> the output folder of an uninterrupted run (one per stage and size)."""
    runs = {}

    def get(zero_stage: int, dp: int):
        if (zero_stage, dp) not in runs:
            out = tmp_path_factory.mktemp(f"straight_zero{zero_stage}_dp{dp}") / "run"
            assert_ok(run_cli("hpsft.train", overrides(model_path, data, out, zero_stage), nproc=dp))
            runs[zero_stage, dp] = out
        return runs[zero_stage, dp]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.parametrize("saved_dp, resumed_dp", [(1, 2), (2, 1)])
def test_resume_with_another_data_parallel_size_continues_the_straight_run(
        tmp_path, model_path, data, straight_runs, zero_stage, saved_dp, resumed_dp):
    source, reference = straight_runs(zero_stage, saved_dp), straight_runs(zero_stage, resumed_dp)
    checkpoint = source / "checkpoints" / "global_step_2"
    out = tmp_path / "resumed"
    proc = run_cli("hpsft.train", overrides(model_path, data, out, zero_stage, **{"trainer.resume": checkpoint}),
                   nproc=resumed_dp)
    assert_ok(proc)
    assert (f"resumed from {checkpoint} at step 2 (written by a spmd run with {saved_dp} data-parallel ranks, "
            f"now {resumed_dp})") in proc.stdout
    leftovers = {"global_step_2.universal", "latest_universal"} & {p.name for p in checkpoint.parent.iterdir()}
    assert not leftovers  # the conversion is cleaned up
    straight = {m["step"]: m for m in read_metrics(source)}
    same_size = {m["step"]: m for m in read_metrics(reference)}
    resumed = {m["step"]: m for m in read_metrics(out)}
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        # The same samples (token counts) as the straight runs of both sizes, and the same loss.
        assert resumed[step]["train/tokens"] == straight[step]["train/tokens"] == same_size[step]["train/tokens"]
        errors = [rel_diff(run[step]["train/loss"], resumed[step]["train/loss"]) for run in (straight, same_size)]
        print(f"zero{zero_stage} dp {saved_dp}->{resumed_dp} step {step}: loss rel err {max(errors):.2e}")
        assert max(errors) <= LOSS_RTOL, (step, errors)
