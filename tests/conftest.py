"""Shared fixtures: the real (layer-cut) SmolLM2 model, cut-down real chat data, a runner
for the real CLI in fresh processes (one process, or torchrun with N ranks; each process
started preloaded: tests/preloaded.py), and the comparison of two runs step by step (loss
and unclipped gradient norm).

`@pytest.mark.fast` marks each subsystem's cheapest strong test: `make test-fast` runs them
(docs/testing.md)."""

import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.preloaded import SOCKET_ENV as PRELOADED_SOCKET_ENV

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
    """Write the noted times, most CPU first, as a table (CPU s, wall s, test); under
    pytest-xdist each worker writes its own (the path with `.gw0`, `.gw1`... appended)."""
    path = os.environ.get(CPU_TIMES_VAR)
    if not path or not cpu_times:
        return
    if "PYTEST_XDIST_WORKER" in os.environ:
        path = f"{path}.{os.environ['PYTEST_XDIST_WORKER']}"
    rows = sorted(cpu_times, reverse=True)
    lines = [f"{'cpu_s':>8} {'wall_s':>8}  test"] + [f"{c:8.1f} {w:8.1f}  {t}" for c, w, t in rows]
    lines.append(f"{sum(r[0] for r in rows):8.1f} {sum(r[1] for r in rows):8.1f}  total ({len(rows)} tests)")
    Path(path).write_text("\n".join(lines) + "\n")


