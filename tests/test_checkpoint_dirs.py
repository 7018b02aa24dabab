"""Checkpoint directories on their own (no training): manifests, rotation, fallback past
damaged checkpoints, and the guard against mixing a fresh run into an old one."""

import json

import pytest

from hpsft.utils.errors import UserInputError
from hpsft.trainer.checkpoint import CheckpointManager
from hpsft.trainer.run_dir import clear_previous_run, fresh_start_problem


def save(manager: CheckpointManager, step: int, shard_bytes: int = 1000):
    """What a save leaves: the trainer state, an engine shard, then rank 0's commit."""
    manager.save_trainer_state(step, {"global_step": step})
    (manager.root / manager.partial_tag(step) / "model_states.pt").write_bytes(b"x" * shard_bytes)
    return manager.commit(step)


def test_commit_writes_a_manifest_and_moves_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    folder = save(manager, 3)
    files = json.loads((folder / "manifest.json").read_text())["files"]
    assert files["model_states.pt"] == {"size": 1000}  # engine shards: size only
    assert files["trainer_state.pt"]["size"] > 0 and len(files["trainer_state.pt"]["sha256"]) == 64
    assert (manager.root / "latest").read_text() == "global_step_3\n"
    assert manager.latest() == folder


def test_prune_keeps_the_newest_n_and_clears_crashed_saves(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3, 4):
        save(manager, step)
    (manager.root / "global_step_9.partial").mkdir()  # a save that crashed
    (manager.root / "global_step_7").mkdir()  # a step after the current one: another branch, kept
    manager.prune(keep_last=2, current_step=4)
    assert sorted(p.name for p in manager.root.iterdir()) == [
        "global_step_3", "global_step_4", "global_step_7", "latest"]
    manager.prune(keep_last=0, current_step=4)  # 0 keeps everything
    assert (manager.root / "global_step_3").is_dir()


@pytest.mark.parametrize("damage", ["truncated_shard", "missing_manifest", "state_checksum", "latest_missing"])
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, capsys, damage):
    manager = CheckpointManager(tmp_path)
    previous, newest = save(manager, 1), save(manager, 2)
    expected = {
        "truncated_shard": "model_states.pt has 10 bytes, the manifest says 1000",
        "missing_manifest": "no manifest.json",
        "state_checksum": "trainer_state.pt does not match its checksum",
        "latest_missing": "latest names global_step_2, which does not exist",
    }[damage]
    if damage == "truncated_shard":
        (newest / "model_states.pt").write_bytes(b"x" * 10)
    elif damage == "missing_manifest":
        (newest / "manifest.json").unlink()
    elif damage == "state_checksum":  # same size, one byte changed
        state = newest / "trainer_state.pt"
        data = bytearray(state.read_bytes())
        data[-1] ^= 1
        state.write_bytes(bytes(data))
    else:
        for path in newest.iterdir():
            path.unlink()
        newest.rmdir()
    assert manager.latest() == previous
    assert expected in capsys.readouterr().err
    # Named explicitly, a damaged checkpoint is an error, not a silent substitute.
    if damage != "latest_missing":
        with pytest.raises(UserInputError, match="the checkpoint is damaged"):
            CheckpointManager.resolve(newest)
    assert CheckpointManager.resolve(tmp_path) == previous


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    manager = CheckpointManager(tmp_path)
    (save(manager, 1) / "manifest.json").unlink()
    with pytest.raises(UserInputError, match="no intact checkpoint up to global_step_1"):
        manager.latest()


def test_a_fresh_run_into_an_old_run_directory_needs_overwrite(tmp_path):
    assert fresh_start_problem(tmp_path, overwrite=False) is None
    save(CheckpointManager(tmp_path), 1)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("the user's own file")
    problem = fresh_start_problem(tmp_path, overwrite=False)
    assert str(tmp_path) in problem and "checkpoints, metrics.jsonl" in problem
    assert "trainer.overwrite_output_dir=true" in problem
    assert fresh_start_problem(tmp_path, overwrite=True) is None
    clear_previous_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
