"""Checkpoint directories that a crash mid-save cannot corrupt.

Layout under <output_dir>/checkpoints/:
    global_step_<N>/      engine shards (DeepSpeed) + trainer_state_rank<r>.pt per rank
    latest                the name of the newest complete checkpoint, replaced atomically

A save goes to `global_step_<N>.partial/`, is renamed once every rank has written its
part, and only then does `latest` move: an interrupted save leaves the previous
checkpoint as the one a resume picks up.
"""

import os
import shutil
import tempfile
from pathlib import Path

import torch

from hpsft.errors import UserInputError

STEP_PREFIX = "global_step_"
PARTIAL_SUFFIX = ".partial"


class CheckpointManager:
    def __init__(self, output_dir: str | Path):
        self.root = Path(output_dir) / "checkpoints"

    @staticmethod
    def tag(step: int) -> str:
        return f"{STEP_PREFIX}{step}"

    def partial_tag(self, step: int) -> str:
        return self.tag(step) + PARTIAL_SUFFIX

    def rank_state_path(self, tag: str, rank: int) -> Path:
        return self.root / tag / f"trainer_state_rank{rank}.pt"

    def save_rank_state(self, step: int, rank: int, state: dict) -> None:
        path = self.rank_state_path(self.partial_tag(step), rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)

    def commit(self, step: int) -> Path:
        """Rank 0, after every rank finished writing: publish the checkpoint."""
        partial, final = self.root / self.partial_tag(step), self.root / self.tag(step)
        if final.exists():  # a re-save of the same step (e.g. the end of a resumed run)
            shutil.rmtree(final)
        os.replace(partial, final)
        fd, tmp = tempfile.mkstemp(prefix="latest.", dir=self.root)
        with os.fdopen(fd, "w") as f:
            f.write(self.tag(step) + "\n")
        os.replace(tmp, self.root / "latest")
        return final

    def latest(self) -> Path | None:
        marker = self.root / "latest"
        if not marker.is_file():
            return None
        path = self.root / marker.read_text().strip()
        if not path.is_dir():
            raise UserInputError(f"{marker} names {path.name}, which does not exist")
        return path

    @staticmethod
    def resolve(path: str | Path) -> Path:
        """A checkpoint given by the user: a global_step_<N> folder or a run's output_dir."""
        path = Path(path)
        if path.name.startswith(STEP_PREFIX) and path.is_dir():
            return path
        latest = CheckpointManager(path).latest()
        if latest is None:
            raise UserInputError(f"trainer.resume={path}: neither a {STEP_PREFIX}<N> folder nor a run with checkpoints")
        return latest

    @staticmethod
    def load_rank_state(checkpoint: Path, rank: int) -> dict:
        path = checkpoint / f"trainer_state_rank{rank}.pt"
        if not path.is_file():
            raise UserInputError(
                f"{path} is missing: the checkpoint was written by fewer processes than this run has; "
                "resume with the same number of data-parallel ranks"
            )
        return torch.load(path, weights_only=False)
