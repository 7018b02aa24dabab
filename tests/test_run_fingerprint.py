"""A resume refuses a checkpoint of a different run (the run fingerprint) and accepts the
same run with harmless changes, through the real CLI."""

import json
from pathlib import Path

import pytest

from hpsft.trainer.fingerprint import differences
from tests.conftest import base_overrides, read_metrics, run_cli, write_parquet
from tests.test_spmd_training import assert_ok


def error_line(proc) -> str:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpsft: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def test_differences_name_each_changed_key_old_to_new():
    old = {"data.train_batch_size": 8, "data.train_files sha256": ["a" * 64], "trainer.seed": 1, "gone": 3}
    new = {"data.train_batch_size": 4, "data.train_files sha256": ["b" * 64], "trainer.seed": 1, "added": 2}
    assert differences(old, new) == [
        "data.train_batch_size: 8 -> 4",
        f"data.train_files sha256: [{'a' * 12}] -> [{'b' * 12}]",
        "gone: 3 -> absent",
        "added: absent -> 2",
    ]
    assert differences(old, dict(old)) == []


@pytest.mark.slow
def test_resume_refuses_another_run_and_accepts_an_extended_one(tmp_path, model_path, tiny_data, chat_rows):
    train, _ = tiny_data
    out = tmp_path / "run"

    def overrides(**extra):
        settings = {"data.train_batch_size": 4, "trainer.export_hf": "false", "trainer.keep_last_checkpoints": 1}
        return base_overrides(model_path, train, None, out, **{**settings, **extra})

    assert_ok(run_cli("hpsft.train", overrides(**{"trainer.total_steps": 1})))
    fingerprint = json.loads((out / "checkpoints" / "global_step_1" / "run_fingerprint.json").read_text())
    assert fingerprint["data.train_batch_size"] == 4
    manifest = json.loads((out / "checkpoints" / "global_step_1" / "manifest.json").read_text())
    assert "sha256" in manifest["files"]["run_fingerprint.json"]

    # The same path with other content: refused, naming the key; nothing written.
    original = Path(train).read_bytes()
    write_parquet([{"messages": c} for c in chat_rows[24:40]], Path(train))
    line = error_line(run_cli("hpsft.train", overrides(**{"trainer.total_steps": 2})))
    Path(train).write_bytes(original)
    assert "belongs to a different run: data.train_files sha256: [" in line and "trainer.resume_force=true" in line
    assert "data.train_batch_size" not in line

    line = error_line(run_cli("hpsft.train", overrides(**{"trainer.total_steps": 2, "data.train_batch_size": 8})))
    assert "data.train_batch_size: 4 -> 8" in line and "sha256" not in line
    assert [m["step"] for m in read_metrics(out)] == [1]

    # total_steps extended, with other logging and save cadence and micro-batch split: accepted.
    proc = run_cli("hpsft.train", overrides(**{"trainer.total_steps": 2, "trainer.log_every": 2,
                                               "trainer.save_every": 5, "data.micro_batch_size_per_gpu": 2}))
    assert_ok(proc)
    assert "resumed from" in proc.stdout and "global_step_1 at step 1" in proc.stdout
    assert "hpsft: warning" not in proc.stderr

    proc = run_cli("hpsft.train", overrides(**{"trainer.total_steps": 3, "data.train_batch_size": 8,
                                               "trainer.resume_force": "true"}))
    assert_ok(proc)
    assert "trainer.resume_force=true although the run differs: data.train_batch_size: 4 -> 8" in proc.stderr
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
