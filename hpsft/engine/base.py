"""The engine contract the worker programs against (as in verl): it knows modules,
tensors and process groups; nothing of datasets, YAML or Ray. The worker uses an engine
through these members only; an engine is built by hpsft.engine.factory.build_engine."""

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Callable, Iterator

import torch

from torch import nn


class TrainEngine(ABC):
    @abstractmethod
    def __init__(self, engine_config, optim_config, total_steps: int):
        """The config sections `engine` and `optim`, and the run's optimizer steps (the LR schedule's length)."""

    @abstractmethod
    def partitioned_init_config(self) -> dict | None:
        """The config to build the model with when the engine runs it partitioned from the start
        (hpsft.models.load_causal_lm's zero3_config: no rank ever holds all of it); None when
        the model is built whole and initialize() takes it as it is."""

    @abstractmethod
    def initialize(self, module: nn.Module) -> None:
        """Wrap the built model: sharding, optimizer, LR schedule."""

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The model initialize() wrapped (as the engine holds it: moved, cast, sharded)."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device the module runs on (micro-batches are moved there)."""

    @property
    @abstractmethod
    def steps(self) -> int:
        """Optimizer steps taken, a resumed checkpoint's included."""

    @abstractmethod
    def train_batch(self, micro_batches: list[dict], loss_fn: Callable, sequence_nll: bool = False,
                    loss_weight: float | None = None) -> dict:
        """Forward/backward every micro-batch, then one optimizer step.

        `loss_fn(outputs) -> loss` maps a micro-batch's module outputs to the loss whose
        gradient, *summed* over micro-batches and data-parallel ranks, is the step's
        gradient. `sequence_nll`: the outputs also hold each sequence's NLL sum and loss tokens
        (PackedCausalLM.forward's). `loss_weight`: when loss_fn(outputs) is outputs["loss"] x
        loss_weight (a number), the engine may have the loss put the LM head's weight gradient
        straight into its own storage; None: every gradient goes through autograd.
        Returns {"outputs": [...], "grad_norm": float, "lr": float}.
        """

    @abstractmethod
    def infer_batch(self, micro_batches: list[dict]) -> list:
        """Forward only, no gradients: each micro-batch's per-sequence NLL sums and loss tokens
        (PackedCausalLM.forward with per_sequence)."""

    @abstractmethod
    def save_checkpoint(self, root: str, tag: str) -> None:
        """The engine's state (module, optimizer, LR schedule, step count) under root/tag; a collective."""

    @abstractmethod
    def load_checkpoint(self, root: str, tag: str) -> None:
        """The state save_checkpoint wrote under root/tag, whatever the number of ranks that wrote it."""

    @abstractmethod
    def gathered(self, params: list[nn.Parameter]) -> AbstractContextManager:
        """A context in which these parameters of the module are whole on every rank (a
        collective where the engine shards them)."""

    @abstractmethod
    def gathered_tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The module's parameters and buffers of these names, whole, one at a time: (name,
        tensor) on rank 0, (name, None) elsewhere. A collective: every rank iterates to the end."""
