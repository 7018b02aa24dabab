"""The malformed-input corpus (tests/data/malformed/cases.yaml): each case ends in its one
`hpsft: error:` line, exit status 2, no traceback, and nothing a later resume would trust."""

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, read_metrics, run_cli, train_env
from tests.test_spmd_training import assert_ok

DATA = REPO / "tests" / "data" / "malformed"
CASES = {case["id"]: case for case in yaml.safe_load((DATA / "cases.yaml").read_text())}


@pytest.fixture(scope="module")
def corpus_results(tmp_path_factory, model_path) -> dict:
    """Every case run once, in one fresh process (tests/dist_scripts/run_malformed_cases.py)."""
    scratch = tmp_path_factory.mktemp("malformed")
    report = scratch / "report.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "dist_scripts" / "run_malformed_cases.py"), model_path,
         str(scratch / "cases"), str(report)],
        cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(report.read_text())


def test_the_corpus_covers_every_area():
    areas = {case["area"] for case in CASES.values()}
    assert areas == {"config", "data", "model", "filesystem", "checkpoint"} and len(CASES) >= 25


@pytest.mark.parametrize("case_id", list(CASES))
def test_malformed_input_ends_in_one_line_naming_it(corpus_results, case_id):
    """Catches any input that ends in a traceback, a second error line or a half-written run;
    output_dir_on_a_pseudo_filesystem caught the output_dir probe by permission bits
    (os.access), which let the run tokenize its data and then fail in mkdir."""
    case, result = CASES[case_id], corpus_results[case_id]
    stderr = result["stderr"]
    assert result["status"] == case.get("exit", 2), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("hpsft: error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert case["expect"].format(data=DATA, tmp=result["tmp"]) in errors[0], errors[0]
    assert result["output_dir_unchanged"] and not result["latest_written"]
    if case.get("stage") == "config":
        assert result["heavy_imports"] == [], result["heavy_imports"]
    if case.get("stage") in ("config", "before_data"):
        assert not result["data_prepared"]


def test_a_json_array_file_is_read_as_rows_and_trains(tmp_path, model_path):
    """A .json file holding one JSON array of rows (as many datasets ship) is training data."""
    out = tmp_path / "run"
    assert_ok(run_cli("hpsft.train", [
        f"model.path={model_path}", f"data.train_files=[{DATA / 'good_array.json'}]", "data.val_files=[]",
        f"data.cache_dir={tmp_path / 'tokcache'}", "data.train_batch_size=8", "trainer.total_steps=1",
        f"trainer.output_dir={out}", "trainer.progress_bar=false", "trainer.loggers=[jsonl]",
        "trainer.export_hf=false"]))
    [metrics] = read_metrics(out)
    assert metrics["train/loss_tokens"] > 0
    assert (out / "checkpoints" / "latest").is_file()
