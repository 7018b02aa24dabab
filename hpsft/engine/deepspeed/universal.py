"""Checkpoints across layouts, through DeepSpeed's universal checkpoint (docs/checkpoints.md):
a checkpoint written with another number of ZeRO shards, or with ZeRO where this run has none
(and the other way), is converted on rank 0 into the per-parameter universal layout, and
every rank loads its state from there."""

import contextlib
import io
import shutil
import time
from pathlib import Path
from typing import Callable

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import CLIP_GRAD, DS_VERSION, PARAM, PARAM_GROUPS

from hpsft.engine.deepspeed.layout import (MODEL_STATES_PER_TP_RANK, MOMENTS, UNIVERSAL_MARKER, UNIVERSAL_OPTIMIZER,
                                           UNIVERSAL_STATE, UNIVERSAL_SUFFIX, UniversalState, model_states,
                                           universal_file)

# A DeepSpeed checkpoint load: (root, tag, load_optimizer_states, load_module) (checkpoint.load_native).
NativeLoad = Callable[..., None]


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal, in this process (one worker: no process pool), quiet,
    without the `latest_universal` marker it also writes beside `out` (nothing reads it here)."""
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = Namespace(input_folder=str(checkpoint), output_folder=str(out), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal(args)
    (out.parent / UNIVERSAL_MARKER).unlink()


def to_universal_without_zero(checkpoint: Path, out: Path) -> None:
    """to_universal for a run without ZeRO (load_universal_without_zero). A TP checkpoint's
    universal folder keeps one model file per TP rank; DeepSpeed's load outside its universal
    path (which needs a ZeRO optimizer) would merge them Megatron-style, by names AutoTP models
    do not have. That load takes only the LR scheduler and step counters from it, the same in
    every TP rank's file: the first one is kept, as the file of a world without TP."""
    to_universal(checkpoint, out)
    first, *others = sorted(out.glob(MODEL_STATES_PER_TP_RANK))
    if others:
        state = torch.load(first, map_location="cpu", weights_only=False)
        state["mp_world_size"] = 1
        torch.save(state, first)
        for other in others:
            other.unlink()


def unsharded_to_universal(checkpoint: Path, out: Path, names: list[str], clip_grad: float) -> None:
    """A checkpoint written without ZeRO (its one model file holds the module and the whole
    torch AdamW state) in the layout ds_to_universal writes from ZeRO shards: per parameter
    zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt, the optimizer's hyperparameters in
    zero/optimizer_state.pt, and the model file (LR scheduler, step counters) beside them.
    `names`: the trainable parameters in the optimizer's order (param_groups). `clip_grad` is
    the ZeRO run's: DeepSpeed's ZeRO optimizer takes its clipping from the checkpoint."""
    model_file = checkpoint / model_states(0)
    saved = torch.load(model_file, map_location="cpu", weights_only=False)
    optimizer = saved["optimizer"]
    indices = [index for group in optimizer["param_groups"] for index in group["params"]]
    if len(indices) != len(names):
        raise RuntimeError(f"{checkpoint}: its optimizer holds {len(indices)} parameters, this model trains "
                           f"{len(names)}: not a checkpoint of this model")
    # A parameter that never had a gradient has no AdamW state: zero moments, the common step.
    steps = [state["step"] for state in optimizer["state"].values() if "step" in state]
    for index, name in zip(indices, names):
        weight = saved["module"][name].float()
        state = optimizer["state"].get(index, {})
        universal_file(out, name, "fp32").parent.mkdir(parents=True)
        torch.save({PARAM: weight}, universal_file(out, name, "fp32"))
        for key in MOMENTS:
            moment = state.get(key, torch.zeros_like(weight))
            if moment.shape != weight.shape:
                raise RuntimeError(f"{checkpoint}: {name} has {key} of shape {tuple(moment.shape)}, the weight "
                                   f"{tuple(weight.shape)}: not a checkpoint of this model")
            torch.save({PARAM: moment.float()}, universal_file(out, name, key))
        if steps:
            torch.save(state.get("step", steps[0]), universal_file(out, name, "step"))
    torch.save({CLIP_GRAD: clip_grad, DS_VERSION: deepspeed.__version__, PARAM_GROUPS: optimizer["param_groups"]},
               out / UNIVERSAL_STATE / UNIVERSAL_OPTIMIZER)
    shutil.copy2(model_file, out / model_states(0))


