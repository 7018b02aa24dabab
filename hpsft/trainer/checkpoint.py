"""Checkpoint directories that a crash mid-save cannot corrupt, and that a damaged disk
cannot make a resume trust.

Layout under <output_dir>/checkpoints/:
    global_step_<N>/      engine shards (DeepSpeed) + trainer_state.pt (step, data position
                          in samples, RNG; the same for any dp size)
                          + run_fingerprint.json (what defines the run: fingerprint.py)
                          + manifest.json (every file's size; sha256 of hpsft's own files)
    latest                the name of the newest complete checkpoint, replaced atomically

A save goes to `global_step_<N>.partial/`; once every rank has written its part, rank 0
writes the manifest, syncs everything to disk, renames the folder, and only then moves
`latest`: an interrupted save leaves the previous checkpoint as the one a resume picks up.
On resume, a checkpoint whose files do not match its manifest is reported and the
previous intact one is used.

hpsft's own state files load as plain data (`torch.load(weights_only=True)`: tensors, numbers,
strings and containers of them), so a planted file cannot run code through them; DeepSpeed's
shards are unpickled by DeepSpeed, which is why a checkpoint is code (docs/security.md).
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from hpsft.utils.errors import UserInputError
from hpsft.utils.files import fsync_path, load_plain_data, path_inside, sha256, write_durably

STEP_PREFIX = "global_step_"
PARTIAL_SUFFIX = ".partial"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
RUN_FINGERPRINT = "run_fingerprint.json"


def warn(message: str) -> None:
    print(f"hpsft: warning: {message}", file=sys.stderr, flush=True)


def write_manifest(folder: Path) -> None:
    """Sizes of every file in `folder` and checksums of hpsft's own state files (DeepSpeed's
    shards are large: their size catches a truncated write), each file synced to disk first."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fsync_path(path)
        entry = {"size": path.stat().st_size}
        if path.name in (TRAINER_STATE, RUN_FINGERPRINT):
            entry["sha256"] = sha256(path)
        files[path.relative_to(folder).as_posix()] = entry
    write_durably(folder / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")


def manifest_problem(folder: Path) -> str | None:
    """What is wrong with a committed checkpoint, or None when its files match its manifest."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (an interrupted save, or written by an hpsft without manifests)"
    except (ValueError, KeyError):
        return f"{MANIFEST} is unreadable"
    for name, entry in files.items():
        try:
            path = path_inside(folder, name, MANIFEST)
        except UserInputError as err:
            return str(err)
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry['size']}"
        if "sha256" in entry and sha256(path) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def step_of(name: str) -> int | None:
    """N for a committed `global_step_<N>` folder name, else None."""
    number = name.removeprefix(STEP_PREFIX)
    return int(number) if name.startswith(STEP_PREFIX) and number.isdigit() else None


class CheckpointManager:
    def __init__(self, output_dir: str | Path):
        self.root = Path(output_dir) / "checkpoints"

    @staticmethod
    def tag(step: int) -> str:
        return f"{STEP_PREFIX}{step}"

    def partial_tag(self, step: int) -> str:
        return self.tag(step) + PARTIAL_SUFFIX

    def save_trainer_state(self, step: int, state: dict) -> None:
        """Rank 0 (or the Ray driver): plain containers, numbers, strings and tensors only."""
        path = self.root / self.partial_tag(step) / TRAINER_STATE
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)

    def save_run_fingerprint(self, step: int, fingerprint: dict) -> None:
        """Rank 0, before the commit (the manifest then covers it)."""
        path = self.root / self.partial_tag(step) / RUN_FINGERPRINT
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fingerprint, indent=1) + "\n")

    @staticmethod
    def load_run_fingerprint(checkpoint: Path) -> dict | None:
        """The fingerprint a checkpoint recorded; None for one written before fingerprints existed."""
        path = checkpoint / RUN_FINGERPRINT
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            raise UserInputError(f"{path} is not valid JSON: the checkpoint is damaged") from None

    def commit(self, step: int) -> Path:
        """Rank 0, after every rank finished writing: publish the checkpoint."""
        partial, final = self.root / self.partial_tag(step), self.root / self.tag(step)
        write_manifest(partial)
        fsync_path(partial)
        if final.exists():  # a re-save of the same step (e.g. the end of a resumed run)
            shutil.rmtree(final)
        os.replace(partial, final)
        fsync_path(self.root)
        write_durably(self.root / "latest", self.tag(step) + "\n")
        return final

    def committed(self) -> list[tuple[int, Path]]:
        """(step, folder) of every committed checkpoint, newest first (manifests unchecked)."""
        if not self.root.is_dir():
            return []
        found = [(step_of(p.name), p) for p in self.root.iterdir() if p.is_dir()]
        return sorted(((step, p) for step, p in found if step is not None), reverse=True)

    def prune(self, keep_last: int, current_step: int) -> None:
        """Rank 0, after a commit: remove crashed saves' `.partial` folders and, when
        `keep_last` > 0, the checkpoints before the newest `keep_last` up to `current_step`
        (just committed and verified by its manifest, so never removed). Later steps, left by
        a run this one went back on with trainer.resume=<path>, are not touched."""
        for path in self.root.glob(f"{STEP_PREFIX}*{PARTIAL_SUFFIX}"):
            shutil.rmtree(path)
        if keep_last:
            older = [p for step, p in self.committed() if step <= current_step][keep_last:]
            for path in older:
                shutil.rmtree(path)

    def latest(self) -> Path | None:
        """The checkpoint a resume should load: the one `latest` names, or, when it is
        missing or damaged, the newest intact one before it (each skip reported)."""
        marker = self.root / "latest"
        if not marker.is_file():
            return None
        name = marker.read_text().strip()
        newest = step_of(name)
        if newest is None:
            raise UserInputError(f"{marker} names {name!r}, which is not a {STEP_PREFIX}<N> checkpoint")
        if not (self.root / name).is_dir():
            warn(f"{marker} names {name}, which does not exist: looking for an earlier checkpoint")
        for step, path in self.committed():
            if step > newest:
                continue
            problem = manifest_problem(path)
            if problem is None:
                return path
            warn(f"checkpoint {path} is damaged ({problem}): skipped, trying an earlier one")
        raise UserInputError(
            f"no intact checkpoint up to {name} in {self.root}: resume from another run with "
            "trainer.resume=<checkpoint>, or start over with trainer.resume=disable trainer.overwrite_output_dir=true"
        )

    @staticmethod
    def resolve(path: str | Path) -> Path:
        """A checkpoint given by the user: a global_step_<N> folder or a run's output_dir."""
        path = Path(path)
        if path.name.startswith(STEP_PREFIX) and path.is_dir():
            problem = manifest_problem(path)
            if problem is not None:
                raise UserInputError(f"trainer.resume={path}: the checkpoint is damaged ({problem}); "
                                     "give an earlier one, or the run's output_dir to pick the newest intact one")
            return path
        latest = CheckpointManager(path).latest()
        if latest is None:
            raise UserInputError(f"trainer.resume={path}: neither a {STEP_PREFIX}<N> folder nor a run with checkpoints")
        return latest

    @staticmethod
    def load_trainer_state(checkpoint: Path) -> dict:
        path = checkpoint / TRAINER_STATE
        if not path.is_file():
            raise UserInputError(
                f"{path} is missing: the checkpoint was written by an hpsft before trainer states were "
                "independent of the data-parallel size; resume it with that version"
            )
        return load_plain_data(path)
