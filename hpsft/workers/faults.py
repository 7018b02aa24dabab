"""Faults the tests inject into a worker, as real ones would strike. Nothing but the tests sets
these variables (a Ray worker group hands them to its ranks: worker_group.TEST_HOOK_PREFIX);
they are parsed once, when the worker is built (InjectedFaults.from_environment).

HPSFT_TEST_WORKER_FAULT=<kind>:<rank>:<when>[:<once file>][,<more faults>] acts in rank <rank>
at <when>: an optimizer step number (at the start of train_batch for that step) or
`load_checkpoint`. `raise` raises InjectedFault, `hang` sleeps for good, `exit` ends the process
at once (os._exit, like a kill). With a once file a fault acts only if that file does not exist
yet, and creates it: a restarted run then goes on normally.

HPSFT_TEST_NONFINITE_GRADIENT_STEPS=<step>:<inf|nan>[,...] gives that step's gradients on every
rank a non-finite norm, its loss left finite (e.g. 3:inf,4:nan): the engine must skip the step
(trainer/nonfinite.py counts it).

HPSFT_TEST_PAUSE_IN_SAVE=<rank>:<point>:<folder> pauses rank <rank> at a named point of the
trainer's checkpoint save, so that a test can signal the other ranks while they wait for it in
the save's barrier, or while the launcher signals them (tests/test_fault_tolerance.py). Points,
in SFTTrainer.save_checkpoint's order: `written` (this rank's files written, before the first
barrier), `committed` (after the first barrier; rank 0 has committed and pruned), `saved` (after
the last barrier). At <point> every rank writes its pid to <folder>/<point>.<rank>; rank <rank>
then waits until <folder>/<point>.go exists.
"""

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

WORKER_FAULT_ENV = "HPSFT_TEST_WORKER_FAULT"
NONFINITE_GRADIENT_STEPS_ENV = "HPSFT_TEST_NONFINITE_GRADIENT_STEPS"
PAUSE_IN_SAVE_ENV = "HPSFT_TEST_PAUSE_IN_SAVE"
KINDS = ("raise", "hang", "exit")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    rank: int
    when: str  # a step number, or "load_checkpoint"
    once: str | None  # the file whose creation it acts at most once for


@dataclass(frozen=True)
class SavePause:
    rank: int
    point: str  # written, committed or saved
    folder: Path  # where every rank notes reaching the point, and the test says go


@dataclass(frozen=True)
class InjectedFaults:
    faults: tuple[Fault, ...] = ()
    nonfinite_steps: dict[int, float] = field(default_factory=dict)  # step -> inf or nan
    save_pause: SavePause | None = None

    @classmethod
    def from_environment(cls) -> "InjectedFaults":
        """The faults the test variables ask for: none in a real run."""
        faults = []
        for spec in filter(None, os.environ.get(WORKER_FAULT_ENV, "").split(",")):
            kind, rank, when, *once = spec.split(":", 3)
            if kind not in KINDS:
                raise ValueError(f"{WORKER_FAULT_ENV}={spec!r}: the kind is {', '.join(KINDS)}")
            faults.append(Fault(kind, int(rank), when, once[0] if once else None))
        entries = (entry.split(":") for entry in os.environ.get(NONFINITE_GRADIENT_STEPS_ENV, "").split(",") if entry)
        pause = os.environ.get(PAUSE_IN_SAVE_ENV)
        save_pause = None
        if pause:
            rank, point, folder = pause.split(":", 2)
            save_pause = SavePause(int(rank), point, Path(folder))
        return cls(tuple(faults), {int(step): float(value) for step, value in entries}, save_pause)

    def strike(self, rank: int, when) -> None:
        """Act out this rank's fault at `when` (a step number or "load_checkpoint"), if there is one."""
        for fault in self.faults:
            if fault.rank != rank or fault.when != str(when):
                continue
            if fault.once is not None:
                try:
                    open(fault.once, "x").close()
                except FileExistsError:
                    continue
            if fault.kind == "raise":
                raise InjectedFault(f"{WORKER_FAULT_ENV}: rank {rank} fails at "
                                    f"{'step ' if fault.when.isdigit() else ''}{fault.when}")
            if fault.kind == "hang":
                while True:
                    time.sleep(60)
            os._exit(1)

    def pause_in_save(self, point: str, rank: int) -> None:
        """At the save's `point`: note this rank's pid there; the paused rank waits for the test's go."""
        pause = self.save_pause
        if pause is None or point != pause.point:
            return
        written = pause.folder / f"{point}.{rank}.tmp"
        written.write_text(str(os.getpid()))
        written.replace(pause.folder / f"{point}.{rank}")  # whole, for a test polling the folder
        go = pause.folder / f"{point}.go"
        while pause.rank == rank and not go.exists():
            time.sleep(0.05)

    def loss_transform(self, step: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What step `step`'s loss goes through to make its gradients non-finite; None: nothing."""
        value = self.nonfinite_steps.get(step)
        if value is None:
            return None
        return lambda loss: nonfinite_gradient(loss, value)


def nonfinite_gradient(loss: torch.Tensor, value: float) -> torch.Tensor:
    """`loss` (its value stays finite), whose backward makes the gradient norm `value`: NaN puts
    NaN into every gradient; inf puts +inf into one element of one parameter's gradient, the rest
    left as computed (an inf pushed through the backward would meet -inf and zeros on the way and
    make the norm NaN)."""
    if math.isnan(value):
        loss.register_hook(lambda grad: torch.full_like(grad, value))
        return loss
    handle = None

    def poison_once(grad):
        handle.remove()  # this micro-batch's backward only
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    handle = a_parameter_of(loss).register_hook(poison_once)
    return loss


def a_parameter_of(loss: torch.Tensor) -> torch.Tensor:
    """A parameter `loss` was computed from: the first leaf found walking its autograd graph."""
    nodes = [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if hasattr(node, "variable"):  # an AccumulateGrad node: its variable is a leaf that requires grad
            return node.variable
        nodes.extend(child for child, _ in node.next_functions if child is not None)
    raise ValueError("the loss depends on no parameter")
