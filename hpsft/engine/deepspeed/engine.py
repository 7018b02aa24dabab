"""DeepSpeed ZeRO (stages 0-3, CPU offload) behind the TrainEngine contract: the train step.

The DeepSpeed config says one micro-batch per step (config.py) and the accumulation boundary
is set by hand before every backward. DeepSpeed averages gradients over its data-parallel
group; the engine multiplies each loss by that group's size so that gradients are *sums*, and
the caller normalises (by the token count of the whole step) inside its loss.

With sequence parallelism every rank of an SP group holds the same weights and computes the
gradient of its own token slice: the step's gradient is the sum over *every* rank, so
DeepSpeed's data-parallel group here is the whole world (ZeRO shards its state over all
ranks too, as DeepSpeed's own sequence-data-parallel group does). With tensor parallelism
(DeepSpeed's AutoTP, docs/tensor_parallel.md) DeepSpeed shards each decoder layer's linear
weights over the TP group at initialize; its data-parallel group is then the ranks holding the
same shard, every DP and SP rank of one TP coordinate (distributed.Mesh puts SP groups inside
it), over which it averages gradients, as SP needs: that group is `dp_size` below, the mesh's
weight_replicas (DP x SP). The data-parallel size of sampling (DP) is the trainer's.

Checkpoints: checkpoint.py (save, and load from any layout), layout.py (DeepSpeed's files),
universal.py (conversions across layouts), weights.py (the weights alone, for export).
"""

import contextlib
import json
import math
from pathlib import Path
from typing import Iterator, Mapping

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import groups
from torch import nn

from hpsft.engine.base import EngineStep, TrainEngine, detached
from hpsft.engine.deepspeed import checkpoint
from hpsft.engine.deepspeed.config import deepspeed_config, zero_stage_to_run
from hpsft.engine.deepspeed.head_gradient import HeadGradient
from hpsft.engine.deepspeed.layout import Layout
from hpsft.engine.deepspeed.weights import fp32_weights
from hpsft.engine.grad_norm import global_grad_norm
from hpsft.engine.optimizer import adamw, lr_scheduler
from hpsft.models.tensor_parallel import ShardingCheck, sum_partial_gradients_over_tp
from hpsft.models.vocab_parallel_head import shard_vocabulary, vocab_rows_of, whole_vocabulary_weight
from hpsft.utils.distributed import Mesh, tensor_parallel_group