# The quick loop (make test-fast, docs/testing.md): each subsystem's cheapest strong test, by
# node id (a function's id takes all its parameters). One list, whoever owns the test file.
FAST_TESTS = (
    "tests/test_config.py::test_bad_config_names_the_key",  # config
    "tests/test_chat_data.py::test_loss_mask_is_exactly_the_assistant_turns",  # data
    "tests/test_chat_data.py::test_bad_row_names_file_and_row",
    "tests/test_chat_templates.py::test_each_template_supervises_exactly_the_assistant_turns",
    "tests/test_prepare.py::test_prepare_data_refuses_what_it_cannot_read",
    "tests/test_data_mixing.py::test_weights_3_to_1_give_a_binomial_ratio_and_each_source_is_drawn_without_replacement",
    "tests/ops/test_varlen_ce.py::test_logits_api_matches_reference",  # the loss op against fp64
    "tests/ops/test_edge_cases.py::test_nothing_supervised_gives_zero_loss_and_gradients",
    "tests/ops/test_gradcheck.py::test_linear_gradcheck",
    "tests/ops/test_bf16_gemms.py::test_bf16_inputs_match_the_fp64_reference",
    "tests/test_packing.py::test_packed_forward_equals_each_sequence_alone",  # packing
    "tests/test_packing.py::test_fixed_and_token_budget_splits_give_the_same_loss_and_gradients",
    "tests/test_packing.py::test_micro_batch_plans_place_every_sample_once_within_budget",
    # hpsft's packed loss and gradients against the model's own HF eager forward: a plain family,
    # a sliding window, soft-caps, sinks
    "tests/test_model_families.py::test_packed_loss_and_gradients_equal_the_models_own_forward[llama]",
    "tests/test_model_families.py::test_packed_loss_and_gradients_equal_the_models_own_forward[mistral]",
    "tests/test_model_families.py::test_packed_loss_and_gradients_equal_the_models_own_forward[gemma2]",
    "tests/test_model_families.py::test_packed_loss_and_gradients_equal_the_models_own_forward[gpt_oss]",
    "tests/test_optimizer.py::test_engine_steps_equal_plain_torch_adamw_with_clipping",  # engine
    "tests/test_optimizer.py::test_the_gradient_norm_is_fp64_accurate",
    "tests/test_engine_parts.py::test_gradient_checkpointing_gives_the_same_gradients",
    "tests/test_engine_parts.py::test_warmup_then_cosine_to_the_minimum",
    "tests/test_spmd_training.py::test_dp_and_micro_batch_invariance[fixed]",  # the trainer, 1 vs 2 ranks
    "tests/test_checkpoint_dirs.py::test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used",
    "tests/test_elastic_resume.py::test_a_checkpoint_resumes_exactly_with_and_without_zero[ds2-default]",
    "tests/test_run_fingerprint.py::test_differences_name_each_changed_key_old_to_new",
    "tests/test_sequence_parallel.py::test_a_row_cut_across_the_group_keeps_every_label_and_position",
    "tests/test_sequence_parallel.py::test_tiled_mlps_give_the_untiled_gradients_in_tiles",
    "tests/test_sampler.py::test_every_number_of_parts_continues_from_a_position_on_the_straight_runs_samples",
    "tests/test_sampler.py::test_split_by_cost_keeps_sizes_even_and_balances_costs",
    "tests/test_data_stage.py::test_the_store_is_the_same_whatever_the_shards_and_worker_processes",
    "tests/test_slurm.py::test_batch_step_process_is_alone_and_srun_tasks_are_ranks",
    "tests/test_fault_tolerance.py::test_first_signal_is_noted_and_a_second_one_kills_at_once",
    "tests/test_cli_errors.py::test_bad_input_fails_in_one_line_and_writes_nothing[unknown_key]",
    "tests/test_cli_tool.py::test_top_level_help_lists_every_subcommand",
    "tests/test_tracking.py::test_a_credential_in_the_config_is_refused",
    "tests/test_mfu.py::test_the_peak_is_configured_else_a_known_accelerators_datasheet_else_measured",
    "tests/test_trust.py::test_path_inside_refuses_names_leaving_the_folder",
    "tests/test_device_selection.py::test_a_rank_takes_its_local_rank_or_its_only_device",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the quick loop (make test-fast): each subsystem's cheapest strong test")
    config.addinivalue_line("markers", "alone: measures a process's memory: make test runs these after the others, "
                                       "with nothing beside them")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        # Each pytest-xdist worker computes on its share of the cores: 2 workers of 2 torch
        # threads on 2 cores would time-slice every GEMM. (The CLI's processes get one thread
        # each from train_env.)
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


# Under pytest-xdist (make test) each test file goes to one worker whole (--dist loadfile),
# so that its module-scoped fixtures (a reference run, a Ray instance, the Slurm cluster) are
# made once. (Not --dist loadgroup: with pytest 9 pytest-xdist 3.8 cannot rename the node ids
# it groups by, so every test was dealt out alone and a module's fixtures built on both
# workers: found 2026-12-01.) Ray instances of two files may run side by side; they did in
# every xdist run so far, without a failure of their own.
# The files that take longest (the summed --durations=0 seconds of a fresh-clone run, 2026-12-07), most
# first: they are collected first, so that pytest-xdist starts them first and the workers'
# last files are short ones (a long file started last would keep one worker busy alone).
LONGEST_FILES = ("test_ray.py", "test_tensor_parallel.py", "test_qlora.py", "test_fault_tolerance.py",
                 "test_trust.py", "test_data_stage.py", "test_launchers.py", "test_megatron_engine.py",
                 "test_spmd_training.py", "test_slurm.py", "test_cli_tool.py", "test_image_data_stage.py",
                 "test_lora.py", "test_elastic_resume.py", "test_head_gradient.py", "test_export.py",
                 "test_sequence_parallel.py", "test_malformed_inputs.py", "test_megatron_model.py",
                 "test_demo.py", "test_no_hangs.py", "test_metrics.py", "test_vision_training.py",
                 "test_ray_vision.py", "test_vision_lm.py")


def file_rank(item) -> int:
    """Where the item's file comes in LONGEST_FILES (a file not listed: after them all)."""
    name = Path(str(item.fspath)).name
    return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config, items):
    """Mark FAST_TESTS `fast`; under -m fast with the whole suite collected, a listed name that
    matches no test is an error (a renamed test must not drop out of the loop unseen). Put
    the longest files first (stable: a file's tests keep their order, so a module fixture is
    still made once) when pytest-xdist runs the suite."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=file_rank)
    matched = set()
    for item in items:
        name = item.nodeid.split("[")[0]
        for fast in FAST_TESTS:
            if item.nodeid == fast or name == fast:
                item.add_marker(pytest.mark.fast)
                matched.add(fast)
    whole_suite = {Path(str(arg)).resolve() for arg in config.args} <= {REPO / "tests", REPO}
    if config.option.markexpr == "fast" and whole_suite and set(FAST_TESTS) - matched:
        raise pytest.UsageError(f"FAST_TESTS names no collected test: {sorted(set(FAST_TESTS) - matched)}")


@pytest.fixture(scope="session")
def model_path() -> str:
    """SmolLM2-135M-Instruct cut to 2 layers (built from the packaged GGUF if missing)."""
    from hpsft.models.conversion import packaged

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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, model_path) -> str:
    """A 2-layer Llama with random weights (seed 0) shaped like SmolLM2 (tied embeddings, grouped
    key/value heads, its 49152-token vocabulary) but 64 wide, with SmolLM2's tokenizer and chat
    template: the CLI trains it on the real chat data at a fraction of the 2-layer SmolLM2's cost
    (weights, optimizer state and checkpoints ~20x smaller). For tests that compare two paths of
    the same run and need no pretrained weights."""
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat_model"), model_path)


def write_tiny_chat_model(folder: Path, model_path: str, intermediate_size: int = 96) -> str:
    """tiny_chat_model's model in `folder`; a larger `intermediate_size` gives MLP weights that
    ZeRO-3 partitions (DeepSpeed keeps a parameter under 1e5 values whole on every rank)."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=2, bos_token_id=1, eos_token_id=2,
    )).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(model_path) / name, folder / name)
    return str(folder)