def load_through_universal(root: str, tag: str, why: str, convert: Callable[[Path], None],
                           load: Callable[[str, str], None]) -> None:
    """`convert(out)` the checkpoint root/tag into a universal folder on rank 0, then
    `load(root, universal_tag)` on every rank. `why` says in the log line why it was needed."""
    # Rank 0 converts into a sibling folder (its name is no global_step_<N>: never resumed
    # from, nor rotated); every rank then loads from it; it goes at the end.
    universal = Path(root) / f"{tag}{UNIVERSAL_SUFFIX}"
    if dist.get_rank() == 0:
        shutil.rmtree(universal, ignore_errors=True)  # left by a crash during an earlier resume
        start = time.perf_counter()
        convert(universal)
        print(f"hpsft: {tag} {why}: converted to DeepSpeed's universal checkpoint in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    dist.barrier()
    load(root, universal.name)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(universal)


def load_universal_into_zero(ds_engine, load_native: NativeLoad, root: str, tag: str) -> None:
    """A universal checkpoint into DeepSpeed `ds_engine`'s ZeRO optimizer (DeepSpeed's own
    universal load, through `load_native`)."""
    torch_optimizer = ds_engine.optimizer.optimizer
    weight_decays = [group["weight_decay"] for group in torch_optimizer.param_groups]
    # DeepSpeed reads this flag of its config at load time only; it has no per-call argument.
    ds_engine._config.load_universal_checkpoint = True
    try:
        load_native(root, tag)
    finally:
        ds_engine._config.load_universal_checkpoint = False
    # Two slips of DeepSpeed 0.19.8's ZeRO-3 universal load, undone: every param group gets
    # the first group's hyperparameters (ours differ in weight decay only, see param_groups),
    # and every sub-group's state gets the same `step` tensor object, which torch's AdamW
    # then advances once per sub-group and step (wrong bias correction from the next step on).
    for group, weight_decay in zip(torch_optimizer.param_groups, weight_decays):
        group["weight_decay"] = weight_decay
    for state in torch_optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def load_universal_without_zero(ds_engine, load_native: NativeLoad, root: str, tag: str) -> None:
    """A universal checkpoint into DeepSpeed `ds_engine` without ZeRO (its optimizer is torch's
    AdamW). DeepSpeed loads universal checkpoints into ZeRO optimizers only: here its load
    (`load_native`) gives the LR scheduler and step counters, and the fp32 weights, AdamW
    moments, step and hyperparameters come from the per-parameter files. The module is not
    read from the model file: every trained weight is in those files (frozen ones are never
    saved), and a TP checkpoint's model file holds one TP rank's slices only."""
    load_native(root, tag, load_optimizer_states=False, load_module=False)
    saved = UniversalState(Path(root) / tag)
    names = {param: name for name, param in ds_engine.module.named_parameters()}
    optimizer = ds_engine.optimizer
    state, groups = {}, []
    for group, saved_group in zip(optimizer.param_groups, saved.param_groups(), strict=True):
        indices = []
        for param in group["params"]:
            name = names[param]
            with torch.no_grad():
                param.copy_(saved.tensor(name, "fp32").view_as(param))
            indices.append(len(state))
            state[len(state)] = {"step": saved.step(name)} | {
                key: saved.tensor(name, key).view_as(param) for key in MOMENTS}
        # The saved hyperparameters (lr, betas, eps, weight decay), this machine's implementation.
        implementation = {key: group[key] for key in ("foreach", "fused", "capturable") if key in group}
        groups.append(saved_group | implementation | {"params": indices})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
