"""Shared fixtures: the real (layer-cut) SmolLM2 model, cut-down real chat data, and a
runner for the real CLI in fresh processes (one process, or torchrun with N ranks)."""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parent.parent
TEST_MODEL = REPO / ".cache" / "models" / "smollm2-135m-2l"
FULL_MODEL = REPO / ".cache" / "models" / "smollm2-135m"


CPU_TIMES_VAR = "HPSFT_TEST_CPU_TIMES"
cpu_times: list[tuple[float, float, str]] = []  # (CPU s, wall s, test id), filled when the variable is set


def cpu_seconds() -> float:
    """User+system CPU of pytest and of its descendants that were waited for (a Ray worker
    is no child of pytest: its CPU is not counted; judge Ray tests by their wall time)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With HPSFT_TEST_CPU_TIMES=path, note each test's CPU and wall seconds (setup, call
    and teardown: a module-scoped fixture's run counts for the test that first needs it).
    CPU time is the measure to compare on a shared, loaded machine, where wall time is not."""
    if not os.environ.get(CPU_TIMES_VAR):
        yield
        return
    cpu, wall = cpu_seconds(), time.monotonic()
    yield
    cpu_times.append((cpu_seconds() - cpu, time.monotonic() - wall, item.nodeid))


def pytest_sessionfinish(session):
    """Write the noted times, most CPU first, as a table (CPU s, wall s, test)."""
    path = os.environ.get(CPU_TIMES_VAR)
    if not path or not cpu_times:
        return
    rows = sorted(cpu_times, reverse=True)
    lines = [f"{'cpu_s':>8} {'wall_s':>8}  test"] + [f"{c:8.1f} {w:8.1f}  {t}" for c, w, t in rows]
    lines.append(f"{sum(r[0] for r in rows):8.1f} {sum(r[1] for r in rows):8.1f}  total ({len(rows)} tests)")
    Path(path).write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="session")
def model_path() -> str:
    """SmolLM2-135M-Instruct cut to 2 layers (built from the packaged GGUF if missing)."""
    from hpsft.prepare_model import packaged

    return str(packaged(TEST_MODEL, num_layers=2, full_dir=FULL_MODEL))


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def chat_rows() -> list:
    """Real conversations from chatterbot-corpus, deduplicated."""
    from hpsft.assets.chat_corpora import chatterbot_conversations, deduplicate

    return deduplicate(chatterbot_conversations())


def columns(rows: list[dict]) -> dict[str, list]:
    """Rows as columns, every key of any row one (missing: None). pa.Table.from_pylist and
    datasets.Dataset.from_list would keep only the first row's keys."""
    keys = dict.fromkeys(key for row in rows for key in row)
    return {key: [row.get(key) for row in rows] for key in keys}


def write_parquet(rows: list[dict], path: Path) -> str:
    pq.write_table(pa.table(columns(rows)), path)
    return str(path)


def write_jsonl(rows: list, path: Path) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_tiny_llama(folder: Path) -> Path:
    """A 2-layer Llama with random weights (seed 0) and a 512-token vocabulary: optimizer
    steps take milliseconds."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )).save_pretrained(folder)
    return folder


@pytest.fixture
def tiny_data(tmp_path, chat_rows):
    """16 train and 8 validation conversations as parquet."""
    return (
        write_parquet([{"messages": c} for c in chat_rows[:16]], tmp_path / "train.parquet"),
        write_parquet([{"messages": c} for c in chat_rows[16:24]], tmp_path / "val.parquet"),
    )


def train_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["TOKENIZERS_PARALLELISM"] = "false"
    # A script's own folder comes first on its sys.path, not the cwd: without this, scripts
    # would import the hpsft the virtualenv has installed (maybe another checkout's).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    return env


def cli_command(module: str | None, args: list[str], nproc: int = 1, script: str | None = None,
                launcher: str = "torchrun") -> list[str]:
    """`python -m module args` (or a script): one plain process, or `nproc` ranks under
    torchrun or the deepspeed launcher."""
    target = [script] if script else ["-m", module]
    if nproc == 1:
        return [sys.executable, *target, *args]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                *target, *args]
    if launcher == "deepspeed":
        from hpsft.distributed import free_port

        ds_target = [script] if script else ["--module", module]
        return [str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={nproc}", f"--master_port={free_port()}",
                *ds_target, *args]
    raise ValueError(launcher)


def run_cli(module: str | None, args: list[str], nproc: int = 1, timeout: int = 600, script: str | None = None,
            launcher: str = "torchrun", env: dict | None = None):
    """Run the CLI (see cli_command) in fresh processes to the end; `env` adds variables."""
    return subprocess.run(cli_command(module, args, nproc, script, launcher), cwd=REPO,
                          env={**train_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def base_overrides(model_path, train, val, out_dir, **extra) -> list[str]:
    """A tiny, fast, deterministic config: loss backend left at auto. The MFU peak is given,
    not measured: measuring it keeps every rank busy ~2.4 s at start-up (6 GEMM trials of
    0.4 s); test_zero_stage_trains_two_ranks_and_exports measures it end to end (null)."""
    values = {
        "model.path": model_path,
        "data.train_files": f"[{train}]",
        "data.val_files": f"[{val}]" if val else "[]",
        "data.max_length": 256,
        "data.cache_dir": str(Path(out_dir).parent / "tokcache"),
        "data.train_batch_size": 8,
        "data.micro_batch_size_per_gpu": 8,
        "trainer.output_dir": str(out_dir),
        "trainer.progress_bar": "false",
        "trainer.loggers": "[jsonl]",
        "trainer.total_steps": 2,
        "optim.lr": 1e-3,
        "optim.warmup_ratio": 0.0,
        "trainer.peak_flops_per_device": 1e12,  # above any CPU's fp32 rate: perf/mfu stays a reading, not 1
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]