def copied(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor`, bit for bit. Not `clone()`: torchao's NF4Tensor (QLoRA's base weights)
    implements clone as a re-quantisation with its default block sizes (64, 256), which fails
    on (or changes) weights quantised with others."""
    return torch.empty_like(tensor).copy_(tensor)


class DeepSpeedEngine(TrainEngine):
    def __init__(self, engine_config, optim_config, total_steps: int, mesh: Mesh):
        self.config = engine_config
        self.optim = optim_config
        self.total_steps = total_steps
        self.mesh = mesh
        self.tp_size = mesh.tp_size
        self.engine = None  # DeepSpeed's, from initialize
        self.head_weight: nn.Parameter | None = None  # the fused loss's LM-head weight, from initialize
        # The GPU-only settings (deepspeed_config, build_optimizer) follow this; tests set it
        # to read the configuration a GPU run gets.
        self.on_cuda = torch.cuda.is_available()

    def zero_stage_to_run(self) -> int:
        """The ZeRO stage DeepSpeed runs (config.zero_stage_to_run)."""
        return zero_stage_to_run(self.config, one_process=self.mesh.world_size == 1)

    @property
    def stage(self) -> int:
        return self.zero_stage_to_run()

    def deepspeed_config(self) -> dict:
        return deepspeed_config(self.config, self.optim, self.stage, self.tp_size, self.on_cuda)

    @contextlib.contextmanager
    def model_init(self):
        """Under ZeRO-3 the model is built partitioned (deepspeed.zero.Init, with the config the
        engine then runs): no rank ever holds the whole model. transformers'
        prevent_arange_dtype_change keeps the rotary frequencies in the dtype their code asks for
        (it must be entered before zero.Init)."""
        if self.stage != 3:
            yield False
            return
        from transformers.integrations.deepspeed import prevent_arange_dtype_change

        with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=self.deepspeed_config()):
            yield True

    def build_optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        # ZeRO-Offload on a GPU machine steps on the host: DeepSpeed's CPU Adam there.
        return adamw(module, self.optim, cpu_adam=self.config.offload_optimizer and self.on_cuda)

    def initialize(self, module: nn.Module, head_weight: nn.Parameter | None = None) -> None:
        self.head_weight = head_weight
        whole = ShardingCheck.of(module) if self.tp_size > 1 else None  # before AutoTP shards it
        if self.config.vocab_parallel_head:
            # hpsft's own TP group (the same ranks as DeepSpeed's, which initialize builds later):
            # the optimizer must be built on the vocabulary shards.
            shard_vocabulary(module, tensor_parallel_group(self.mesh))
            self.head_weight = None  # the whole-head fp32 gradient path (head_gradient) is off under TP anyway
        optimizer = self.build_optimizer(module)
        scheduler = lr_scheduler(optimizer, self.optim, self.total_steps)
        config = self.deepspeed_config()
        if self.stage == 0 and self.config.zero_stage > 0:
            print(f"hpsft: engine.zero_stage={self.config.zero_stage} in one process runs without ZeRO: nothing to "
                  "partition (checkpoints hold the whole optimizer state and resume with any number of ranks)",
                  flush=True)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                                    config=config)
        if self.config.vocab_parallel_head:
            checkpoint.record_vocabulary_shards(self.engine.module)
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
        """The model as DeepSpeed holds it (moved, cast, sharded)."""
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def to_device(self, micro_batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in micro_batch.items()}

    def head_gradient(self) -> HeadGradient | None:
        """Where the fused loss may sum the head weight's gradient (head_gradient.py); None under
        tensor or sequence parallelism, where it goes through autograd."""
        if self.head_weight is None or self.tp_size > 1 or self.mesh.sp_size > 1:
            return None
        return HeadGradient.of(self.engine.optimizer, self.head_weight)

    def train_batch(self, micro_batches, loss_fn, sequence_nll: bool = False,
                    loss_weight: float | None = None) -> EngineStep:
        self.engine.train()
        lr = self.engine.get_lr()[0]  # the rate this step uses (the scheduler moves in step())
        head_gradient = self.head_gradient() if loss_weight is not None else None
        head = {}
        if head_gradient is not None:
            # The upstream gradient the loss will receive: backward below multiplies the loss by
            # dp_size and DeepSpeed then averages over dp (BF16_Optimizer has no loss scaling,
            # and scale_wrt_gas=False: no division by accumulation steps).
            head = {"head_grad_into": head_gradient.into, "loss_grad_scale": loss_weight * self.dp_size}
        # Every micro-batch's copy is queued before the first forward: from pinned rows
        # (data/device_feed.py) the host waits for none of them, and micro-batch i+1's input
        # is on the device before micro-batch i's compute ends (a few bytes a token).
        on_device = [self.to_device(micro_batch) for micro_batch in micro_batches]
        outputs = []
        for i, micro_batch in enumerate(on_device):
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            out = self.engine(**micro_batch, sequence_nll=sequence_nll, **head)
            if head_gradient is not None:
                head_gradient.mark(self.engine.optimizer, self.head_weight)
            loss = loss_fn(out)
            self.engine.backward(loss * self.dp_size, scale_wrt_gas=False)
            outputs.append(detached(out))
        unsharded_norm = self.clip_unsharded_grads() if self.stage == 0 else None
        if unsharded_norm is not None and not math.isfinite(unsharded_norm):
            # ZeRO 1-3 skip a step whose gradient norm is NaN/Inf, leaving weights, optimizer
            # state and LR schedule as they were; without ZeRO DeepSpeed would apply it. Counted
            # as DeepSpeed counts a step ZeRO skips (`steps` stays the trainer's step).
            self.engine.zero_grad()
            self.engine.global_steps += 1
            self.engine.skipped_steps += 1
        else:
            self.engine.step()
        grad_norm = self.engine.get_global_grad_norm() if unsharded_norm is None else unsharded_norm
        return EngineStep(outputs=outputs, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                          lr=lr)

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

    def layout(self) -> Layout:
        """How this run writes its checkpoints (and reads them natively)."""
        return Layout(zero_shards=self.dp_size if self.stage > 0 else 0, tp_size=self.tp_size, zero3=self.stage == 3)

    def save_checkpoint(self, root: str, tag: str) -> None:
        checkpoint.save(self.engine, root, tag, self.tp_size)
        if self.config.vocab_parallel_head and dist.get_rank() == 0:
            (Path(root) / tag / checkpoint.VOCAB_PARALLEL_HEAD).write_text(
                json.dumps({"tensor_parallel_size": self.tp_size}) + "\n")

    def load_checkpoint(self, root: str, tag: str) -> None:
        """A checkpoint written with any data-parallel size, with or without ZeRO (below
        ZeRO-3), and with any tensor-parallel size (checkpoint.load)."""
        checkpoint.load(self.engine, root, tag, self.layout(), self.stage, self.optim.grad_clip,
                        self.config.vocab_parallel_head)

    @classmethod
    def checkpoint_weights(cls, folder: Path, scratch: Path) -> Mapping[str, torch.Tensor] | None:
        return fp32_weights(folder, scratch)

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
            if vocab_rows_of(tensor) is not None:  # the vocabulary-parallel head's rows, over the TP group
                whole = whole_vocabulary_weight(tensor)
                yield name, copied(whole.cpu()) if dist.get_rank() == 0 else None
                continue
            with self.gathered([tensor]):
                yield name, copied(tensor.detach().cpu()) if dist.get_rank() == 0 else None

    @property
    def steps(self) -> int:
        return self.engine.global_steps

    # DeepSpeed's data-parallel group: the whole world (SP included, see above), or under
    # tensor parallelism the ranks of the same TP coordinate (its mesh: TP groups are runs of
    # consecutive ranks); its gradient average is undone by this factor in train_batch.
    @property
    def dp_size(self) -> int:
        return self.mesh.weight_replicas
