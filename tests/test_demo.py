"""`make demo` as a user runs it (the Makefile's demo target: hpsft.train with configs/sft.yaml,
then hpsft.samples, then hpsft.plot), cut to the 2-layer test model and 2 steps: what the
README promises of its run directory."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics, train_env


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_demo_run_directory(tmp_path, model_path):
    from hpsft.assets.chat_corpora import build

    build(REPO / ".cache" / "data" / "chatterbot")  # what `make data` makes (kept when present)
    run = tmp_path / "run"
    overrides = [f"model.path={model_path}", "trainer.total_steps=2", "trainer.val_every=2",
                 "data.train_batch_size=8", f"data.cache_dir={tmp_path / 'tokenized'}", "trainer.progress_bar=false"]
    # -o model -o data: the model and data are there (fixture, build above); make must not
    # look at the virtualenv's install stamp, which a test has no business rebuilding.
    proc = subprocess.run(["make", "-o", "model", "-o", "data", "demo", f"PY={sys.executable}", f"RUN={run}",
                           f"ARGS={' '.join(overrides)}"], cwd=REPO, env=train_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    val = [(m["step"], m["val/loss"]) for m in read_metrics(run) if "val/loss" in m]
    assert [step for step, _ in val] == [0, 2]  # trainer.val_before_train=true in configs/sft.yaml
    assert val[-1][1] < val[0][1]

    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4  # `hpsft samples` defaults: 4 held-out prompts
    assert all(isinstance(s["before"], str) and isinstance(s["after"], str) and s["prompt"] for s in samples)
    assert (run / "samples.md").read_text().count("- after: ") == 4

    assert sorted(p.name for p in (run / "plots").iterdir()) == [
        "grad_norm.png", "loss.png", "lr.png", "mfu.png", "padding_efficiency.png", "tokens_per_s.png"]
    assert all(Path(p).stat().st_size > 0 for p in (run / "plots").iterdir())
