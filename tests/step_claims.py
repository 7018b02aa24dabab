"""The optimizer-step claims of the docs, checked for any engine layout against the fp64
plain-torch reference that tests/dist_scripts/step_claims.py computes beside the engines' runs:
the unclipped gradient norms, the rates, the final weights, and a resumed engine's steps equal
to the straight run's. Used by test_zero_stage_claims (each ZeRO stage) and
test_megatron_engine (each Megatron layout)."""

import math
from pathlib import Path
from typing import Callable

import torch

from tests.conftest import REPO, run_cli, write_tiny_llama
from tests.dist_scripts.step_claims import SAVED_AFTER
from tests.numerics import relative_error

# The gradients are fp32 sums over 2 ranks in another order than the reference's: ~1e-6 of the
# norm. A planted bug moves them by 1e-3 or more (docs/testing.md).
NORM_RTOL = 1e-5
# Weights after 4 AdamW steps at lr 1e-2: where a gradient is ~0, Adam's m / sqrt(v) turns its
# rounding into an update of up to lr, so the whole model is compared (relative_error) and not
# each entry; a missed decay or clip moves it by ~1e-3 (docs/testing.md).
WEIGHT_RTOL = 2e-5


def run_models(folder: Path, models: dict[str, tuple[Callable[[Path], Path], list[str]]], nproc: int) -> dict:
    """One launch of `nproc` ranks running, for each model name, its layouts
    (tests/dist_scripts/step_claims.py) on the model its writer writes to folder/NAME; by
    name, its results by layout and its reference."""
    args = []
    for name, (write_model, layouts) in models.items():
        args += ["--"] * bool(args) + [str(write_model(folder / name)), *layouts]
    out = folder / "runs.pt"
    proc = run_cli(None, [str(out), str(folder / "checkpoints"), *args], nproc=nproc,
                   script=str(REPO / "tests" / "dist_scripts" / "step_claims.py"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def run_layouts(folder: Path, layouts: list[str], nproc: int) -> dict:
    """run_models for the 2-layer tiny Llama alone (the folder named `model`): its results by
    layout, and the reference."""
    return run_models(folder, {"model": (write_tiny_llama, layouts)}, nproc)["model"]


def assert_norms(norms, reference, what):
    for step, (norm, expected) in enumerate(zip(norms, reference, strict=True)):
        if math.isnan(expected):
            assert not math.isfinite(norm), f"{what}: step {step} reported {norm}, not non-finite"
        else:
            assert abs(norm - expected) <= NORM_RTOL * expected, f"{what}: step {step} norm {norm} vs {expected}"


def assert_steps_as_documented(run: dict, reference: dict, what: str) -> None:
    """Clipping by the unclipped global norm, the non-finite step skipped (weights and schedule
    as they were), warmup then cosine, AdamW with no decay on 1-D weights, and the checkpoint
    after step 3 resuming into the same steps."""
    norms = [n for n in reference["grad_norms"] if not math.isnan(n)]
    assert min(norms) < 1.0 < max(norms)  # the clip (1.0) binds on some steps, not on all
    assert_norms(run["grad_norms"], reference["grad_norms"], what)
    torch.testing.assert_close(torch.tensor(run["lrs"]), torch.tensor(reference["lrs"]), rtol=1e-12, atol=0,
                               msg=lambda m: f"{what} learning rates: {m}")
    assert run["global_steps"] == 5
    error = relative_error(run["weights"], reference["weights"])
    assert error < WEIGHT_RTOL, f"{what} weights after the steps: {error:.2e} from the fp64 reference"
    resumed = run["resumed"]
    assert_norms(resumed["grad_norms"], reference["grad_norms"][SAVED_AFTER:], f"{what} resumed")
    assert resumed["lrs"] == run["lrs"][SAVED_AFTER:] and resumed["global_steps"] == 5
    error = relative_error(resumed["weights"], reference["weights"])
    assert error < WEIGHT_RTOL, f"{what} resumed weights: {error:.2e} from the fp64 reference"
