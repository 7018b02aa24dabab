"""Training workers: the contract the trainer calls (base.py: Worker), one rank's TrainingWorker
(in-process for SPMD, an actor for Ray), how ranks' step results combine (step_result.py), and
the faults the tests inject (faults.py)."""

from hpsft.workers.base import Worker
from hpsft.workers.training_worker import TrainingWorker, token_mean_loss

__all__ = ["TrainingWorker", "Worker", "token_mean_loss"]
