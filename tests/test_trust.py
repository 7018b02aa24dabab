"""Trust boundaries (docs/security.md): no foreign code runs, no secret is written, no path
leaves its folder, unless the user asked. (Remote model code: tests/test_cli_errors.py.)

One real training run (umask 027, a W&B key in its environment, a password in a config
value) serves the checks of what a run writes and of its sockets; a planted pickle is then
resumed from. Torchrun and local Ray runs, finished and failed, are watched for the sockets
they open: every process carrying the test's mark in its environment is inspected with psutil.
"""

import builtins
import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hpsft.config import load_config, to_yaml
from hpsft.config.secrets import MASK, mask_secrets
from hpsft.utils.errors import UserInputError
from hpsft.utils.files import path_inside
from hpsft.trainer.checkpoint import TRAINER_STATE, CheckpointManager, manifest_problem
from tests.conftest import REPO, base_overrides, cli_command, run_cli, train_env, write_parquet

WANDB_KEY = "wandb-key-4f0c1d9e8b7a6c5d"
URL_PASSWORD = "pw-93b1e7a2c6d4"
RUN_UMASK = 0o027


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("hpsft: error:")]


class CreateMarker:
    """A pickle payload: unpickling it calls open(marker, "w"), creating the file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_chat_model, chat_rows):
    """A one-step run with every logger and the HF export, as a user with umask 027 whose
    environment holds a W&B key and whose config holds a password in ray.address (a URL
    the SPMD path ignores but config.yaml records); its listening sockets are watched."""
    root = tmp_path_factory.mktemp("trust")
    train = write_parquet([{"messages": c} for c in chat_rows[:8]], root / "train.parquet")
    val = write_parquet([{"messages": c} for c in chat_rows[8:12]], root / "val.parquet")
    out = root / "run"
    overrides = base_overrides(tiny_chat_model, train, val, out, **{
        "trainer.total_steps": 1, "trainer.loggers": "[console,jsonl,tensorboard]",
        "ray.address": f"ray://hpsft:{URL_PASSWORD}@127.0.0.1:10001",
    })
    run = run_watching_sockets(cli_command("hpsft.train", overrides, preloaded=False), root,
                               {"WANDB_API_KEY": WANDB_KEY}, RUN_UMASK)
    assert run.proc.returncode == 0, run.proc.stderr[-5000:]
    return {"out": out, "proc": run.proc, "overrides": overrides, "sockets": run}


def test_no_secret_reaches_the_run_dir_or_the_output(trained_run):
    out, proc = trained_run["out"], trained_run["proc"]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.parent.name == "tensorboard" for p in files) and any("global_step_1" in p.parts for p in files)
    for secret in (WANDB_KEY, URL_PASSWORD):
        leaks = [p for p in files if secret.encode() in p.read_bytes()]
        assert not leaks, f"{secret} written to {leaks}"
        assert secret not in proc.stdout + proc.stderr
    assert f"ray://hpsft:{MASK}@127.0.0.1:10001" in (out / "config.yaml").read_text()


def test_run_dir_follows_the_umask(trained_run):
    too_open = {str(p): oct(p.stat().st_mode & 0o777) for p in [trained_run["out"], *trained_run["out"].rglob("*")]
                if p.stat().st_mode & RUN_UMASK}
    assert not too_open, f"more permissive than umask {oct(RUN_UMASK)}: {too_open}"


def test_a_planted_pickle_state_file_is_never_unpickled(trained_run, tmp_path):
    """An attacker who can write a checkpoint replaces hpsft's trainer state with a pickle
    that creates a marker file, and fixes the manifest so the checkpoint looks intact."""
    run = tmp_path / "run"
    shutil.copytree(trained_run["out"], run)
    checkpoint = run / "checkpoints" / "global_step_1"
    planted = checkpoint / TRAINER_STATE
    marker = tmp_path / "payload-ran"
    torch.save({"global_step": 1, "rng": CreateMarker(marker)}, planted)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][planted.name] = {"size": planted.stat().st_size,
                                       "sha256": hashlib.sha256(planted.read_bytes()).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    assert manifest_problem(checkpoint) is None

    overrides = [o for o in trained_run["overrides"]
                 if not o.startswith(("trainer.output_dir=", "trainer.total_steps="))]
    proc = run_cli("hpsft.train", overrides + [f"trainer.output_dir={run}", "trainer.total_steps=2"], timeout=600)
    assert proc.returncode == 2, proc.stderr[-5000:]
    assert not marker.exists()
    assert error_lines(proc) == [proc.stderr.strip().splitlines()[-1]], proc.stderr[-3000:]
    assert str(planted) in error_lines(proc)[0] and "io.open" in error_lines(proc)[0]
    assert "Traceback" not in proc.stderr

    # The payload is real: unpickling the file without weights_only runs it.
    torch.load(planted, weights_only=False)
    assert marker.exists()


def test_a_planted_pickle_in_the_token_cache_is_never_loaded(tmp_path, tokenizer):
    """The token store is Arrow files and JSON: nothing in it is unpickled. A shard file
    replaced by a pickle payload (its sidecar edited to match its size) is refused as damaged
    and prepared again; the payload never runs."""
    from hpsft.data.preparation import prepared_store
    from hpsft.data.rows import TokenizeOptions

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "Hi", "response": "Hello"}) + "\n")
    config = load_config(None, [f"data.train_files=[{data}]"])
    opts = TokenizeOptions.from_data_config(config.data)
    cache = tmp_path / "cache"
    expected = prepared_store(str(data), tokenizer, opts, cache)[0]["input_ids"]
    (store,) = [d for d in cache.iterdir() if (d / "store.json").is_file()]
    marker = tmp_path / "payload-ran"
    planted = store / "shard-00000.arrow"
    torch.save({"input_ids": CreateMarker(marker)}, planted)
    for name in ("shard-00000.json", "store.json"):
        record = json.loads((store / name).read_text())
        (record["shard_files"][0] if name == "store.json" else record)["file_bytes"] = planted.stat().st_size
        (store / name).write_text(json.dumps(record))
    again = prepared_store(str(data), tokenizer, opts, cache)
    assert not marker.exists()
    assert torch.equal(again[0]["input_ids"], expected)


# ---- chat templates ----------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("escape", [
    "{{ ().__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
])
def test_a_template_reaching_for_python_internals_is_refused(tmp_path, tokenizer, escape):
    from hpsft.data.chat_tokenize import tokenize_conversation

    marker = tmp_path / "payload-ran"
    template = escape.replace("MARKER", str(marker)) + CHATML
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(UserInputError, match="the chat template tried an operation its sandbox forbids"):
        tokenize_conversation(tokenizer, messages, None, template)
    assert not marker.exists()


def test_a_template_file_escaping_its_sandbox_stops_the_run_in_one_line(tmp_path, model_path, tiny_data):
    train, val = tiny_data
    marker = tmp_path / "payload-ran"
    template = tmp_path / "evil.jinja"
    template.write_text(f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}" + CHATML)
    out = tmp_path / "run"
    proc = run_cli("hpsft.train", base_overrides(model_path, train, val, out, **{
        "data.chat_template": str(template), "data.bad_rows": "skip"}), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc) == [proc.stderr.strip().splitlines()[-1]]
    assert "sandbox forbids" in error_lines(proc)[0] and "Traceback" not in proc.stderr
    assert not marker.exists() and not out.exists()


# ---- secrets in the config ---------------------------------------------------------------

def test_no_key_of_the_schema_is_masked_and_secret_like_keys_are():
    default = load_config()
    assert MASK not in to_yaml(default)
    masked = mask_secrets({
        "data": {"messages_key": "messages", "prompt_key": "p", "response_key": "r", "tools_key": "t",
                 "max_tokens_per_micro_batch": 512},
        "loss": {"token_accuracy": True},
        "tracking": {"wandb_api_key": "k1", "hf_token": "k2", "db_password": "k3", "client_secret": "k4",
                     "access_key": "k5", "keys": ["k6"], "project": "sft"},
        "ray": {"address": "https://user:k7@head:8265/path", "other": "https://user@head"},
    })
    assert masked == {
        "data": {"messages_key": "messages", "prompt_key": "p", "response_key": "r", "tools_key": "t",
                 "max_tokens_per_micro_batch": 512},
        "loss": {"token_accuracy": True},
        "tracking": {"wandb_api_key": MASK, "hf_token": MASK, "db_password": MASK, "client_secret": MASK,
                     "access_key": MASK, "keys": [MASK], "project": "sft"},
        "ray": {"address": f"https://user:{MASK}@head:8265/path", "other": "https://user@head"},
    }


# ---- paths from configs and files --------------------------------------------------------

@pytest.mark.parametrize("name", ["../global_step_3", "/tmp/global_step_3", "global_step_3/../../x", ""])
def test_path_inside_refuses_names_leaving_the_folder(tmp_path, name):
    with pytest.raises(UserInputError, match="must be a relative path inside"):
        path_inside(tmp_path, name, "trainer.resume")


def test_path_inside_refuses_a_symlink_out_of_the_folder(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "shard").symlink_to(tmp_path)
    assert path_inside(tmp_path / "root", "global_step_1/model.pt", "x") == tmp_path / "root" / "global_step_1/model.pt"
    with pytest.raises(UserInputError, match="leads outside"):
        path_inside(tmp_path / "root", "shard/secret", "manifest.json")


@pytest.mark.parametrize("name", ["../../elsewhere/global_step_1", "/tmp/global_step_1", "global_step_1/.."])
def test_a_latest_marker_naming_a_path_outside_checkpoints_is_refused(tmp_path, name):
    manager = CheckpointManager(tmp_path)
    manager.root.mkdir()
    (manager.root / "latest").write_text(name + "\n")
    with pytest.raises(UserInputError, match="which is not a global_step_<N> checkpoint"):
        manager.latest()


@pytest.mark.parametrize("name", ["../../outside.bin", "/etc/hostname"])
def test_a_manifest_naming_files_outside_its_checkpoint_makes_it_damaged(tmp_path, name):
    checkpoint = tmp_path / "checkpoints" / "global_step_1"
    checkpoint.mkdir(parents=True)
    (tmp_path / "outside.bin").write_bytes(b"x")
    (checkpoint / "manifest.json").write_text(json.dumps({"files": {name: {"size": 1}}}))
    assert "must be a relative path inside" in manifest_problem(checkpoint)
    with pytest.raises(UserInputError, match="the checkpoint is damaged"):
        CheckpointManager.resolve(checkpoint)


# ---- network -----------------------------------------------------------------------------

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
MARK = "HPSFT_TEST_SOCKET_WATCH"


def marked_processes(mark: str) -> list:
    """Every live process whose environment carries `mark`: those a test started and all
    their descendants, also the ones that left the process tree (Ray's daemons, orphans)."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARK) == mark and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def listening(processes) -> set[tuple[str, int, int]]:
    """(address, port, pid) of the TCP sockets `processes` listen on."""
    import psutil

    sockets = set()
    for process in processes:
        try:
            sockets |= {(c.laddr.ip, c.laddr.port, process.pid) for c in process.net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return sockets


@dataclass
class Watched:
    proc: subprocess.CompletedProcess
    pid: int  # of the command itself
    seen: set  # (address, port, pid) listened on while it ran, by it or any process it started
    left: set  # the same, 20 s after it ended


def run_watching_sockets(command: list[str], logs: Path, env: dict | None = None, umask: int = -1,
                         timeout: int = 600) -> Watched:
    """Run `command`, recording every TCP socket it or any process it started listens on."""
    import time
    import uuid

    mark = uuid.uuid4().hex
    with open(logs / "stdout", "w") as stdout, open(logs / "stderr", "w") as stderr:
        proc = subprocess.Popen(command, cwd=REPO, env={**train_env(), **(env or {}), MARK: mark},
                                stdout=stdout, stderr=stderr, text=True, umask=umask)
        seen, deadline = set(), time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= listening(marked_processes(mark))
            # Not 0.5 s: that once missed both ranks of the failed torchrun run (a poll costs ~3 ms)
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    left = marked_processes(mark)
    for _ in range(40):  # daemons notice their parent's exit within seconds
        if not left:
            break
        time.sleep(0.5)
        left = marked_processes(mark)
    still_listening = listening(left)
    for process in left:  # clean up after a failure of the test, then report it
        process.kill()
    result = subprocess.CompletedProcess(command, proc.returncode, (logs / "stdout").read_text(),
                                         (logs / "stderr").read_text())
    return Watched(result, proc.pid, seen, still_listening)


def not_loopback(sockets) -> set:
    return {s for s in sockets if s[0] not in LOOPBACK}


def test_a_run_without_launcher_listens_on_loopback_only_and_leaves_no_socket(trained_run):
    """Its rendezvous store and gloo's sockets: hpsft serves the store on MASTER_ADDR=127.0.0.1."""
    run = trained_run["sockets"]
    assert run.seen, "the watch saw no listening socket"
    assert not not_loopback(run.seen), f"listening beyond 127.0.0.1: {not_loopback(run.seen)}"
    assert not run.left, f"still listening after the run: {run.left}"


RAY_ENV = {"RAY_AUTH_MODE": "disabled"}
RAY_WORKERS = {"ray.n_workers_per_node": 2, "ray.cpus_per_worker": 0.5, "trainer.export_hf": "false"}


def test_local_ray_run_listens_on_loopback_only_and_leaves_no_socket(tmp_path, tiny_chat_model, tiny_data):
    pytest.importorskip("ray")
    train, val = tiny_data
    args = base_overrides(tiny_chat_model, train, val, tmp_path / "run", **{**RAY_WORKERS, "trainer.total_steps": 1})
    run = run_watching_sockets(cli_command("hpsft.train_ray", args, preloaded=False), tmp_path, RAY_ENV)
    assert run.proc.returncode == 0, run.proc.stderr[-5000:]
    # Driver, GCS, raylet, workers: a new instance of the run's own (not a cluster found on the machine).
    assert len({pid for _, _, pid in run.seen}) >= 4, run.seen
    assert not not_loopback(run.seen), f"listening beyond 127.0.0.1: {not_loopback(run.seen)}"
    assert not run.left, f"still listening after the run: {run.left}"


def test_local_ray_run_that_fails_leaves_no_socket(tmp_path, tiny_chat_model, tiny_data):
    """The resume path is checked after the worker group is up: its actors, the rendezvous
    and Ray's daemons all exist when the run fails."""
    pytest.importorskip("ray")
    train, val = tiny_data
    args = base_overrides(tiny_chat_model, train, val, tmp_path / "run",
                          **{**RAY_WORKERS, "trainer.resume": tmp_path / "none"})
    run = run_watching_sockets(cli_command("hpsft.train_ray", args, preloaded=False), tmp_path, RAY_ENV)
    assert run.proc.returncode == 2 and "neither a global_step_<N> folder nor a run" in run.proc.stderr, \
        run.proc.stderr[-5000:]
    assert not not_loopback(run.seen), f"listening beyond 127.0.0.1: {not_loopback(run.seen)}"
    assert not run.left, f"still listening after the run: {run.left}"


@pytest.mark.parametrize("outcome", ["finished", "failed"])
def test_torchrun_run_leaves_no_socket(tmp_path, tiny_chat_model, tiny_data, outcome):
    """Only torchrun's own rendezvous store listens beyond loopback (on every interface:
    torch's choice, which other nodes need). A failed run: rank 0 meets a bad row after
    the process group is up, and both ranks stop."""
    train, val = tiny_data
    if outcome == "failed":
        train = str(Path(train).with_suffix(".jsonl"))
        Path(train).write_text(json.dumps({"messages": [{"role": "robot", "content": "beep"}]}) + "\n")
    args = base_overrides(tiny_chat_model, train, val, tmp_path / "run", **{"trainer.total_steps": 1,
                                                                            "trainer.export_hf": "false"})
    run = run_watching_sockets(cli_command("hpsft.train", args, nproc=2, preloaded=False), tmp_path)
    assert run.proc.returncode == (0 if outcome == "finished" else 1), run.proc.stderr[-5000:]
    assert len({pid for _, _, pid in run.seen}) >= 2, run.seen  # the launcher and the ranks: the watch saw them
    assert {pid for _, _, pid in not_loopback(run.seen)} <= {run.pid}, run.seen
    assert not run.left, f"still listening after the run: {run.left}"
