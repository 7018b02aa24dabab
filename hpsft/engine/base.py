"""The engine contract the worker programs against (as in verl): it knows modules,
tensors and process groups; nothing of datasets, YAML or Ray. The worker uses an engine
through these members only (tests/test_engine_factory.py holds the two together); an engine
is built by hpsft.engine.factory.build_engine."""

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from torch import nn

from hpsft.utils.distributed import Mesh


def detached(outputs: dict) -> dict:
    """A micro-batch's module outputs without their graphs, as EngineStep.outputs holds them."""
    return {name: value.detach() for name, value in outputs.items()}


@dataclass(frozen=True)
class EngineStep:
    """What one optimizer step of an engine gives back."""

    outputs: list[dict]  # each micro-batch's module outputs (PackedCausalLM.forward's), detached
    grad_norm: float  # the unclipped global gradient norm; NaN or inf: the step was skipped
    lr: float  # the learning rate this step used


class TrainEngine(ABC):
    @abstractmethod
    def __init__(self, engine_config, optim_config, total_steps: int, mesh: Mesh):
        """The config sections `engine` and `optim`, the run's optimizer steps (the LR schedule's
        length), and this rank's place in the run's layout (built once at start-up)."""

    @abstractmethod
    def model_init(self) -> AbstractContextManager[bool]:
        """A context in which the worker builds the model. It gives whether the model built in
        it comes out partitioned across the ranks (ZeRO-3: no rank ever holds all of it; the
        weights are then loaded one tensor at a time, hpsft.models.load_causal_lm's
        `partitioned`); otherwise the model is built whole and initialize() takes it as it is."""

    @abstractmethod
    def initialize(self, module: nn.Module, head_weight: nn.Parameter | None = None) -> None:
        """Wrap the built model: sharding, optimizer, LR schedule. `head_weight`: the parameter the
        module's fused loss reads as the LM head's weight (PackedCausalLM.head_weight), into whose
        gradient storage the engine may have that loss sum (train_batch's loss_weight)."""

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
                    loss_weight: float | None = None) -> EngineStep:
        """Forward/backward every micro-batch, then one optimizer step.

        `loss_fn(outputs) -> loss` maps a micro-batch's module outputs to the loss whose
        gradient, *summed* over micro-batches and data-parallel ranks, is the step's
        gradient. `sequence_nll`: the outputs also hold each sequence's NLL sum and loss tokens
        (PackedCausalLM.forward's). `loss_weight`: when loss_fn(outputs) is outputs["loss"] x
        loss_weight (a number), the engine may have the loss put the LM head's weight gradient
        straight into its own storage; None: every gradient goes through autograd.
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

    @classmethod
    @abstractmethod
    def checkpoint_weights(cls, folder: Path, scratch: Path) -> Mapping[str, torch.Tensor] | None:
        """The fp32 weights by name that a checkpoint folder save_checkpoint wrote holds, whole,
        read in one process (each when asked; `scratch` for files it needs to write on the way);
        None when `folder` holds no checkpoint of this engine. Used by hpsft export, through
        the factory (checkpoint_weights there), not by the worker."""

    @abstractmethod
    def gathered(self, params: list[nn.Parameter]) -> AbstractContextManager:
        """A context in which these parameters of the module are whole on every rank (a
        collective where the engine shards them)."""

    @abstractmethod
    def gathered_tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The module's parameters and buffers of these names, whole, one at a time: (name,
        tensor) on rank 0, (name, None) elsewhere. A collective: every rank iterates to the end."""
