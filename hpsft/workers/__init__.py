"""Training workers: one data-parallel rank each (in-process for SPMD, an actor for Ray)."""

from hpsft.workers.training_worker import TrainingWorker, token_mean_loss

__all__ = ["TrainingWorker", "token_mean_loss"]
