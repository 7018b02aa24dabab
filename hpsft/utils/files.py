"""Files hpsft writes and reads back, none of which can become a way in:
- a path built from a name that comes from a config or from a file (a checkpoint's `latest`
  marker, its manifest) stays inside the folder it names a file of, whatever the name holds;
- a state file hpsft wrote loads as plain data (tensors, numbers, strings and containers of
  them: `torch.load(weights_only=True)`), so a planted pickle cannot run code;
- what hpsft creates follows the user's umask;
- a file is replaced atomically (written beside it, then renamed), so a crash never leaves a
  partial file under its name; durably (synced to disk before the rename is) where a
  checkpoint's integrity rests on it.
"""

import hashlib
import json
import os
import pickle
import re
import tempfile
from pathlib import Path

import torch

from hpsft.utils.errors import UserInputError


def file_identity(path: Path) -> tuple[str, int, int]:
    """What tells a file's content changed without reading it: its resolved path, size and
    modification time (ns). The data stage keys its stores by this for the data files and checks
    it for each image a shard read (hpsft/data/preparation.py)."""
    stat = Path(path).stat()
    return str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns


def path_inside(root: Path, name: str, what: str) -> Path:
    """`root / name` for a relative `name` without `..`, which stays inside `root` once
    symbolic links are resolved; else an error naming `what` (the key or file it came from)."""
    relative = Path(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        raise UserInputError(f"{what}: {name!r} must be a relative path inside {root} (no '..', not absolute)")
    path = root / relative
    if not path.resolve().is_relative_to(root.resolve()):
        raise UserInputError(f"{what}: {name!r} leads outside {root} (through a symbolic link)")
    return path


def umask() -> int:
    """The process's umask, read from /proc where the kernel shows it: os.umask can only read
    it by setting it, which would race with files other threads create meanwhile."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def umask_mode(mode: int = 0o666) -> int:
    """`mode` as open()/mkdir() would create it under the user's umask: for files made by
    mkstemp/mkdtemp, which use 0600/0700 whatever the umask."""
    return mode & ~umask()


def file_beside(path: Path, prefix: str | None = None) -> Path:
    """A new empty file in `path`'s folder (named `prefix` + random; default `.<name>.`), in the
    user's umask mode (mkstemp's 0600 would ignore it): written, then os.replace'd into `path`,
    so a crash never leaves a partial file under `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}." if prefix is None else prefix, dir=path.parent)
    os.fchmod(fd, umask_mode())
    os.close(fd)
    return Path(tmp)


def load_plain_data(path: Path):
    """A file hpsft wrote with torch.save: tensors and plain containers, never unpickled objects."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f"the Python object {found.group(1)}" if found else "Python objects"
        raise UserInputError(
            f"{path} asks to load {what}, which the files hpsft writes never hold: it was not written by this "
            "hpsft (or was tampered with) and is not loaded; remove it, or resume from a checkpoint whose "
            "origin you trust (docs/security.md)"
        ) from None


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's (its entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write, durable: bool = False) -> None:
    """`write(tmp_path)` then rename into `path`: a crash leaves no partial file under `path`.
    `durable`: the file and the rename are on disk before this returns (the file synced before
    the rename, so no crash can show `path` with contents missing)."""
    tmp = file_beside(path)
    try:
        write(tmp)
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


def write_durably(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically, on disk before this returns."""
    write_atomically(path, lambda tmp: tmp.write_text(text), durable=True)


def write_json_atomically(path: Path, value: dict) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(value, indent=1) + "\n"))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
