"""What a previous run left in an output directory, and clearing it when the user asks.

A fresh run (trainer.resume=disable) into a directory that holds another run's
checkpoints or metrics would interleave the two: the old `latest` would be resumed by a
later re-run, and metrics.jsonl would hold both curves. It is refused unless
trainer.overwrite_output_dir=true, which deletes those outputs (nothing else) first.
"""

import shutil
import tempfile
from pathlib import Path

# Everything a run (and `hpsft samples`/`hpsft plot` on it) writes into its output_dir besides
# config.yaml, which every run rewrites.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "wandb", "profile", "hf", "samples.md", "samples.jsonl",
               "plots")


def unwritable_problem(run_dir: Path) -> str | None:
    """Why `run_dir` cannot be created or written, or None (checked before anything slow, so
    that a run does not fail at its first checkpoint). Tried rather than inferred from
    permission bits, which say yes for root under /proc and on a missing mount: the missing
    folders are made and a file written in the deepest, then all of it removed, so that a
    refused run leaves nothing behind."""
    existing = run_dir
    while not existing.exists():  # its nearest existing ancestor is where it will be created
        existing = existing.parent
    if not existing.is_dir():
        return f"trainer.output_dir={run_dir}: {existing} is a file, not a folder; choose another output_dir"
    missing = [folder for folder in (run_dir, *run_dir.parents) if not folder.exists()]  # deepest first
    created = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            created.append(folder)
        tempfile.TemporaryFile(dir=run_dir).close()
    except OSError as err:
        return (f"trainer.output_dir={run_dir} cannot be created or written: {err.strerror} ({err.filename}); "
                "choose another output_dir")
    finally:
        for folder in reversed(created):
            folder.rmdir()
    return None


def previous_run_outputs(run_dir: Path) -> list[Path]:
    return [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def fresh_start_problem(run_dir: Path, overwrite: bool) -> str | None:
    """Why a run with trainer.resume=disable may not start in `run_dir`, or None."""
    found = previous_run_outputs(run_dir)
    if not found or overwrite:
        return None
    return (
        f"trainer.output_dir={run_dir} already holds a run ({', '.join(p.name for p in found)}) and "
        "trainer.resume=disable would mix this one into it: continue it with trainer.resume=auto, "
        "choose another trainer.output_dir, or set trainer.overwrite_output_dir=true to delete its "
        "checkpoints and metrics first"
    )


def clear_previous_run(run_dir: Path) -> None:
    for path in previous_run_outputs(run_dir):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
