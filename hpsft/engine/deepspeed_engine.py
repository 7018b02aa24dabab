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
With sequence parallelism as well that group holds every DP and SP rank of the shard
(distributed.Mesh puts SP groups inside it), so the average is over both, as SP needs.

Under bf16 ZeRO-1 DeepSpeed's BF16_Optimizer keeps an fp32 gradient of every parameter, to
which each backward adds the bf16 `param.grad`. There the fused loss sums d(lm_head.weight) in
fp32 straight into that gradient during its forward (head_gradient_into: no bf16 (V, H)
gradient, and no bf16 rounding of it), when the caller says how the loss scales the module's
(`loss_weight`); docs/ops.md, "Where d(weight) goes, and when".
"""

import contextlib
import functools
import math
from pathlib import Path
from typing import Iterator

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.utils import groups
from torch import nn

from hpsft.engine.base import TrainEngine
from hpsft.engine.grad_norm import global_grad_norm
from hpsft.engine.optimizer import adamw, lr_scheduler, param_groups
from hpsft.models.tensor_parallel import ShardingCheck, sum_partial_gradients_over_tp
from hpsft.engine.universal import (MODEL_STATES, load_through_universal, load_universal_into_zero,
                                    load_universal_without_zero, to_universal, to_universal_without_zero,
                                    unsharded_to_universal)


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

    def build_optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        # ZeRO-Offload on a GPU machine steps on the host: DeepSpeed's CPU Adam there.
        return adamw(module, self.optim, cpu_adam=self.config.offload_optimizer and self.on_cuda)

    def initialize(self, module: nn.Module) -> None:
        optimizer = self.build_optimizer(module)
        scheduler = lr_scheduler(optimizer, self.optim, self.total_steps)
        config = self.deepspeed_config()
        if self.stage == 0 and self.config.zero_stage > 0:
            print(f"hpsft: engine.zero_stage={self.config.zero_stage} in one process runs without ZeRO: nothing to "
                  "partition (checkpoints hold the whole optimizer state and resume with any number of ranks)",
                  flush=True)
        whole = ShardingCheck.of(module) if self.tp_size > 1 else None  # before AutoTP shards it
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                                    config=config)
        if self.tp_size > 1:
            group = groups.get_tensor_model_parallel_group()
            sum_partial_gradients_over_tp(self.engine.module, group)
            worst = whole.verify(self.engine.module, group)
            if dist.get_rank() == 0:
                print(f"hpsft: tensor parallel: the sharded model's loss and gradient norms on the start-up check's "
                      f"row are the whole model's within {worst:.1e}", flush=True)
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

    def head_gradient_into(self) -> tuple[torch.Tensor, int, int] | None:
        """BF16_Optimizer's fp32 gradient of the LM-head weight as a (V, H) tensor, with its
        (group, index) there, when the fused loss can sum d(weight) into it exactly; else None.

        Exactly: DeepSpeed keeps that gradient whole on every rank (ZeRO-1 partitions the
        optimizer state, not the gradients), every backward's epilogue adds the bf16
        `param.grad` into it (a tied embedding's own gradient, after the loss's forward-time
        sum), the boundary's all-reduce averages it with the rest over the dp group, and
        step() clips, applies and zeroes it (also when it skips a non-finite step). Other
        engines keep `param.grad` as the only gradient until their hooks take it, and under
        tensor or sequence parallelism (not checked for this) the gradient goes through
        autograd as before."""
        optimizer = self.engine.optimizer
        if (not isinstance(optimizer, BF16_Optimizer) or optimizer.grad_acc_dtype != torch.float32
                or self.tp_size > 1 or self.config.sequence_parallel_size > 1):
            return None
        weight = self.engine.module.head_weight
        for group_index, group in enumerate(optimizer.bf16_groups):
            for index, param in enumerate(group):
                if param is weight:
                    return optimizer.fp32_groups_gradients[group_index][index].view(weight.shape), group_index, index
        return None  # a frozen head (LoRA): no gradient to sum

    def train_batch(self, micro_batches, loss_fn, sequence_nll: bool = False, loss_weight: float | None = None) -> dict:
        self.engine.train()
        lr = self.engine.get_lr()[0]  # the rate this step uses (the scheduler moves in step())
        head_gradient = self.head_gradient_into() if loss_weight is not None else None
        head = {}
        if head_gradient is not None:
            # The upstream gradient the loss will receive: backward below multiplies the loss by
            # dp_size and DeepSpeed then averages over dp (BF16_Optimizer has no loss scaling,
            # and scale_wrt_gas=False: no division by accumulation steps).
            head = {"head_grad_into": head_gradient[0], "loss_grad_scale": loss_weight * self.dp_size}
        # Every micro-batch's copy is queued before the first forward: from pinned rows
        # (data/device_feed.py) the host waits for none of them, and micro-batch i+1's input
        # is on the device before micro-batch i's compute ends (a few bytes a token).
        on_device = [self.to_device(micro_batch) for micro_batch in micro_batches]
        outputs = []
        for i, micro_batch in enumerate(on_device):
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            out = self.engine(**micro_batch, sequence_nll=sequence_nll, **head)
            if head_gradient is not None:
                self.mark_head_gradient(*head_gradient)
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

    def mark_head_gradient(self, gradient: torch.Tensor, group_index: int, index: int) -> None:
        """Tell BF16_Optimizer that the head weight's fp32 gradient holds a gradient, as its own
        backward epilogue does for a `param.grad` it adds (an untied head now has none): else
        its gradient norm would leave it out."""
        self.engine.optimizer.fp32_groups_has_gradients[group_index][index] = True
        self.engine.module.head_weight._hp_grad = gradient.view(-1)

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
        return [detached(self.engine(**self.to_device(mb), per_sequence=True)) for mb in micro_batches]

    def save_checkpoint(self, root: str, tag: str) -> None:
        # ds_to_universal requires this key: without TP no model-parallel slicing patterns; under
        # AutoTP DeepSpeed writes its own (which parameters are row- or column-parallel, which
        # replicated), and this key in client_state would overwrite them.
        client_state = {} if self.tp_size > 1 else {UNIVERSAL_CHECKPOINT_INFO: {}}
        with frozen_parameters_left_out(self.engine.module):
            self.engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False,
                                        exclude_frozen_parameters=True)

    def load_checkpoint(self, root: str, tag: str) -> None:
        """Load a checkpoint written with any data-parallel size, with or without ZeRO (below
        ZeRO-3), and with any tensor-parallel size. ZeRO 1-3 keep one optimizer shard per dp
        rank; without ZeRO one file holds the whole state; AutoTP one model file per TP rank.
        When the layouts differ the checkpoint is first converted to DeepSpeed's universal
        (per-parameter, dp- and tp-independent: the TP slices merged) form, then loaded from it."""
        folder = Path(root) / tag
        # One optimizer file per dp rank (and per TP rank under TP: mp_rank_0<t>); 0 without ZeRO.
        saved_dp_size = len(list(folder.glob("*mp_rank_00_optim_states.pt")))
        saved_tp_size = len(list(folder.glob("mp_rank_*_model_states.pt"))) or 1  # ZeRO-3: none (no TP with it)
        written_with_zero3 = bool(list(folder.glob("zero_pp_rank_*_model_states.pt")))
        if not (folder / MODEL_STATES).is_file() and not written_with_zero3:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' under {root}")
        if (self.stage == 0 and written_with_zero3) or (self.stage == 3 and not saved_dp_size):
            # DeepSpeed converts between ZeRO-3 and the other layouts only through its ZeRO-3
            # universal loader, which needs state a checkpoint without ZeRO never had.
            raise ValueError(f"{folder} was written {'with ZeRO-3' if written_with_zero3 else 'without ZeRO'} and "
                             f"this run has {'no ZeRO' if self.stage == 0 else 'ZeRO-3'}: resume it with the "
                             "engine.zero_stage it was written with")
        # The loads from a universal folder (engine/universal.py), through this engine's native load.
        into_zero = functools.partial(load_universal_into_zero, self.engine, self.load_native_checkpoint)
        without_zero = functools.partial(load_universal_without_zero, self.engine, self.load_native_checkpoint)
        if self.stage == 0 and saved_dp_size:
            load_through_universal(root, tag, f"has {saved_dp_size} ZeRO shards and this run none",
                                   lambda out: to_universal_without_zero(folder, out), without_zero)
        elif self.stage > 0 and not saved_dp_size:
            names = {param: name for name, param in self.engine.module.named_parameters()}
            trained = [names[param] for group in param_groups(self.engine.module, 0.0) for param in group["params"]]
            load_through_universal(root, tag, f"was written without ZeRO and this run has ZeRO-{self.stage}",
                                   lambda out: unsharded_to_universal(folder, out, trained, self.optim.grad_clip),
                                   into_zero)
        elif saved_dp_size in (0, self.dp_size) and saved_tp_size == self.tp_size:
            self.load_native_checkpoint(root, tag)
        else:
            layouts = (f"has {saved_dp_size} ZeRO shards, this run {self.dp_size} ranks"
                       if saved_tp_size == self.tp_size == 1 else
                       f"has {saved_dp_size} ZeRO shards x {saved_tp_size} TP ranks, this run {self.dp_size} x "
                       f"{self.tp_size}")
            load_through_universal(root, tag, layouts, lambda out: to_universal(folder, out), into_zero)

    def load_native_checkpoint(self, root: str, tag: str, load_optimizer_states: bool = True,
                               load_module: bool = True) -> None:
        """DeepSpeed's own load; without `load_module` the module's weights are left as they are
        (the caller sets them)."""
        load_module_state = load_trained_state if load_module else lambda src, dst: None
        path, _ = self.engine.load_checkpoint(root, tag=tag, custom_load_fn=load_module_state,
                                              load_optimizer_states=load_optimizer_states)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' under {root}")

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

    @property
    def steps(self) -> int:
        return self.engine.global_steps

    def partitioned_init_config(self) -> dict | None:
        """Under ZeRO-3 the config deepspeed.zero.Init builds the model with (the one the engine
        then runs): no rank ever holds the whole model."""
        return self.deepspeed_config() if self.stage == 3 else None

    # DeepSpeed's data-parallel group: the whole world (SP included, see above), or under
    # tensor parallelism the ranks of the same TP coordinate (its mesh: TP groups are runs of
    # consecutive ranks); its gradient average is undone by this factor in train_batch.
    @property
    def dp_size(self) -> int:
        return dist.get_world_size() // self.tp_size