def chat_parquet(folder: Path, chat_rows: list, train: int = 16, val: int = 8, first: int = 0
                 ) -> tuple[str, str | None]:
    """Conversations [first, first + train) as folder/train.parquet and the `val` after them as
    folder/val.parquet (None when val is 0), one `messages` row each: most tests' data files."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"messages": c} for c in chat_rows[first:first + train + val]]
    assert len(rows) == train + val, f"only {len(rows)} conversations from {first}"
    return (write_parquet(rows[:train], folder / "train.parquet"),
            write_parquet(rows[train:], folder / "val.parquet") if val else None)


@pytest.fixture
def tiny_data(tmp_path, chat_rows):
    """16 train and 8 validation conversations as parquet."""
    return chat_parquet(tmp_path, chat_rows)


def train_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["TOKENIZERS_PARALLELISM"] = "false"
    # A script's own folder comes first on its sys.path, not the cwd: without this, scripts
    # would import the hpsft the virtualenv has installed (maybe another checkout's).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    if preloaded_server:
        env[PRELOADED_SOCKET_ENV] = preloaded_server[0]
    return env


# Ray's settings for the tests' own instances: no token auth on loopback, no usage stats.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DISABLE_USAGE_STATS": "1"}


def ray_env() -> dict:
    """train_env() for a Ray driver or the nodes of a test's Ray instance (RAY_ENV), its job's
    workers preloaded (preloaded_ray_workers)."""
    preloaded = preloaded_ray_workers()  # first: it may start the server train_env() names
    return {**train_env(), **RAY_ENV, **preloaded}


def preloaded_ray_workers() -> dict:
    """The variables that start a Ray job's workers preloaded: Ray starts a worker as
    `<py_executable> default_worker.py ARGS`, py_executable from the job's runtime_env, which
    ray.init reads from RAY_JOB_CONFIG_JSON_ENV_VAR (the variable Ray's job supervisor sets for
    an entrypoint). So the client stands for python there as under torchrun: a cold worker
    spent ~11 CPU s importing torch, DeepSpeed and transformers before its first call."""
    python = preloaded_python()
    if len(python) == 1:
        return {}
    return {PRELOADED_SOCKET_ENV: preloaded_server[0],
            "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"py_executable": shlex.join(python)}})}


PRELOADED = REPO / "tests" / "preloaded.py"
preloaded_server: list = []  # [socket path, server process] once started


def preloaded_python() -> list[str]:
    """The command that stands for `python` in the CLI's command lines: the client of this
    pytest process's preloading server (tests/preloaded.py: the imports done once, a fork per
    run), started on first use. HPSFT_TEST_PRELOADED=0 makes every run a cold start."""
    if os.environ.get("HPSFT_TEST_PRELOADED", "1") == "0":
        return [sys.executable]
    if not preloaded_server:
        import atexit
        import tempfile

        path = str(Path(tempfile.mkdtemp(prefix="hpsft-preloaded-")) / "socket")
        env = train_env()  # before the server is noted: its own environment names no socket
        log = open(Path(path).with_name("server.log"), "w")
        server = subprocess.Popen([sys.executable, "-u", str(PRELOADED), "--serve", path], cwd=REPO, env=env,
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        atexit.register(server.kill)
        deadline = time.monotonic() + 60
        while not os.path.exists(path):  # bound at once; it imports after (clients wait in its backlog)
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the preloading server did not start: {Path(path).with_name('server.log')}")
            time.sleep(0.05)
        preloaded_server.extend([path, server])
    return [sys.executable, str(PRELOADED)]


def preloaded_executable() -> str:
    """preloaded_python() as one executable file, for a script that takes the path of its
    python (the Slurm templates' HPSFT_PYTHON): sys.executable when runs are cold."""
    python = preloaded_python()
    if len(python) == 1:
        return python[0]
    wrapper = Path(preloaded_server[0]).with_name("python")
    if not wrapper.exists():
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.join(python)} "$@"\n')
        wrapper.chmod(0o755)
    return str(wrapper)


