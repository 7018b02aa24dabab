"""Start the CLI's processes in tests without paying their imports each time.

Each `python -m hpsft.train` spends ~10 CPU s importing torch, torch._dynamo (pulled in by
transformers and tensordict), DeepSpeed and transformers before it reads its config: on the
2-core test machine that was most of a tiny run's cost, and the suite starts hundreds of them.
So the test session starts one *preloading server* that imports all that once, and a test's
command line runs

    python tests/preloaded.py -m hpsft.train ARGS...     (or: tests/preloaded.py SCRIPT ARGS...)

instead of `python -m hpsft.train ARGS...`. That *client* imports nothing heavy: it sends its
argv, cwd, environment and its stdin/stdout/stderr (as file descriptors) to the server and
waits. The server forks a *waiter*, which forks the *run*: the run takes the client's
descriptors as 0/1/2, its cwd, umask, environment and argv, reseeds `random`, sets torch's thread
count from OMP_NUM_THREADS (libgomp read it when the server loaded), and runs the module as
`__main__` the way `python -m` does. The waiter reports the run's pid and exit status; the
client forwards the signals it gets (torchrun's SIGTERM, a test's SIGUSR1...) to the run and
ends as the run ended (its exit code, or killed by the same signal), whatever it gets after
that. A client killed outright (SIGKILL) closes its socket, and the waiter then kills the
run's process group.

So launchers are unchanged: torchrun, the deepspeed launcher and Ray start the client as they
would start python, and the run is the real CLI, in a fresh process of its own, with real
DeepSpeed and gloo. What differs from a cold start: the imports are the server's (done with
the session's environment: variables a library reads at import time are the server's), and
/proc/<run>/environ shows the server's environment (the run's own is set with os.environ):
tests that find processes by an environment marker start them cold (`preloaded=False` in
tests.conftest.cli_command). Without HPSFT_TEST_PRELOADED_SOCKET, or with no server
listening, the client execs `python ARGS...`: a cold start, the same run.

`python tests/preloaded.py --serve SOCKET` runs a server (tests.conftest starts one per
pytest process).
"""

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "HPSFT_TEST_PRELOADED_SOCKET"
# What every CLI run imports anyway; the entry modules themselves (hpsft.train...) are not
# preloaded: runpy would warn that the module it runs as __main__ was imported already.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "deepspeed", "transformers", "tensordict",
           "transformers.models.llama.modeling_llama", "hpsft.trainer", "hpsft.workers",
           # what a 2-step run imported beyond those (-X importtime): ~1.9 s
           "pandas", "pyarrow.parquet", "importlib.metadata", "torch.utils.tensorboard")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGALRM)


def send_message(conn: socket.socket, message: dict, fds: tuple = ()) -> None:
    data = json.dumps(message).encode()
    payload = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(conn, [payload], list(fds))
    else:
        conn.sendall(payload)


def receive_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("connection closed")
        data += chunk
    return data


def receive_message(conn: socket.socket) -> dict:
    (size,) = struct.unpack("!I", receive_exact(conn, 4))
    return json.loads(receive_exact(conn, size))


# -- client --------------------------------------------------------------------------------

def run_client(args: list[str]) -> None:
    """Have the server run `python ARGS` and end as that run ends."""
    args = after_the_target(args)
    path = os.environ.get(SOCKET_ENV)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not path or (args[0].startswith("-") and args[0] != "-m"):  # -c, -u...: python's own
            raise OSError("not for the server")
        conn.connect(path)
        umask = os.umask(0)
        os.umask(umask)
        request = {"args": args, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask}
        # The fds travel with the first bytes of the request (SCM_RIGHTS).
        send_message(conn, request, fds=(0, 1, 2))
        run_pid = receive_message(conn)["pid"]
    except (OSError, EOFError):
        conn.close()
        os.execv(sys.executable, [sys.executable, *args])  # cold start: the same run

    def forward(received, _frame):
        try:
            os.kill(run_pid, received)
        except ProcessLookupError:  # the run has just ended: its status is on its way
            pass

    for number in FORWARDED_SIGNALS:
        signal.signal(number, forward)
    try:  # a forwarded signal does not interrupt this wait (PEP 475: recv resumes)
        status = receive_message(conn)["status"]
    except EOFError:  # the server died under the run: nothing to report
        sys.exit(1)
    # The run has ended, and a signal now (torchrun's SIGTERM to a rank already leaving) must
    # not change how the client ends, as it cannot change an exited python's. Left to Python,
    # the handlers above would go back to the default action as the interpreter finalizes.
    for number in FORWARDED_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    sys.exit(os.waitstatus_to_exitcode(status))


def after_the_target(args: list[str]) -> list[str]:
    """The deepspeed launcher runs `python -u SCRIPT --local_rank=N ARGS`: with this file as
    SCRIPT, its --local_rank comes first; put it where the CLI's script or module sees it."""
    ranks = [arg for arg in args if arg.startswith(("--local_rank=", "--local-rank="))]
    rest = [arg for arg in args if arg not in ranks]
    cut = 2 if rest[:1] == ["-m"] else 1
    return rest[:cut] + ranks + rest[cut:] if ranks and args[0] in ranks else args


# -- server --------------------------------------------------------------------------------

def serve(path: str) -> None:
    """Listen first (a client that comes early waits in the backlog), import, then fork a
    waiter per request. The server ends with the pytest process that started it."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: end with the parent
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    while True:
        conn, _ = listener.accept()
        payload, fds, _flags, _addr = socket.recv_fds(conn, 4 + (1 << 20), 3)
        (size,) = struct.unpack("!I", payload[:4])
        data = payload[4:] + receive_exact(conn, size - len(payload) + 4)
        if os.fork() == 0:
            listener.close()
            wait_for_run(conn, json.loads(data), fds)  # never returns
        conn.close()
        for fd in fds:
            os.close(fd)


def wait_for_run(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the waiter: fork the run, report its pid, then its exit status; kill its process
    group if the client goes away first."""
    import select

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        start_run(request, fds)  # never returns
    for fd in fds:
        os.close(fd)  # the run's pipes reach EOF when the run (and its children) end
    send_message(conn, {"pid": pid})
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(conn, select.POLLIN | select.POLLHUP)
    while True:
        ready = dict(poller.poll())
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            try:
                send_message(conn, {"status": status})
            except OSError:
                pass
            os._exit(0)
        if conn.fileno() in ready:  # EOF: the client was killed
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            os._exit(0)


def start_run(request: dict, fds: list[int]) -> None:
    """In the run: become `python ARGS` (ARGS: `-m MODULE ...` or `SCRIPT ...`) and exit."""
    import random
    import runpy
    import threading

    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(1, entry)
    args = request["args"]
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            sys.modules.pop(args[1], None)  # imported by a preloaded module: run it anew, as python -m would
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # what the interpreter does with an uncaught exception
        trimmed = traceback_of_run(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(trimmed), trimmed)
        code = 1
        if isinstance(error, KeyboardInterrupt):  # python then ends by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    # The interpreter's own ending, without unwinding into the server's loop: join the
    # non-daemon threads, run the atexit handlers, flush.
    threading._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def traceback_of_run(tb):
    """The traceback from the run's own first frame on (not this file's, nor runpy's), as a
    cold `python` prints it."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        run_client(sys.argv[1:])
