"""Megatron-Core behind the TrainEngine contract (engine.name: megatron; docs/megatron.md).

The worker builds the Hugging Face model whole, as for the DeepSpeed engine below ZeRO-3, and
checks hpsft's packed path on it; initialize() then initialises Megatron's parallel_state in the
start-up Mesh's layout (TP x PP x EP, DP the rest, the same rank order), builds this rank's
GPTModel stage and shard (model.py), copies the Hugging Face weights into it (convert.py) and
checks it against the Hugging Face model (check_against). The Hugging Face model is kept (the
worker's export names and config; not yet released after the copy: on a large model that is a
second copy in host memory, docs/megatron.md). Megatron's
DistributedDataParallel (fp32 gradient buffers) and distributed optimizer (Adam, fp32 master
weights sharded over DP) train it.

A step runs Megatron's schedule (get_forward_backward_func: 1F1B under PP) over the worker's
packed micro-batches, one THD row each; on the last stage the loss is hpsft's
vocabulary-parallel fused loss on the final hidden states and this TP rank's LM-head shard,
giving the same loss terms as PackedCausalLM (packed_causal_lm.row_terms), and the worker's
loss_fn (already divided by the step's global loss tokens) is what is back-propagated:
Megatron's per-token division is turned off (summed_grads), so the gradient is the sum over
micro-batches and DP ranks, as the contract says. The step itself (optimizer_step) is
ChainedOptimizer.step's parts with hpsft's rules: the unclipped global norm, a non-finite norm
skips the step (counted), clipping by max_norm / (norm + 1e-6), the LR schedule and the
weight-decay groups (none on 1-D weights) set on the groups before each step.

Checkpoints (checkpoint.py) are per rank and resume at the same layout; hpsft export reads
them in one process into whole Hugging Face tensors.
"""

import contextlib
import math
from functools import partial
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from hpsft.data.batch import IGNORE_INDEX, shifted_labels
from hpsft.engine.base import EngineStep, TrainEngine, detached
from hpsft.engine.megatron import checkpoint
from hpsft.engine.optimizer import lr_lambda, warmup_steps
from hpsft.utils.distributed import Mesh
from hpsft.utils.errors import UserInputError


