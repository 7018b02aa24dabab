"""The Ray path: a driver (RaySFTTrainer) and a group of TrainingWorker actors."""

from hpsft.ray.ray_trainer import RaySFTTrainer
from hpsft.ray.worker_group import (
    ClassWithInitArgs,
    PerRank,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerFailedError,
    WorkerHungError,
    WorkerLostError,
)

__all__ = ["RaySFTTrainer", "ClassWithInitArgs", "PerRank", "RayWorkerGroup", "WorkerDiedError", "WorkerFailedError",
           "WorkerHungError", "WorkerLostError"]
