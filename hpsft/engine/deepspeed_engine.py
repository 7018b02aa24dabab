"""DeepSpeed ZeRO (stages 0-3, CPU offload) behind the TrainEngine contract.

The number of micro-batches varies from step to step (token-budget batching), so the
DeepSpeed config says one micro-batch per step and the accumulation boundary is set by
hand before every backward. DeepSpeed averages gradients over data-parallel ranks; the
engine multiplies each loss by the dp size so that gradients are *sums*, and the caller
normalises (by the token count of the whole step) inside its loss.

With sequence parallelism every rank of an SP group holds the same weights and computes the
gradient of its own token slice: the step's gradient is the sum over *every* rank, so
DeepSpeed's data-parallel group here is the whole world (ZeRO shards its state over all
ranks too, as DeepSpeed's own sequence-data-parallel group does). `dp_size` below is that
group; the data-parallel size of sampling (world / SP) is the trainer's.

With tensor parallelism (DeepSpeed's AutoTP, docs/tensor_parallel.md) DeepSpeed shards each
decoder layer's linear weights over the TP group at initialize; its data-parallel group is then
world / TP (the ranks holding the same shard), over which it averages gradients: `dp_size`.
"""

import contextlib
import io
import math
import shutil
import time
from pathlib import Path
from typing import Iterator

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import CLIP_GRAD, DS_VERSION, PARAM, PARAM_GROUPS, UNIVERSAL_CHECKPOINT_INFO
from torch import nn

from hpsft.engine.base import TrainEngine

UNIVERSAL_SUFFIX = ".universal"
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's module file below ZeRO-3 (ZeRO-3 has one per rank)


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal, in this process (one worker: no process pool), quiet,
    without the `latest_universal` marker it also writes beside `out` (nothing reads it here)."""
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = Namespace(input_folder=str(checkpoint), output_folder=str(out), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal(args)
    (out.parent / "latest_universal").unlink()


def unsharded_to_universal(checkpoint: Path, out: Path, names: list[str], clip_grad: float) -> None:
    """A checkpoint written without ZeRO (its one model file holds the module and the whole
    torch AdamW state) in the layout ds_to_universal writes from ZeRO shards: per parameter
    zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt, the optimizer's hyperparameters in
    zero/optimizer_state.pt, and the model file (LR scheduler, step counters) beside them.
    `names`: the trainable parameters in the optimizer's order (param_groups). `clip_grad` is
    the ZeRO run's: DeepSpeed's ZeRO optimizer takes its clipping from the checkpoint."""
    model_file = checkpoint / MODEL_STATES
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
        folder = out / "zero" / name
        folder.mkdir(parents=True)
        torch.save({PARAM: weight}, folder / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state.get(key, torch.zeros_like(weight))
            if moment.shape != weight.shape:
                raise RuntimeError(f"{checkpoint}: {name} has {key} of shape {tuple(moment.shape)}, the weight "
                                   f"{tuple(weight.shape)}: not a checkpoint of this model")
            torch.save({PARAM: moment.float()}, folder / f"{key}.pt")
        if steps:
            torch.save(state.get("step", steps[0]), folder / "step.pt")
    torch.save({CLIP_GRAD: clip_grad, DS_VERSION: deepspeed.__version__, PARAM_GROUPS: optimizer["param_groups"]},
               out / "zero" / "optimizer_state.pt")
    shutil.copy2(model_file, out / MODEL_STATES)


def lr_lambda(total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float):
    """Linear warmup to the peak, then constant or cosine down to `min_lr_ratio`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D parameters)."""
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            ndim = len(getattr(param, "ds_shape", param.shape))  # a ZeRO-3 partitioned parameter is 1-D
            (decay if ndim >= 2 else no_decay).append(param)
    # An empty group is left out: DeepSpeed's ZeRO optimizer drops it, and the LR scheduler,
    # built on the torch optimizer's groups, would then count one group too many (LoRA adapters
    # are all 2-D: no group without decay).
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def frozen_names(module: nn.Module) -> set[str]:
    """Every name under which a frozen parameter appears in the state dict (a tied one under each)."""
    return {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}


@contextlib.contextmanager
def frozen_parameters_left_out(module: nn.Module):
    """While a checkpoint is saved, the module's state dict holds no frozen parameter: they are
    the base model's, read from model.path again on resume (the run fingerprint checks it
    is the same), and a LoRA checkpoint is then the adapters and their optimizer state only.
    DeepSpeed's own exclude_frozen_parameters misses a tied weight's second name (e.g. a frozen
    lm_head.weight tied to the embedding), which would store the whole embedding."""
    frozen = frozen_names(module)

    def drop_frozen(_module, state_dict, prefix, _local_metadata):
        for name in frozen:
            state_dict.pop(prefix + name, None)

    handle = module.register_state_dict_post_hook(drop_frozen)
    try:
        yield
    finally:
        handle.remove()


def load_trained_state(src: dict, dst: nn.Module) -> None:
    """Load a checkpoint's module state: every state entry but the frozen parameters, strictly."""
    result = dst.load_state_dict(src, strict=False)
    missing = set(result.missing_keys) - frozen_names(dst)
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint does not hold this model's trained state: missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(result.unexpected_keys)[:5]}")


