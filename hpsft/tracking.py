"""Metric backends (console, JSONL file, TensorBoard); only rank 0 builds a Tracker."""

import json
import math
from pathlib import Path

from tqdm import tqdm


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
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Tracker:
    def __init__(self, backends: list[str], run_dir: Path, console: bool = True):
        self.backends = []
        for name in backends:
            if name == "console" and console:
                self.backends.append(ConsoleBackend())
            elif name == "jsonl":
                self.backends.append(JsonlBackend(run_dir / "metrics.jsonl"))
            elif name == "tensorboard":
                self.backends.append(TensorBoardBackend(run_dir / "tensorboard"))

    def log(self, metrics: dict, step: int) -> None:
        for backend in self.backends:
            backend.log(metrics, step)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
