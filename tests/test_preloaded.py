"""The preloading server's client (tests/preloaded.py) behaves as `python` would: the tests'
CLI runs start through it, so what they see of a process must be what a cold start shows."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_command, preloaded_python, train_env
from tests.preloaded import SOCKET_ENV

pytestmark = pytest.mark.skipif(os.environ.get("HPSFT_TEST_PRELOADED") == "0",
                                reason="HPSFT_TEST_PRELOADED=0: every run starts cold")

PROBE = """
import os, signal, sys, time
mode = sys.argv[1]
print("preloaded", "torch" in sys.modules, "argv", sys.argv[1:], "cwd", os.getcwd(), "umask", oct(os.umask(0)),
      "mark", os.environ.get("PROBE_MARK"), "stdin", sys.stdin.readline().strip(), flush=True)
print("on stderr", file=sys.stderr, flush=True)
open(sys.argv[2], "w").write(str(os.getpid()))
if mode == "exit":
    sys.exit(int(sys.argv[3]))
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
if mode == "ignore":  # as a preempted rank that has saved: SIGTERM ignored on its way out with 75
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(0.5)
    sys.exit(75)
if mode == "raise":
    raise ValueError("from the probe")
if mode == "selfkill":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def probe(tmp_path: Path, *args: str, stdin: str = "", umask: int = 0o027):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    pid_file = tmp_path / "pid"
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    proc = subprocess.Popen([*preloaded_python(), str(script), args[0], str(pid_file), *args[1:]], cwd=cwd,
                            env={**train_env(), "PROBE_MARK": "m42"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, umask=umask)
    proc.stdin.write(stdin + "\n")
    proc.stdin.flush()
    return proc, pid_file


def run_pid(pid_file: Path, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the probe did not start"
        time.sleep(0.05)
    return int(pid_file.read_text())


def test_a_run_gets_the_clients_argv_cwd_umask_environment_and_streams(tmp_path):
    """Preloaded (torch imported before the script's first line: a cold python has not), with
    the client's argv, cwd, umask, environment, stdin, stdout and stderr, in a process of its
    own, and its exit code is the client's."""
    proc, pid_file = probe(tmp_path, "exit", "7", stdin="hello")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    assert out.split() == ["preloaded", "True", "argv", f"['exit',", f"'{pid_file}',", "'7']", "cwd",
                           str(tmp_path / "cwd"), "umask", "0o27", "mark", "m42", "stdin", "hello"], out
    assert err == "on stderr\n"
    assert run_pid(pid_file) != proc.pid


def test_signals_reach_the_run_and_the_client_ends_as_the_run_did(tmp_path):
    """A SIGTERM to the client (as torchrun sends one) reaches the run, whose exit code (75) is
    the client's; a run killed by a signal leaves the client killed by the same one; an
    uncaught exception prints the run's own traceback (no frame of the server's) and exits 1."""
    proc, pid_file = probe(tmp_path, "term")
    run_pid(pid_file)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 75

    pid_file.unlink()
    proc, pid_file = probe(tmp_path, "selfkill")
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    pid_file.unlink()
    proc, pid_file = probe(tmp_path, "raise")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    frames = [line for line in err.splitlines() if line.startswith('  File "')]
    assert len(frames) == 1 and "probe.py" in frames[0] and "ValueError: from the probe" in err, err


def test_a_signal_while_the_run_ends_leaves_the_client_ending_as_the_run(tmp_path):
    """The run ignores SIGTERM and exits 75 while the client gets a SIGTERM every millisecond
    (torchrun's SIGTERM to a rank already leaving): the client exits 75, 10 times of 10.
    Planted: the client's forwarding handlers left in place once the run had ended
    (tests/preloaded.py before 2026-12-03; Python puts them back to the default action as it
    finalizes): the client died of SIGTERM, the test failed. That was the -15 of the loop's
    torchrun-0-committed and torchrun-1-written rounds (scripts/repeat_tests.sh, docs/testing.md)."""
    for _ in range(10):
        proc, pid_file = probe(tmp_path, "ignore")
        run_pid(pid_file)
        time.sleep(0.1)  # the client forwards from the moment it has the run's pid, long before
        while proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.001)
        proc.communicate(timeout=60)
        assert proc.returncode == 75
        pid_file.unlink()


def test_a_client_killed_outright_takes_its_run_with_it(tmp_path):
    """SIGKILL cannot be forwarded: the client's socket closes and the run's process group is
    killed (a test's timeout, or torchrun's kill, leaves no run behind)."""
    proc, pid_file = probe(tmp_path, "sleep")
    pid = run_pid(pid_file)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text():
        assert time.monotonic() < deadline, f"run {pid} outlived its client"
        time.sleep(0.05)


def test_without_a_server_the_client_is_a_cold_python(tmp_path):
    """No socket in the environment: the client execs python itself (same pid, nothing
    preloaded)."""
    env = {key: value for key, value in train_env().items() if key != SOCKET_ENV}
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cold = subprocess.run([*preloaded_python(), str(script), "exit", str(tmp_path / "cold_pid"), "3"], cwd=tmp_path,
                          env=env, input="x\n", capture_output=True, text=True, timeout=60)
    assert cold.returncode == 3 and cold.stdout.startswith("preloaded False"), cold.stdout + cold.stderr


def test_cli_commands_start_through_the_client_unless_asked_not_to():
    """torchrun's script is the client (so each rank starts preloaded), the module its argument."""
    client = str(REPO / "tests" / "preloaded.py")
    assert cli_command("hpsft.train", ["a=1"]) == [sys.executable, client, "-m", "hpsft.train", "a=1"]
    assert cli_command("hpsft.train", ["a=1"], nproc=2)[-4:] == [client, "-m", "hpsft.train", "a=1"]
    assert cli_command("hpsft.train", ["a=1"], preloaded=False) == [sys.executable, "-m", "hpsft.train", "a=1"]


def test_the_deepspeed_launchers_local_rank_reaches_the_script_as_its_first_argument(tmp_path):
    """The deepspeed launcher runs `python -u SCRIPT --local_rank=N ARGS`; with the client as
    SCRIPT the run's script must still see `--local_rank=N` first, as under a cold python."""
    script = tmp_path / "argv.py"
    script.write_text("import sys; print(sys.argv[1:])")
    proc = subprocess.run([*preloaded_python(), "--local_rank=1", str(script), "a=1"], env=train_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "['--local_rank=1', 'a=1']\n", proc.stdout + proc.stderr
