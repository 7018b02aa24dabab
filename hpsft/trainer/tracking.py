"""Metric backends (console, JSONL file, TensorBoard, Weights & Biases); only rank 0 (the
driver under Ray) builds a Tracker. Every backend gets the config with its secrets masked;
credentials (WANDB_API_KEY) come from the environment only (docs/tracking.md)."""

import json
import math
import os
import sys
from pathlib import Path

from tqdm import tqdm

from hpsft.config import SFTConfig, masked_dict, to_yaml
from hpsft.config.secrets import URL_PASSWORD
from hpsft.utils.errors import UserInputError


class ConsoleBackend:
    def log(self, metrics: dict, step: int) -> None:
        parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()]
        tqdm.write(f"step {step}: " + " ".join(parts))  # does not break a progress bar

    def close(self) -> None:
        pass


class JsonlBackend:
    """One JSON object per logged step; appended, so a resumed run continues the file."""

    def __init__(self, path: Path):
        self.file = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict, step: int) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardBackend:
    def __init__(self, log_dir: Path, config_yaml: str, step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        # The text plugin renders Markdown: indented, the YAML shows as a code block.
        self.writer.add_text("config", "\n".join("    " + line for line in config_yaml.splitlines()), step)

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_mode(config: SFTConfig) -> str:
    """trainer.wandb.mode, else the WANDB_MODE environment variable, else online."""
    return config.trainer.wandb.mode or os.environ.get("WANDB_MODE", "online")


def check_trackers_available(config: SFTConfig) -> None:
    """Before anything slow: the loggers asked for can run (wandb installed, and an API key in
    the environment for online mode)."""
    if "wandb" not in config.trainer.loggers:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserInputError("trainer.loggers includes wandb, which is not installed: pip install hpsft[wandb] "
                             "(or drop wandb from trainer.loggers)") from None
    if wandb_mode(config) == "online" and not os.environ.get("WANDB_API_KEY"):
        raise UserInputError("trainer.loggers includes wandb in online mode but WANDB_API_KEY is not set: export "
                             "it (hpsft never reads a key from the config), or log offline with "
                             "trainer.wandb.mode=offline (upload later with `wandb sync`)")


class WandbBackend:
    """A W&B run whose files live in <output_dir>/wandb/ (offline: `wandb sync` uploads them)."""

    def __init__(self, run_dir: Path, config: SFTConfig):
        import wandb

        cfg = config.trainer.wandb
        # W&B records the command line in the run's metadata: a password in a URL among the
        # overrides (ray.address=ray://user:pw@host) would land in the run folder unmasked.
        secret_in_argv = any(URL_PASSWORD.search(arg) for arg in sys.argv)
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, name=cfg.name, mode=wandb_mode(config), dir=str(run_dir),
            config=masked_dict(config), settings=wandb.Settings(x_disable_meta=secret_in_argv),
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    def __init__(self, config: SFTConfig, run_dir: Path, step: int):
        """`step`: the run's current step (0, or where it resumed)."""
        self.backends = []
        for name in config.trainer.loggers:
            if name == "console":
                self.backends.append(ConsoleBackend())
            elif name == "jsonl":
                self.backends.append(JsonlBackend(run_dir / "metrics.jsonl"))
            elif name == "tensorboard":
                self.backends.append(TensorBoardBackend(run_dir / "tensorboard", to_yaml(config), step))
            elif name == "wandb":
                self.backends.append(WandbBackend(run_dir, config))

    def log(self, metrics: dict, step: int) -> None:
        for backend in self.backends:
            backend.log(metrics, step)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
