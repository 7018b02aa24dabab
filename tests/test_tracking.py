"""Tracking and profiling through the real CLI: W&B offline (read back from its own
transaction log), TensorBoard's config text, a torch.profiler trace of chosen steps; and
the start-up checks and the progress bar's fields."""

import json
import sys

import pytest
from tqdm import tqdm

from hpsft.config import ConfigError, load_config
from hpsft.utils.errors import UserInputError
from hpsft.utils.progress import step_postfix
from hpsft.trainer.tracking import check_trackers_available
from tests.conftest import base_overrides, run_cli, write_parquet
from tests.tracking_files import (assert_holds_the_jsonl_scalars, only_run_log, profiled_steps, wandb_offline_env,
                                  wandb_records)

FAKE_API_KEY = "fake-wandb-key-7d1e0c5b9a3f4e2d8c6b"
URL_PASSWORD = "hunter2-url-password"


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, model_path, chat_rows):
    """One 4-step run logging to JSONL, TensorBoard and W&B (offline), profiling steps 2-3,
    with a fake API key in its environment and a URL password on its command line."""
    root = tmp_path_factory.mktemp("tracked")
    train = write_parquet([{"messages": c} for c in chat_rows[:16]], root / "train.parquet")
    val = write_parquet([{"messages": c} for c in chat_rows[16:24]], root / "val.parquet")
    run_dir = root / "run"
    overrides = base_overrides(model_path, train, val, run_dir, **{
        "trainer.total_steps": 4, "trainer.val_every": 2, "trainer.loggers": "[jsonl,tensorboard,wandb]",
        "trainer.wandb.project": "hpsft-test", "trainer.profile_steps": "[2,3]", "trainer.export_hf": "false",
        # Ignored by an SPMD run, but on its command line, which W&B would record.
        "ray.address": f"ray://user:{URL_PASSWORD}@127.0.0.1:10001"})
    result = run_cli("hpsft.train", overrides, env={**wandb_offline_env(root), "WANDB_API_KEY": FAKE_API_KEY})
    assert result.returncode == 0, result.stderr[-3000:]
    return root, run_dir


def test_wandb_offline_run_holds_the_jsonl_scalars_and_no_secret(tracked_run):
    root, run_dir = tracked_run
    records = wandb_records(only_run_log(run_dir))
    assert_holds_the_jsonl_scalars(records, run_dir, [1, 2, 3, 4])
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"]["loggers"] == ["jsonl", "tensorboard", "wandb"]
    assert config["ray"]["address"] == "ray://user:***@127.0.0.1:10001"  # masked, as in config.yaml
    # Neither the key nor the password in any file the run or W&B wrote.
    for path in root.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            assert FAKE_API_KEY.encode() not in content and URL_PASSWORD.encode() not in content, path


def test_tensorboard_holds_the_resolved_config_as_text(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = tracked_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    [text] = events.Tensors("config/text_summary")
    logged = text.tensor_proto.string_val[0].decode()
    assert logged == "\n".join("    " + line for line in (run_dir / "config.yaml").read_text().splitlines())
    assert "ray://user:***@" in logged
    assert [s.step for s in events.Scalars("train/loss")] == [1, 2, 3, 4]


def test_profile_covers_the_requested_steps_only(tracked_run):
    _, run_dir = tracked_run
    assert profiled_steps(run_dir, 0) == ["step 2", "step 3"]
    table = (run_dir / "profile" / "rank0_key_averages.txt").read_text()
    assert "Self CPU" in table and "aten::mm" in table


def test_wandb_missing_or_without_key_is_refused_before_training(monkeypatch):
    config = load_config(None, ["trainer.loggers=[jsonl,wandb]"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` does when it is not installed
    with pytest.raises(UserInputError, match=r"pip install hpsft\[wandb\]"):
        check_trackers_available(config)
    monkeypatch.delitem(sys.modules, "wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(UserInputError, match="WANDB_API_KEY is not set"):
        check_trackers_available(config)
    check_trackers_available(load_config(None, ["trainer.loggers=[wandb]", "trainer.wandb.mode=offline"]))
    monkeypatch.setenv("WANDB_API_KEY", FAKE_API_KEY)
    check_trackers_available(config)


def test_a_credential_in_the_config_is_refused():
    with pytest.raises(ConfigError, match="from the environment only"):
        load_config(None, ["trainer.wandb.api_key=abc"])


def test_progress_bar_shows_loss_tokens_per_second_and_eta():
    postfix = step_postfix({"train/loss": 2.34567, "perf/tokens_per_s": 1234.4})
    line = tqdm.format_meter(3, 10, 6.0, postfix=", ".join(f"{k}={v}" for k, v in postfix.items()), unit="step")
    assert "loss=2.3457" in line and "tok/s=1234" in line
    assert "00:06<00:14" in line  # elapsed < remaining: 7 more steps at 2 s each
