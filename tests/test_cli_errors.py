"""Bad input through the real CLI in a fresh process: one line naming the cause, exit code 2,
no run left behind. The malformed-input corpus (tests/data/malformed/cases.yaml, run by
tests/test_malformed_inputs.py in one process) covers every other case."""

import pytest

from tests.conftest import base_overrides, run_cli, write_jsonl

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


def bad_cases(tmp_path):
    bad_rows = write_jsonl([GOOD, GOOD, {"messages": [{"role": "robot", "content": "beep"}]}], tmp_path / "bad.jsonl")
    return {
        "unknown_key": (["optim.lrr=1"], "unknown config key 'optim.lrr'; valid keys here: betas"),
        "malformed_row": ([f"data.train_files=[{bad_rows}]"], "bad.jsonl row 2: message 0 has unknown role 'robot'"),
    }


@pytest.mark.parametrize("case", ["unknown_key", "malformed_row"])
def test_bad_input_fails_in_one_line_and_writes_nothing(tmp_path, model_path, tiny_data, case):
    train, val = tiny_data
    overrides, message = bad_cases(tmp_path)[case]
    out = tmp_path / "run"
    proc = run_cli("hpsft.train", base_overrides(model_path, train, val, out) + overrides, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("hpsft: error: ") and message in last_line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists()
