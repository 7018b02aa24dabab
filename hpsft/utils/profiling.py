"""torch.profiler over a range of optimizer steps on one rank (trainer.profile_steps).

The trainer starts it before the first step of the range and stops it after the last; each
step inside is recorded under a `step N` annotation (N: the global step, counted from 1).
On stop the rank writes, into the profile folder:
  rank<R>_trace.json          Chrome trace (chrome://tracing, https://ui.perfetto.dev)
  rank<R>_key_averages.txt    the operators' totals, most expensive first (by device time
                              on a GPU, then by CPU time)
"""

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def trace_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}_trace.json"


class StepProfiler:
    def __init__(self, folder: Path, rank: int, first_step: int):
        self.folder, self.rank, self.step = folder, rank, first_step
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profiler = profile(activities=activities)
        self.profiler.start()

    @contextlib.contextmanager
    def annotate_step(self):
        """Marks one optimizer step in the trace; the next call marks the following step."""
        with record_function(f"step {self.step}"):
            yield
        self.step += 1

    def stop(self) -> None:
        self.profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(trace_path(self.folder, self.rank)))
        averages = self.profiler.key_averages()
        # On a GPU both orders matter: a step slowed by host work (Python, launches, syncs)
        # shows at the top of the CPU table while the device table looks idle.
        orders = (["self_device_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]
        text = "\n".join(f"sorted by {order}:\n{averages.table(sort_by=order, row_limit=50)}\n" for order in orders)
        (self.folder / f"rank{self.rank}_key_averages.txt").write_text(text)
