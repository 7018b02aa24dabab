"""Bad input through the real CLI: one line naming the cause, exit code 2, no run left behind."""

import json
import shutil

import pytest

from tests.conftest import base_overrides, run_cli, write_jsonl

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


def bad_cases(tmp_path, model_path, tiny_data):
    train, val = tiny_data
    bad_rows = write_jsonl([GOOD, GOOD, {"messages": [{"role": "robot", "content": "beep"}]}], tmp_path / "bad.jsonl")
    long_row = write_jsonl([{"messages": [{"role": "user", "content": "word " * 100},
                                          {"role": "assistant", "content": "ok"}]}], tmp_path / "long.jsonl")
    remote_code = tmp_path / "remote-code-model"
    shutil.copytree(model_path, remote_code)
    config = json.loads((remote_code / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (remote_code / "config.json").write_text(json.dumps(config))
    return {
        "unknown_key": (["optim.lrr=1"], "unknown config key 'optim.lrr'; valid keys here: betas"),
        "malformed_row": ([f"data.train_files=[{bad_rows}]"], "bad.jsonl row 2: message 0 has unknown role 'robot'"),
        "too_long": ([f"data.train_files=[{long_row}]", "data.max_length=32"],
                     "long.jsonl row 0: sequence has"),
        "missing_model": (["model.path=/nonexistent/model"],
                          "model.path=/nonexistent/model: no Hugging Face model folder there"),
        "remote_code": ([f"model.path={remote_code}"],
                        "config.json asks for code shipped with the model (['AutoModelForCausalLM']); hpsft does "
                        "not run it unless model.trust_remote_code=true, which executes that folder's Python files "
                        "with your permissions"),
    }


@pytest.mark.parametrize("case", ["unknown_key", "malformed_row", "too_long", "missing_model", "remote_code"])
def test_bad_input_fails_in_one_line_and_writes_nothing(tmp_path, model_path, tiny_data, case):
    train, val = tiny_data
    overrides, message = bad_cases(tmp_path, model_path, tiny_data)[case]
    out = tmp_path / "run"
    proc = run_cli("hpsft.train", base_overrides(model_path, train, val, out) + overrides, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("hpsft: error: ") and message in last_line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists()