def summed_grads(model, num_tokens=None, **kwargs):
    """Megatron's finalize_model_grads (the DP reduction, the tied-embedding and q/k-norm sums)
    without its division by the step's token count: hpsft's loss_fn has divided already."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, **kwargs)


class MegatronEngine(TrainEngine):
    def __init__(self, engine_config, optim_config, total_steps: int, mesh: Mesh):
        self.config = engine_config
        self.optim = optim_config
        self.total_steps = total_steps
        self.mesh = mesh
        self.lr_factor = lr_lambda(total_steps, warmup_steps(optim_config, total_steps), optim_config.lr_scheduler,
                                   optim_config.min_lr_ratio)
        self.taken = 0  # optimizer steps, skipped ones included (the trainer's step count)
        self.updates = 0  # the steps applied: the LR schedule's position (a skipped step does not move it)
        self.model = None  # this rank's GPTModel inside Megatron's DDP, from initialize
        self.optimizer = None
        self.loss_options = None

    def model_init(self):
        """The Hugging Face model is built whole on every rank (initialize copies it into Megatron's)."""
        return contextlib.nullcontext(False)

    def initialize(self, module: nn.Module, head_weight: nn.Parameter | None = None) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from hpsft.engine.megatron import convert, model as mmodel

        lm = module.lm
        self.hf_config = lm.config  # written beside the checkpoints, for export
        side = module.output_side
        if side.softcap or side.hidden_scale != 1.0:
            raise UserInputError(f"{type(lm).__name__}: its logit soft-cap / hidden scaling is not on the Megatron "
                                 "engine's loss path; use engine.name=deepspeed")
        mesh = self.mesh
        mmodel.initialize_model_parallel(mesh.tp_size, mesh.pp_size, mesh.ep_size)
        # Megatron's groups must be the start-up Mesh's: the worker hands out rows by it.
        theirs = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                  ps.get_data_parallel_rank())
        if theirs != (mesh.tp_rank, mesh.pp_rank, mesh.dp_rank):
            raise RuntimeError(f"Megatron's (tp, pp, dp) ranks {theirs} are not the mesh's "
                               f"{(mesh.tp_rank, mesh.pp_rank, mesh.dp_rank)} ({mesh.coordinates()})")
        dtype = torch.bfloat16 if self.config.dtype == "bfloat16" else torch.float32
        model = mmodel.build_model(lm.config, dtype)
        hf = dict(module.named_parameters())
        convert.load_hf_weights(model, lambda name: hf[name].detach())
        self.loss_options = dict(backend=module.loss_backend, z_loss_weight=module.z_loss_weight,
                                 label_smoothing=module.label_smoothing)
        self.token_accuracy = module.token_accuracy
        self.router_aux_loss_coef = side.router_aux_loss_coef if side.router_aux_loss is not None else 0.0
        self.router_logits = mmodel.RouterLogits(model) if self.router_aux_loss_coef else None
        self.model = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
        model.config.finalize_model_grads_func = summed_grads
        model.config.no_sync_func = self.model.no_sync
        optim = self.optim
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
            adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.grad_clip,
            bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=True), [self.model])
        self.check_against(lm)

    @property
    def module(self):
        return self.model.module

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def steps(self) -> int:
        return self.taken

    def to_device(self, row: dict) -> dict:
        row = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in row.items()}
        if "labels" not in row:
            row["labels"] = shifted_labels(row["input_ids"][0], row["loss_mask"], row["offsets"])
        return row

    def head_loss(self, row: dict, hidden: torch.Tensor, reduction: str, return_correct: bool = False):
        """The vocabulary-parallel fused loss of a row from the last stage's final hidden states
        [T, 1, H] on this TP rank's LM-head shard (its partial d(hidden) summed over TP in
        backward), with the row's per-position log-probabilities."""
        from megatron.core import parallel_state as ps

        from hpsft.engine.megatron.model import head_shard
        from hpsft.ops import varlen_linear_cross_entropy
        from hpsft.ops.vocab_parallel import sum_grad_over_tp

        head = head_shard(self.module)
        tp = ps.get_tensor_model_parallel_group()
        return varlen_linear_cross_entropy(
            sum_grad_over_tp(hidden[:, 0], tp), head.weight, labels=row["labels"], ignore_index=IGNORE_INDEX,
            reduction=reduction, return_logprobs=True, return_correct=return_correct, tp_group=tp,
            vocab_start=head.vocab_start, vocab_size=head.vocab_size, **self.loss_options)

    def row_terms(self, row: dict, hidden: torch.Tensor, per_sequence: bool = False,
                  sequence_nll: bool = False) -> dict:
        """PackedCausalLM.forward's terms of a row (packed_causal_lm.row_terms) from head_loss."""
        from hpsft.engine.megatron.model import router_aux_loss
        from hpsft.models.packed_causal_lm import row_terms

        labels = row["labels"]
        if per_sequence:
            return row_terms(self.head_loss(row, hidden, "none"), labels, row["offsets"], per_sequence=True)
        out = self.head_loss(row, hidden, "sum", return_correct=self.token_accuracy)
        aux = None
        if row["router_logits"] is not None:
            aux = router_aux_loss(self.module.hf_architecture, row["router_logits"])
        correct = int(out.correct.sum()) if self.token_accuracy else -1
        return row_terms(out, labels, row["offsets"], sequence_nll=sequence_nll, router_aux_loss=aux,
                         router_aux_loss_coef=self.router_aux_loss_coef, correct=correct)

    def run_schedule(self, rows: list[dict], loss_func, forward_only: bool) -> list:
        """Megatron's schedule over `rows`, one micro-batch each. loss_func(row, hidden) on the
        last stage (the row with its forward's "router_logits": RouterLogits.take(), or None)
        returns (what is back-propagated, a count Megatron would divide by and summed_grads
        ignores, what to report); the reports in order there, [] elsewhere."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from hpsft.engine.megatron.model import forward_packed_row

        def forward_step(data_iterator, model):
            row = next(data_iterator)
            hidden = forward_packed_row(model, row["input_ids"], row["offsets"], row["max_length"])
            # Every forward's router logits are taken here, whether its loss uses them or not (the
            # start-up check's and validation's were once left to join the next training row's).
            router_logits = self.router_logits.take() if self.router_logits is not None else None
            return hidden, partial(loss_func, {**row, "router_logits": router_logits})

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(rows), model=[self.model], num_microbatches=len(rows),
            seq_length=max(r["input_ids"].shape[1] for r in rows), micro_batch_size=1, forward_only=forward_only)

    def train_batch(self, micro_batches, loss_fn, sequence_nll: bool = False,
                    loss_weight: float | None = None) -> EngineStep:
        self.model.train()
        lr = self.set_schedule()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        def loss_func(row, hidden):
            terms = self.row_terms(row, hidden, sequence_nll=sequence_nll)
            return loss_fn(terms), torch.ones((), dtype=torch.int), detached(terms)

        outputs = self.run_schedule([self.to_device(mb) for mb in micro_batches], loss_func, forward_only=False)
        grad_norm = self.optimizer_step()
        self.taken += 1
        self.updates += math.isfinite(grad_norm)
        return EngineStep(outputs=outputs, grad_norm=grad_norm, lr=lr)

    def set_schedule(self) -> float:
        """This step's LR (hpsft's schedule) and weight decay (none on 1-D weights: Megatron's
        groups carry wd_mult 0 for them) on every parameter group; the LR."""
        lr = self.optim.lr * self.lr_factor(self.updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.optim.weight_decay * group["wd_mult"]
        return lr

    def optimizer_step(self) -> float:
        """ChainedOptimizer.step's parts: the gradients to the fp32 master shards, the unclipped
        global norm (over every rank's shards, each parameter counted once), a non-finite one
        skipping the step, else clipping and the update (the new weights all-gathered over DP)."""
        optimizer = self.optimizer
        optimizer.prepare_grads()
        norm = float(optimizer.get_grad_norm())
        if not math.isfinite(norm):
            optimizer.zero_grad()
            return norm
        clip = self.optim.grad_clip / (norm + 1e-6)
        if self.optim.grad_clip > 0 and clip < 1.0:
            # Megatron's clip_grad_by_total_norm_fp32 is CUDA-only (multi_tensor_applier): the
            # same scaling, once per master parameter (a shared one is listed once).
            grads = {id(p): p.grad for chained in optimizer.chained_optimizers for p in chained.get_parameters()
                     if p.grad is not None}
            torch._foreach_mul_(list(grads.values()), clip)
        optimizer.step_with_ready_grads()
        return norm

    @torch.no_grad()
    def infer_batch(self, micro_batches) -> list:
        self.model.eval()
        rows = [self.to_device(mb) for mb in micro_batches]
        def terms_of(row, hidden):
            terms = self.row_terms(row, hidden, per_sequence=True)
            return hidden.new_zeros(()), torch.ones((), dtype=torch.int), detached(terms)

        outputs = self.run_schedule(rows, terms_of, forward_only=True)
        if outputs:
            return outputs
        # Not the last stage: no terms here (the last stage's rank reports them, Mesh.reports_counts).
        return [{"nll": torch.zeros(r["offsets"].numel() - 1, dtype=torch.float64),
                 "n_tokens": torch.zeros(r["offsets"].numel() - 1, dtype=torch.int64)} for r in rows]

    @torch.no_grad()
    def check_against(self, lm: nn.Module) -> None:
        """Refuse to train unless this layout's model computes the Hugging Face model: the
        start-up check row's next-token log-probabilities from the Megatron model (its loss path)
        against the Hugging Face model's eager forward on each sequence alone, within the
        weights' dtype's tolerance (packed_causal_lm.verify_packed_training's rule). Computed on
        the last stage and shared with every rank."""
        from megatron.core import parallel_state as ps

        from hpsft.data.batch import target_mask
        from hpsft.models.packed_causal_lm import TOLERANCE, check_row, eager_reference_logprobs

        sequences, row = check_row(lm, vocab=lm.config.vocab_size)
        row = self.to_device(row)
        self.model.eval()
        error = torch.zeros((), dtype=torch.float64)
        logprobs = {}

        def keep_logprobs(row, hidden):
            logprobs["values"] = self.head_loss(row, hidden, "none").logprobs
            return hidden.new_zeros(()), torch.ones((), dtype=torch.int), {}

        self.run_schedule([row], keep_logprobs, forward_only=True)
        if ps.is_pipeline_last_stage():
            predicting = torch.nonzero(target_mask(row["loss_mask"], row["offsets"]), as_tuple=True)[0] - 1
            ours = logprobs["values"][predicting].double().cpu()
            reference = eager_reference_logprobs(lm, sequences)
            error += ((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        tolerance = TOLERANCE[next(self.module.parameters()).dtype]
        if float(error) > tolerance:
            raise UserInputError(
                f"{type(lm).__name__}: the Megatron model of this layout ({self.mesh.description()}) differs from the "
                f"Hugging Face model's eager forward (relative log-prob error {float(error):.2e} > {tolerance:.0e}); "
                "refused rather than trained approximately")
        if dist.get_rank() == 0:
            print(f"hpsft: megatron: the model of this layout computes the Hugging Face model's log-probabilities "
                  f"on the start-up check's row within {float(error):.1e}", flush=True)

    def save_checkpoint(self, root: str, tag: str) -> None:
        checkpoint.save(self, Path(root) / tag)

    def load_checkpoint(self, root: str, tag: str) -> None:
        self.taken, self.updates = checkpoint.load(self, Path(root) / tag)

    @classmethod
    def checkpoint_weights(cls, folder: Path, scratch: Path) -> Mapping[str, torch.Tensor] | None:
        return checkpoint.hf_weights(folder)

    def gathered(self, params: list[nn.Parameter]):
        """The worker's module (the Hugging Face model) stays whole on every rank: nothing to gather.
        (It is not what trains: gathered_tensors reads the trained weights.)"""
        return contextlib.nullcontext()

    def gathered_tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The Hugging Face tensors of these names, whole on rank 0, from the ranks holding their
        parts (convert.gathered_hf_tensors), in fp32."""
        from hpsft.engine.megatron.convert import gathered_hf_tensors

        wanted = set(names)
        for name, tensor in gathered_hf_tensors(self.module):
            if name in wanted:
                yield name, tensor.float() if tensor is not None else None
