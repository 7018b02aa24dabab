"""The worker contract the trainer programs against: what SFTTrainer and RaySFTTrainer call on
`self.worker`, and nothing else (tests/test_engine_factory.py holds the trainers, this and both
workers together). TrainingWorker is one rank in this process (SPMD); DataParallelWorker
(hpsft/ray/data_parallel.py) is a Ray worker group of TrainingWorker actors seen from the
driver, which shards each global batch over them."""

from abc import ABC, abstractmethod

from hpsft.workers.step_result import StepResult


class Worker(ABC):
    @abstractmethod
    def global_loss_tokens(self, batch) -> int:
        """The loss-token count of the step's whole global batch, from what this process loaded
        of it (under SPMD a collective over the ranks' shares)."""

    @abstractmethod
    def train_batch(self, batch, global_loss_tokens: int) -> StepResult:
        """One optimizer step on the loaded batch, the loss normalised by `global_loss_tokens`:
        this rank's result (SPMD: the trainer all-reduces it), or every rank's combined (Ray)."""

    @abstractmethod
    def infer_batch(self, batch) -> dict:
        """Per-sequence NLL sums and loss tokens ({"nll_sum", "loss_tokens"}), in the batch's order,
        no gradients."""

    @abstractmethod
    def start_profiler(self, folder: str, ranks: list[int], first_step: int) -> None:
        """Profile the following train_batch calls (steps first_step, ...) on these ranks."""

    @abstractmethod
    def stop_profiler(self) -> None:
        """Write the trace and table of the profiled steps."""

    @abstractmethod
    def save_checkpoint(self, root: str, tag: str) -> None:
        """The engine's state under root/tag (every rank's part)."""

    @abstractmethod
    def load_checkpoint(self, root: str, tag: str) -> None:
        """The engine state under root/tag, whatever the layout that wrote it."""

    @abstractmethod
    def export_hf(self, out_dir: str, tokenizer, progress: bool = False) -> None:
        """The trained model and tokenizer as a Hugging Face folder (with a progress bar if `progress`)."""
