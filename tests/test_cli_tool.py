"""The `hpsft` console script: its subcommands' --help, and each helper subcommand on real
files (the cut-down packaged model, real chat rows, a real 2-step run)."""

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hpsft.cli import SUBCOMMANDS
from hpsft.data.chat_tokenize import tokenize_conversation
from tests.conftest import REPO, base_overrides, read_metrics, run_cli, train_env, write_parquet

HPSFT = str(Path(sys.executable).parent / "hpsft")


def hpsft(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([HPSFT, *args], cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=timeout)


def test_top_level_help_lists_every_subcommand():
    proc = hpsft("--help")
    assert proc.returncode == 0, proc.stderr
    for name in SUBCOMMANDS:
        assert f"  {name} " in proc.stdout
    unknown = hpsft("fly")
    assert unknown.returncode == 2 and "hpsft: error: unknown subcommand 'fly'" in unknown.stderr


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(name):
    proc = hpsft(name, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:") and "options:" in proc.stdout


def test_inspect_data_marks_exactly_the_loss_mask(tmp_path, model_path, tokenizer, chat_rows):
    rows = chat_rows[:6]
    train = write_parquet([{"messages": c} for c in rows], tmp_path / "train.parquet")
    proc = hpsft("inspect-data", f"model.path={model_path}", f"data.train_files=[{train}]", "data.max_length=40",
                 "data.truncation=error", "--rows", "3", "--color", "never")  # rows shown whole
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = re.split(r"^=== .* row (\d+): .*$", proc.stdout, flags=re.M)
    for row_idx, text in zip(shown[1::2], shown[2::2]):
        ids, mask = tokenize_conversation(tokenizer, rows[int(row_idx)])
        supervised_runs = [tokenizer.decode([t for t, _ in run])
                           for on, run in itertools.groupby(zip(ids, mask), key=lambda pair: pair[1]) if on]
        assert re.findall(r"\[\[(.*?)\]\]", text, flags=re.S) == supervised_runs
    assert len(shown[1::2]) == 3
    lengths = [len(tokenize_conversation(tokenizer, c)[0]) for c in rows]
    assert "rows: 6 read, 6 tokenized, 0 refused" in proc.stdout
    over = sum(n > 40 for n in lengths)
    assert f"rows over data.max_length=40: {over} " in proc.stdout
    assert f"max={max(lengths)}, total={sum(lengths)}" in proc.stdout


def test_inspect_data_shows_the_split_sequences_and_the_counts(tmp_path, model_path, tokenizer, capsys):
    """Under data.truncation=split, on real ShareGPT rows: every shown sequence is within
    data.max_length, the marked runs of a row's sequences are its assistant turns, each once
    (but the counted dropped ones), and the counts line adds up to the rows over the limit."""
    from hpsft.assets.chat_corpora import sharegpt_conversations
    from hpsft.commands.inspect_data import main as inspect_data

    rows = sharegpt_conversations(12)
    train = write_parquet([{"messages": c} for c in rows], tmp_path / "train.parquet")
    assert inspect_data([f"model.path={model_path}", f"data.train_files=[{train}]", "data.max_length=512",
                         "data.truncation=split", "--rows", str(len(rows)), "--color", "never"]) == 0
    out = capsys.readouterr().out
    over = sum(len(tokenizer(tokenizer.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"])
               > 512 for c in rows)
    assert 3 <= over < len(rows) and f"rows over data.max_length=512: {over} " in out
    counts = dict(pair.split("=") for pair in re.search(r"^counts: (.*)$", out, re.M).group(1).split(", "))
    counts = {name: int(n) for name, n in counts.items()}
    assert counts["over_max_length_rows"] == over == counts["split_rows"] + counts.get("dropped_over_max_length", 0)
    shown = re.split(r"^=== .* row (\d+): (?:sequence \d+ of \d+, )?(\d+) tokens, \d+ supervised$", out, flags=re.M)
    runs = {i: [] for i in range(len(rows))}
    for row_idx, length, text in zip(shown[1::3], shown[2::3], shown[3::3]):
        assert int(length) <= 512
        runs[int(row_idx)] += re.findall(r"\[\[(.*?)\]\]", text, flags=re.S)
    dropped = 0
    for i, conversation in enumerate(rows):
        turns = [m["content"] + "<|im_end|>" for m in conversation if m["role"] == "assistant"]
        assert all(runs[i].count(run) == 1 and run in turns for run in runs[i])
        dropped += len(turns) - len(runs[i])
    assert dropped == counts.get("dropped_turns", 0)
    assert counts["split_sequences"] == sum(len(re.findall(rf"^=== .* row {i}: ", out, re.M))
                                            for i in range(len(rows)) if f"row {i}: sequence 1 of " in out)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model_path, chat_rows):
    """A real 2-step run with an exported hf/ folder."""
    root = tmp_path_factory.mktemp("cli-run")
    train = write_parquet([{"messages": c} for c in chat_rows[:16]], root / "train.parquet")
    val = write_parquet([{"messages": c} for c in chat_rows[16:20]], root / "val.parquet")
    out = root / "run"
    proc = run_cli("hpsft.train", base_overrides(model_path, train, val, out, **{"trainer.val_every": 1}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_plot_writes_one_png_per_logged_group(run_dir):
    from PIL import Image

    proc = hpsft("plot", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = sorted(Path(line).name for line in proc.stdout.split())
    assert written == ["grad_norm.png", "loss.png", "lr.png", "mfu.png", "padding_efficiency.png",
                       "tokens_per_s.png"]
    for name in written:
        assert Image.open(run_dir / "plots" / name).size == (800, 450)
    assert {"train/loss", "val/loss"} <= set().union(*read_metrics(run_dir))
    missing = hpsft("plot", str(run_dir / "nowhere"))
    assert missing.returncode == 2 and "metrics.jsonl does not exist" in missing.stderr


def test_generate_is_greedy_and_reads_a_run_directory(run_dir):
    first = hpsft("generate", str(run_dir), "--prompt", "Hello", "--max-new-tokens", "8")
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.startswith("### user\nHello\n### assistant\n")
    again = hpsft("generate", str(run_dir / "hf"), "--prompt", "Hello", "--max-new-tokens", "8")
    assert again.stdout == first.stdout
    nothing = hpsft("generate", str(run_dir / "checkpoints"), "--prompt", "Hello")
    assert nothing.returncode == 2 and "neither a model folder" in nothing.stderr


def test_prepare_data_reports_the_rows_it_wrote(tmp_path):
    proc = hpsft("prepare-data", "--out", str(tmp_path / "data"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for path, rows in re.findall(r"^(\S+\.parquet) \((\d+) rows\)$", proc.stdout, flags=re.M):
        assert pq.read_metadata(path).num_rows == int(rows) > 0


def test_samples_writes_before_and_after_replies_on_held_out_prompts(run_dir, chat_rows):
    proc = hpsft("samples", str(run_dir), "--n", "2", "--max-new-tokens", "6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    # The run's validation file holds chat_rows[16:20]; each starts with a user turn.
    assert [r["prompt"] for r in records] == [c[0]["content"] for c in chat_rows[16:18]]
    assert [r["reference"] for r in records] == [c[1]["content"] for c in chat_rows[16:18]]
    assert all(isinstance(r["before"], str) and isinstance(r["after"], str) for r in records)
    text = (run_dir / "samples.md").read_text()
    assert text.count("- before: ") == text.count("- after: ") == 2
