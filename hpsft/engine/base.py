"""The engine contract the worker programs against (as in verl): it knows modules,
tensors and process groups; nothing of datasets, YAML or Ray."""

from abc import ABC, abstractmethod
from typing import Callable, Iterator

import torch

from torch import nn


class TrainEngine(ABC):
    @abstractmethod
    def initialize(self, module: nn.Module) -> None:
        """Wrap the built model: sharding, optimizer, LR schedule."""

    @abstractmethod
    def train_batch(self, micro_batches: list[dict], loss_fn: Callable) -> dict:
        """Forward/backward every micro-batch, then one optimizer step.

        `loss_fn(outputs) -> loss` maps a micro-batch's module outputs to the loss whose
        gradient, *summed* over micro-batches and data-parallel ranks, is the step's
        gradient. Returns {"outputs": [...], "grad_norm": float, "lr": float}.
        """

    @abstractmethod
    def infer_batch(self, micro_batches: list[dict]) -> list:
        """Forward only, no gradients; the module outputs of each micro-batch."""

    @abstractmethod
    def save_checkpoint(self, root: str, tag: str) -> None: ...

    @abstractmethod
    def load_checkpoint(self, root: str, tag: str) -> None: ...

    @abstractmethod
    def gathered_tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The module's parameters and buffers of these names, whole, one at a time: (name,
        tensor) on rank 0, (name, None) elsewhere. A collective: every rank iterates to the end."""

    @property
    @abstractmethod
    def dp_rank(self) -> int: ...

    @property
    @abstractmethod
    def dp_size(self) -> int: ...

    @property
    @abstractmethod
    def dp_group(self): ...