def cli_command(module: str | None, args: list[str], nproc: int = 1, script: str | None = None,
                launcher: str = "torchrun", preloaded: bool = True) -> list[str]:
    """`python -m module args` (or a script): one plain process, or `nproc` ranks under
    torchrun or the deepspeed launcher. Each of those processes starts preloaded
    (tests/preloaded.py) unless `preloaded` is False: a cold `python`, for the tests that find
    a run's processes by their /proc environment."""
    target = [script] if script else ["-m", module]
    python = preloaded_python() if preloaded else [sys.executable]
    client = python[1:]  # [tests/preloaded.py] or []
    if nproc == 1:
        return [*python, *target, *args]
    if launcher == "torchrun":
        # Preloaded, torchrun's script is the client and `-m module` (or the script) its arguments.
        # torchrun itself stays cold: forked, its agent once SIGTERMed a rank still saving a
        # preempted step's checkpoint before it ignored signals (a window closed since: ranks
        # ignore them from the agreement to stop on, hpsft/trainer/preemption.py).
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                *client, *target, *args]
    if launcher == "deepspeed":
        from hpsft.utils.distributed import free_port

        ds_target = [*client, *target] if client else [script] if script else ["--module", module]
        return [str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={nproc}", f"--master_port={free_port()}",
                *ds_target, *args]
    raise ValueError(launcher)


def run_cli(module: str | None, args: list[str], nproc: int = 1, timeout: int = 600, script: str | None = None,
            launcher: str = "torchrun", env: dict | None = None, preloaded: bool = True):
    """Run the CLI (see cli_command) in fresh processes to the end; `env` adds variables."""
    return subprocess.run(cli_command(module, args, nproc, script, launcher, preloaded), cwd=REPO,
                          env={**train_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def train_steps(run_dir) -> dict[int, dict]:
    """step -> its training metrics (a step re-run after a restart: its last record)."""
    return {m["step"]: m for m in read_metrics(run_dir) if "train/loss" in m}


# What two runs of the same steps must agree on. The loss alone is not enough: with clipping
# binding (grad_clip=1.0 against norms of ~28 on the test model) and Adam nearly invariant to a
# constant gradient scale, a wrong token count on one path leaves losses and weights equal to
# 1e-7; the unclipped norm (train/grad_norm) moves with it.
STEP_VALUES = ("train/loss", "train/grad_norm")
STEP_COUNTS = ("train/tokens", "train/loss_tokens")


def assert_same_steps(ours: dict[int, dict], reference: dict[int, dict], steps, rtol: float) -> None:
    """Each of `steps` (train_steps records) of both runs: the same samples (token and loss-token
    counts, equal) and loss and unclipped gradient norm within `rtol` relative. Prints the
    largest difference of each value."""
    steps = list(steps)
    assert set(steps) <= ours.keys() and set(steps) <= reference.keys(), (sorted(ours), sorted(reference), steps)
    for step in steps:
        for key in STEP_COUNTS:
            assert ours[step][key] == reference[step][key], (step, key, ours[step][key], reference[step][key])
    errors = {(key, step): rel_diff(ours[step][key], reference[step][key]) for key in STEP_VALUES for step in steps}
    print("; ".join(f"{key} worst rel diff {max(errors[key, s] for s in steps):.1e}" for key in STEP_VALUES))
    bad = {f"{key} step {step}": (ours[step][key], reference[step][key])
           for (key, step), error in errors.items() if error > rtol}
    assert not bad, f"beyond rtol {rtol:.0e} (ours, reference): {bad}"


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
