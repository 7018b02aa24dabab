"""Runs that survive what clusters do to them, through the real CLI in fresh processes:
checkpoint rotation, resume past damaged checkpoints, no mixing of a fresh run into an
old one. Every recovered run is compared with an uninterrupted one."""

import pytest

from tests.conftest import base_overrides, read_metrics, run_cli
from tests.test_spmd_training import assert_ok, rel_diff


def checkpoint_names(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("global_step_"))


def assert_same_losses(straight, recovered, steps):
    a = {m["step"]: m for m in read_metrics(straight)}
    b = {m["step"]: m for m in read_metrics(recovered)}  # a re-run step counts with its last record
    for step in steps:
        assert a[step]["train/tokens"] == b[step]["train/tokens"], step
        assert rel_diff(a[step]["train/loss"], b[step]["train/loss"]) < 1e-6, step


@pytest.mark.slow
def test_rotation_and_resume_past_damaged_checkpoints(tmp_path, model_path, tiny_data):
    """keep_last_checkpoints=3 over 4 saves keeps steps 2-4; with step 4's manifest gone and a
    shard of step 3 truncated, the resume warns about both, goes on from step 2, and its
    losses equal the uninterrupted run's."""
    train, _ = tiny_data
    common = {"data.train_batch_size": 4, "trainer.total_steps": 5, "trainer.export_hf": "false"}
    straight, rotated = tmp_path / "straight", tmp_path / "rotated"
    assert_ok(run_cli("hpsft.train", base_overrides(model_path, train, None, straight, **common)))

    rotating = {**common, "trainer.save_every": 1, "trainer.keep_last_checkpoints": 3}
    (rotated / "checkpoints" / "global_step_1.partial").mkdir(parents=True)  # left by a crashed save
    assert_ok(run_cli("hpsft.train", base_overrides(model_path, train, None, rotated, **rotating,
                                                    **{"trainer.stop_at_step": 4})))
    assert checkpoint_names(rotated) == ["global_step_2", "global_step_3", "global_step_4"]
    assert not list((rotated / "checkpoints").glob("*.partial"))

    (rotated / "checkpoints" / "global_step_4" / "manifest.json").unlink()
    shard = max((rotated / "checkpoints" / "global_step_3").glob("*.pt"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    proc = run_cli("hpsft.train", base_overrides(model_path, train, None, rotated, **rotating))
    assert_ok(proc)
    assert "hpsft: warning: checkpoint" in proc.stderr and "global_step_4 is damaged (no manifest.json" in proc.stderr
    assert f"global_step_3 is damaged ({shard.name} has" in proc.stderr
    assert "resumed from" in proc.stdout and "global_step_2 at step 2" in proc.stdout
    assert_same_losses(straight, rotated, range(1, 6))
    assert checkpoint_names(rotated) == ["global_step_3", "global_step_4", "global_step_5"]


@pytest.mark.slow
def test_a_fresh_run_into_an_old_run_directory_is_refused_unless_overwritten(tmp_path, model_path, tiny_data):
    train, _ = tiny_data
    out = tmp_path / "run"
    assert_ok(run_cli("hpsft.train", base_overrides(model_path, train, None, out, **{
        "trainer.total_steps": 1, "trainer.export_hf": "false"})))
    (out / "notes.txt").write_text("the user's own file")
    fresh = {"trainer.resume": "disable", "trainer.total_steps": 1, "trainer.export_hf": "false",
             "trainer.seed": 7}
    proc = run_cli("hpsft.train", base_overrides(model_path, train, None, out, **fresh))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"hpsft: error: trainer.output_dir={out} already holds a run"), last_line
    assert "trainer.overwrite_output_dir=true" in last_line and "Traceback" not in proc.stderr
    old_metrics = read_metrics(out)

    assert_ok(run_cli("hpsft.train", base_overrides(model_path, train, None, out, **fresh, **{
        "trainer.overwrite_output_dir": "true"})))
    new_metrics = read_metrics(out)
    assert len(new_metrics) == 1 and new_metrics[0]["train/loss"] != old_metrics[0]["train/loss"]
    assert checkpoint_names(out) == ["global_step_1"] and (out / "notes.txt").is_file()
