"""Charts of a run: PNGs of its metrics.jsonl against the step.

    hpsft plot runs/default                 -> runs/default/plots/*.png
    hpsft plot runs/default --out /tmp/p    -> /tmp/p/*.png

One chart per group of metrics that the run logged: loss (train and validation), learning
rate, gradient norm, tokens/s, MFU and padding efficiency. A step logged more than once
(a step redone after a restart) is drawn with its last record. Needs matplotlib
(`pip install 'hpsft[plot]'`).
"""

import json
import sys
from pathlib import Path

from hpsft.commands import command_parser
from hpsft.utils.errors import UserInputError, exits_2_on_user_error

# file name -> (title, y label, metrics drawn on it)
CHARTS = {
    "loss": ("Loss", "mean NLL per loss token", ("train/loss", "val/loss")),
    "lr": ("Learning rate", "lr", ("train/lr",)),
    "grad_norm": ("Gradient norm (before clipping)", "L2 norm", ("train/grad_norm",)),
    "tokens_per_s": ("Throughput", "tokens/s (all ranks)", ("perf/tokens_per_s",)),
    "mfu": ("Model FLOPs utilisation", "MFU", ("perf/mfu",)),
    "padding_efficiency": ("Padding efficiency", "real tokens / computed tokens", ("perf/padding_efficiency",)),
}


SIZE_INCHES, DPI = (8, 4.5), 100  # 800 x 450 pixels


def read_series(metrics_path: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value}, the last record of a step winning."""
    if not metrics_path.is_file():
        raise UserInputError(f"{metrics_path} does not exist: give a run directory (trainer.output_dir) "
                             "that has logged at least one step")
    series: dict[str, dict[int, float]] = {}
    for line_no, line in enumerate(metrics_path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise UserInputError(f"{metrics_path} line {line_no} is not JSON") from None
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)):
                series.setdefault(name, {})[int(record["step"])] = float(value)
    return series


def plot_run(run_dir: Path, out_dir: Path) -> list[Path]:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UserInputError("hpsft plot needs matplotlib: pip install 'hpsft[plot]'") from None
    matplotlib.use("Agg")  # files only, no display needed
    from matplotlib import pyplot as plt

    series = read_series(run_dir / "metrics.jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, metrics) in CHARTS.items():
        present = [m for m in metrics if series.get(m)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=SIZE_INCHES, dpi=DPI)
        for metric in present:
            steps = sorted(series[metric])
            ax.plot(steps, [series[metric][s] for s in steps], marker="o" if len(steps) < 30 else None,
                    label=metric)
        ax.set(title=f"{title}: {run_dir.name}", xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = command_parser("hpsft plot", __doc__)
    parser.add_argument("run_dir", type=Path, help="a run directory (trainer.output_dir)")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir, args.out or args.run_dir / "plots"):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