NORM_BLOCK = 4096


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together, to fp64 accuracy at the cost of one fp32 pass.
    torch's fp32 norm of one large CPU tensor is a long running sum: off by 1.6e-3 relative on
    a 28M-element embedding gradient (SmolLM2's); DeepSpeed's ZeRO norm casts to fp64, which
    costs ~25x more here. Norms of 4096-element blocks are exact to fp32 rounding (2e-9
    relative on that tensor, same time) and are summed in fp64. The result is fp32, as the
    clip factor and the metric are."""
    squares = []
    for grad in grads:
        flat = grad.detach().reshape(-1)
        whole = flat.numel() // NORM_BLOCK * NORM_BLOCK
        if whole:
            blocks = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_BLOCK), dim=1)
            squares.append(blocks.double().square().sum())
        if whole < flat.numel():
            squares.append(torch.linalg.vector_norm(flat[whole:]).double().square())
    return torch.stack(squares).sum().sqrt().float() if squares else torch.zeros(())


def detached(outputs: dict) -> dict:
    return {name: value.detach() for name, value in outputs.items()}


# ZeRO 1-3 on GPUs (docs/performance.md, "GPU: communication"): stage 2 reduces each bucket of
# gradients on a side stream while backward goes on (DeepSpeed's default for stages 1-2 is to
# wait for it; stage 3 overlaps already); gradients copied into one contiguous buffer as they
# arrive; buckets of 2e8 elements (fp32: 800 MB; DeepSpeed's default 5e8), what common
# DeepSpeed setups use, so that the first reduction starts earlier in backward. bf16 ZeRO-1
# runs DeepSpeed's BF16_Optimizer, which reads only allgather_bucket_size of these.
GPU_ZERO_COMMUNICATION = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 200_000_000,
                          "allgather_bucket_size": 200_000_000}


class DeepSpeedEngine(TrainEngine):
    def __init__(self, engine_config, optim_config, total_steps: int):
        self.config = engine_config
        self.optim = optim_config
        self.total_steps = total_steps
        self.tp_size = engine_config.tensor_parallel_size
        self.engine = None
        # The GPU-only settings (deepspeed_config, build_optimizer) follow this; tests set it
        # to read the configuration a GPU run gets.
        self.on_cuda = torch.cuda.is_available()

    def zero_stage_to_run(self) -> int:
        """The stage DeepSpeed runs: engine.zero_stage, except that fp32 ZeRO-1/2 in one process
        runs without ZeRO. There ZeRO has nothing to partition, yet DeepSpeed's stage-1/2
        optimizer copies every gradient into its bucket and flat partition, flattens them
        again in step(), takes the norm over per-parameter views and copies the fp32 master
        weights back: ~1.6 s a step on SmolLM2-135M, 15-20 % of a 500-token step
        (docs/performance.md). Checkpoints then hold the whole AdamW state in one file; a run
        with ZeRO resumes them, and this one resumes ZeRO checkpoints, through DeepSpeed's
        universal layout (load_checkpoint). bf16 keeps its stage: its fp32 gradient
        accumulation and master weights are ZeRO's (docs/precision.md)."""
        one_process = dist.is_initialized() and dist.get_world_size() == 1
        if (self.config.zero_stage in (1, 2) and one_process and self.config.dtype == "float32"
                and not self.config.offload_optimizer):
            return 0
        return self.config.zero_stage

    @property
    def stage(self) -> int:
        """The ZeRO stage DeepSpeed runs (zero_stage_to_run)."""
        return self.zero_stage_to_run()

    def deepspeed_config(self) -> dict:
        zero = {"stage": self.stage}
        if self.on_cuda and self.stage > 0:
            zero.update(GPU_ZERO_COMMUNICATION)
        if self.config.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.on_cuda}
        if self.config.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": self.on_cuda}
        tensor_parallel = {"tensor_parallel": {"autotp_size": self.tp_size}} if self.tp_size > 1 else {}
        return tensor_parallel | {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # Without ZeRO the engine clips by the norm it reports (clip_unsharded_grads):
            # DeepSpeed's own clipping would take the norm a second time, plus a collective.
            "gradient_clipping": self.optim.grad_clip if self.stage > 0 else 0.0,
            "zero_optimization": zero,
            "bf16": {"enabled": self.config.dtype == "bfloat16"},
            # bf16 weights and activations, but gradients accumulated over micro-batches and
            # reduced over ranks in fp32 into fp32 master weights (DeepSpeed's default would do
            # both in bf16); docs/precision.md has what each ZeRO stage does with these.
            "data_types": {"grad_accum_dtype": "fp32"},
            "communication_data_type": "fp32",
            # We pass a torch AdamW: no JIT-built fused/cpu Adam op is needed on CPU machines.
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }

    def build_optimizer(self, module: nn.Module):
        groups = param_groups(module, self.optim.weight_decay)
        kwargs = {"lr": self.optim.lr, "betas": tuple(self.optim.betas), "eps": self.optim.eps}
        if self.config.offload_optimizer and self.on_cuda:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        # torch's fused AdamW, the same update on both devices: on CUDA one kernel launch per
        # group of tensors (torch's default there, foreach, is a chain of launches per step);
        # on CPU one vectorised pass per tensor, 5-14x faster than the default single-tensor
        # chain of passes on SmolLM2-135M (docs/packing.md).
        return torch.optim.AdamW(groups, fused=True, **kwargs)

    def initialize(self, module: nn.Module) -> None:
        optimizer = self.build_optimizer(module)
        warmup = int(self.optim.warmup_ratio * self.total_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(self.total_steps, warmup, self.optim.lr_scheduler, self.optim.min_lr_ratio)
        )
        config = self.deepspeed_config()
        if self.stage == 0 and self.config.zero_stage > 0:
            print(f"hpsft: engine.zero_stage={self.config.zero_stage} in one process runs without ZeRO: nothing to "
                  "partition (checkpoints hold the whole optimizer state and resume with any number of ranks)",
                  flush=True)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                                    config=config)
        if self.stage == 0 and self.dp_size == 1:
            # Without ZeRO DeepSpeed all-reduces at every step's last backward even alone: it
            # flattens all gradients into one new buffer and copies them back (1.2 s a step
            # on SmolLM2-135M, the largest fixed cost left, docs/performance.md) to average
            # over one rank, which changes nothing.
            self.engine.enable_backward_allreduce = False

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def to_device(self, micro_batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in micro_batch.items()}

    def train_batch(self, micro_batches, loss_fn) -> dict:
        self.engine.train()
        lr = self.engine.get_lr()[0]  # the rate this step uses (the scheduler moves in step())
        outputs = []
        for i, micro_batch in enumerate(micro_batches):
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            out = self.engine(**self.to_device(micro_batch))
            loss = loss_fn(out)
            self.engine.backward(loss * self.dp_size, scale_wrt_gas=False)
            outputs.append(detached(out))
        unsharded_norm = self.clip_unsharded_grads() if self.stage == 0 else None
        if unsharded_norm is not None and not math.isfinite(unsharded_norm):
            # ZeRO 1-3 skip a step whose gradient norm is NaN/Inf, leaving weights, optimizer
            # state and LR schedule as they were; without ZeRO DeepSpeed would apply it.
            self.engine.zero_grad()
        else:
            self.engine.step()
        grad_norm = self.engine.get_global_grad_norm() if unsharded_norm is None else unsharded_norm
        return {
            "outputs": outputs,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": lr,
        }

    def clip_unsharded_grads(self) -> float:
        """Without ZeRO the grads are whole (already all-reduced) on every rank: one pass takes
        the global norm, reported and clipped by (max_norm / (norm + 1e-6), as DeepSpeed clips),
        before step() clears them. A non-finite norm is returned unclipped."""
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        norm = global_grad_norm([p.grad for p in params])
        if self.optim.grad_clip > 0 and torch.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(params, self.optim.grad_clip, norm)
        return float(norm)

    @torch.no_grad()
    def infer_batch(self, micro_batches) -> list:
        self.engine.eval()
        return [detached(self.engine(**self.to_device(mb))) for mb in micro_batches]

    def save_checkpoint(self, root: str, tag: str) -> None:
        # ds_to_universal requires this key (model-parallel slicing patterns: none here).
        with frozen_parameters_left_out(self.engine.module):
            self.engine.save_checkpoint(root, tag=tag, client_state={UNIVERSAL_CHECKPOINT_INFO: {}},
                                        save_latest=False, exclude_frozen_parameters=True)

    def load_checkpoint(self, root: str, tag: str) -> None:
        """Load a checkpoint written with any data-parallel size, with or without ZeRO (below
        ZeRO-3). ZeRO 1-3 keep one optimizer shard per dp rank; without ZeRO one file holds the
        whole state. When the layouts differ the checkpoint is first converted to DeepSpeed's
        universal (per-parameter, dp-independent) form, then loaded from it."""
        folder = Path(root) / tag
        # One optimizer file per dp rank (and per TP rank under TP: mp_rank_0<t>); 0 without ZeRO.
        saved_dp_size = len(list(folder.glob("*mp_rank_00_optim_states.pt")))
        written_with_zero3 = bool(list(folder.glob("zero_pp_rank_*_model_states.pt")))
        if not (folder / MODEL_STATES).is_file() and not written_with_zero3:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' under {root}")
        if (self.stage == 0 and written_with_zero3) or (self.stage == 3 and not saved_dp_size):
            # DeepSpeed converts between ZeRO-3 and the other layouts only through its ZeRO-3
            # universal loader, which needs state a checkpoint without ZeRO never had.
            raise ValueError(f"{folder} was written {'with ZeRO-3' if written_with_zero3 else 'without ZeRO'} and "
                             f"this run has {'no ZeRO' if self.stage == 0 else 'ZeRO-3'}: resume it with the "
                             "engine.zero_stage it was written with")
        if self.stage == 0 and saved_dp_size:
            self.load_through_universal(root, tag, f"has {saved_dp_size} ZeRO shards and this run none",
                                        lambda out: to_universal(folder, out), self.load_universal_without_zero)
        elif self.stage > 0 and not saved_dp_size:
            names = {param: name for name, param in self.engine.module.named_parameters()}
            trained = [names[param] for group in param_groups(self.engine.module, 0.0) for param in group["params"]]
            self.load_through_universal(root, tag, f"was written without ZeRO and this run has ZeRO-{self.stage}",
                                        lambda out: unsharded_to_universal(folder, out, trained, self.optim.grad_clip),
                                        self.load_universal_into_zero)
        elif saved_dp_size in (0, self.dp_size):
            self.load_native_checkpoint(root, tag)
        else:
            self.load_through_universal(root, tag, f"has {saved_dp_size} ZeRO shards, this run {self.dp_size} ranks",
                                        lambda out: to_universal(folder, out), self.load_universal_into_zero)

    def load_native_checkpoint(self, root: str, tag: str, load_optimizer_states: bool = True) -> None:
        path, _ = self.engine.load_checkpoint(root, tag=tag, custom_load_fn=load_trained_state,
                                              load_optimizer_states=load_optimizer_states)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' under {root}")

    def load_through_universal(self, root: str, tag: str, why: str, convert, load) -> None:
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

    def load_universal_into_zero(self, root: str, tag: str) -> None:
        torch_optimizer = self.engine.optimizer.optimizer
        weight_decays = [group["weight_decay"] for group in torch_optimizer.param_groups]
        # DeepSpeed reads this flag of its config at load time only; it has no per-call argument.
        self.engine._config.load_universal_checkpoint = True
        try:
            self.load_native_checkpoint(root, tag)
        finally:
            self.engine._config.load_universal_checkpoint = False
        # Two slips of DeepSpeed 0.19.8's ZeRO-3 universal load, undone: every param group gets
        # the first group's hyperparameters (ours differ in weight decay only, see param_groups),
        # and every sub-group's state gets the same `step` tensor object, which torch's AdamW
        # then advances once per sub-group and step (wrong bias correction from the next step on).
        for group, weight_decay in zip(torch_optimizer.param_groups, weight_decays):
            group["weight_decay"] = weight_decay
        for state in torch_optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    def load_universal_without_zero(self, root: str, tag: str) -> None:
        """DeepSpeed loads universal checkpoints into ZeRO optimizers only: here its load gives
        the module, LR scheduler and step counters, and the fp32 weights, AdamW moments, step
        and hyperparameters come from the per-parameter files into torch's AdamW."""
        self.load_native_checkpoint(root, tag, load_optimizer_states=False)
        zero = Path(root) / tag / "zero"
        saved_groups = torch.load(zero / "optimizer_state.pt", weights_only=False)[PARAM_GROUPS]
        names = {param: name for name, param in self.engine.module.named_parameters()}
        optimizer = self.engine.optimizer
        state, groups = {}, []
        for group, saved_group in zip(optimizer.param_groups, saved_groups, strict=True):
            indices = []
            for param in group["params"]:
                files = zero / names[param]
                with torch.no_grad():
                    param.copy_(torch.load(files / "fp32.pt", weights_only=True)[PARAM].view_as(param))
                indices.append(len(state))
                state[len(state)] = {"step": torch.load(files / "step.pt", weights_only=True)} | {
                    key: torch.load(files / f"{key}.pt", weights_only=True)[PARAM].view_as(param)
                    for key in ("exp_avg", "exp_avg_sq")}
            # The saved hyperparameters (lr, betas, eps, weight decay), this machine's implementation.
            implementation = {key: group[key] for key in ("foreach", "fused", "capturable") if key in group}
            groups.append(saved_group | implementation | {"params": indices})
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def gathered(self, params: list[nn.Parameter]):
        """A context in which these parameters are whole on every rank (a collective under
        ZeRO-3, which partitions them; nothing to do otherwise)."""
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        if self.stage == 3 and partitioned:
            return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
        if self.tp_size > 1:  # AutoTP's shards, gathered over the TP group (replicated ones: nothing to do)
            from deepspeed.module_inject.layers import GatherReplacedLayerParams

            return GatherReplacedLayerParams(params, module=None, enabled=True)
        return contextlib.nullcontext()

    def gathered_tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        # Under ZeRO-3 each parameter is gathered alone (every rank takes part, each holds one
        # whole parameter at a time) and rank 0 copies it: no rank ever holds the whole model.
        module = self.engine.module
        tensors = dict(module.named_parameters())
        tensors.update(module.named_buffers())
        for name in names:
            tensor = tensors[name]
            with self.gathered([tensor]):
                yield name, tensor.detach().cpu().clone() if dist.get_rank() == 0 else None

    # DeepSpeed's data-parallel group: the whole world (SP included, see above), or under
    # tensor parallelism the ranks of the same TP coordinate (its mesh: TP groups are runs of
    # consecutive ranks).
    @property
    def dp_rank(self) -> int:
        return dist.get_rank() // self.tp_size

    @property
    def dp_size(self) -> int:
        return dist.get_world_size() // self.tp_size

    @property
    def dp_group(self):
        return self.engine.data_parallel_group if self.tp_size > 1 else dist.group.WORLD
