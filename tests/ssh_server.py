"""A private sshd on 127.0.0.1 for launcher tests (fixture `ssh_server`): the deepspeed
launcher's pdsh runner reaches "other nodes" over ssh, and here the other node is this one.

Everything lives in one temp dir: a host key, a client key that only this server's
AuthorizedKeysFile accepts, the config and the pid file. The server runs as the test's
user and accepts keys only. A system sshd, ~/.ssh and known_hosts are never read or
written: clients pass `client_options()` (identity file, no host-key recording). Missing
binaries skip the tests: install them with `.ci/install_system_packages.sh`.
"""

import getpass
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.slurm_cluster import free_port

BINARIES = ("sshd", "ssh", "ssh-keygen", "pdsh")
# sshd refuses to start without its privilege separation directory (Debian: /run/sshd).
PRIVSEP_DIR = Path("/run/sshd")


def missing_binaries() -> list[str]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


class SshServer:
    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.client_key = root / "client_key"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        host_key = self.root / "host_key"
        for key in (host_key, self.client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        (self.root / "authorized_keys").write_text(Path(f"{self.client_key}.pub").read_text())
        config = self.root / "sshd_config"
        config.write_text(
            f"ListenAddress 127.0.0.1\nPort {self.port}\nHostKey {host_key}\n"
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}\nPidFile {self.root / 'sshd.pid'}\n"
            f"AllowUsers {getpass.getuser()}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nPermitRootLogin prohibit-password\nStrictModes no\n"
        )
        sshd = shutil.which("sshd", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.root / "sshd.log", "w"), start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()[-2000:]}")
            if self.run("true").returncode == 0:
                return
            time.sleep(0.3)
        raise RuntimeError(f"sshd did not accept a login in 20 s: {(self.root / 'sshd.log').read_text()[-2000:]}")

    def client_options(self) -> list[str]:
        return ["-i", str(self.client_key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]

    def run(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", "-p", str(self.port), *self.client_options(), "127.0.0.1", command],
                              capture_output=True, text=True, timeout=30)

    def stop(self) -> None:
        """Ends the server and everything started through it (each connection's process
        runs in a session of its own, so the listener's process group does not hold it)."""
        if self.proc is not None and self.proc.poll() is None:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def ssh_server():
    missing = missing_binaries()
    if missing:
        pytest.skip(f"ssh/pdsh binaries not installed ({', '.join(missing)}): run .ci/install_system_packages.sh")
    if not PRIVSEP_DIR.is_dir():
        try:
            PRIVSEP_DIR.mkdir(mode=0o755)
        except PermissionError:
            pytest.skip(f"sshd needs {PRIVSEP_DIR}, which this user cannot create")
    root = Path(tempfile.mkdtemp(prefix="hpsft-sshd-"))
    root.chmod(0o700)
    server = SshServer(root)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
