"""Every optimizer-step claim of the docs under every ZeRO stage, at two data-parallel ranks
(where ZeRO-1/2/3 shard): no weight decay on biases and norms (README, docs/checkpoints.md),
clipping by the unclipped global gradient norm (docs/precision.md), a non-finite step skipped
with weights, optimizer state and LR schedule left as they were and counted
(docs/checkpoints.md), warmup then cosine to min_lr_ratio (README), and a checkpoint that holds
all of it (a resumed engine's steps equal the straight run's). One 2-rank launch runs all four
stages (tests/dist_scripts/step_claims.py); each is checked against plain torch with the
norm, clip and AdamW in fp64 (the docs' rules written out in the script)."""

import pytest

from tests.step_claims import assert_steps_as_documented, run_layouts

STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    layouts = [f"deepspeed:zero_stage={stage}" for stage in STAGES]
    results = run_layouts(tmp_path_factory.mktemp("zero_stage_claims"), layouts, nproc=2)
    return {"reference": results["reference"], **{stage: results[layout] for stage, layout in zip(STAGES, layouts)}}


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_each_zero_stage_at_two_ranks_clips_decays_skips_schedules_and_resumes_as_documented(runs, stage):
    """Planted, one at a time (docs/testing.md has the figures): weight decay on every
    parameter (param_groups' 1-D test dropped); the clip skipped on the unsharded path; the
    scheduler stepped on a skipped step; the engine's skip without ZeRO removed; AdamW's moments
    zeroed after the checkpoint's load (DeepSpeedEngine.load_checkpoint): every stage's resumed
    step-1 norm 2.5611 vs 2.7460."""
    run = runs[stage]
    assert run["dp_size"] == 2 and run["deepspeed_stage"] == stage
    assert run["skipped_steps"] == 1
    assert_steps_as_documented(run, runs["reference"], f"ZeRO-{stage}")
