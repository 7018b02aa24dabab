"""Progress bars (tqdm, on stderr): shown only on a terminal, and only where the caller
enables them (rank 0, or the Ray driver, with trainer.progress_bar=true)."""

from tqdm import tqdm


def progress_bar(enabled: bool, **kwargs) -> tqdm:
    """A bar when `enabled` and stderr is a terminal (tqdm's disable=None), else a silent one:
    a log file would fill with carriage-return redraws."""
    return tqdm(disable=None if enabled else True, dynamic_ncols=True, **kwargs)


def step_postfix(metrics: dict) -> dict:
    """What the training bar shows after the step count, rate and ETA (elapsed<remaining)."""
    return {"loss": f"{metrics['train/loss']:.4f}", "tok/s": f"{metrics['perf/tokens_per_s']:.0f}"}
