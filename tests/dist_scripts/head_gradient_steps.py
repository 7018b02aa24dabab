"""bf16 ZeRO-1 optimizer steps through hpsft's DeepSpeedEngine, per model and micro-batch
count, on two gradient paths: "engine" (train_batch's loss_weight given: the fused loss sums
d(lm_head.weight) into BF16_Optimizer's fp32 gradient), three steps of which the second is made
non-finite (an inf put into one body parameter's gradient) and skipped; "autograd" (no
loss_weight: the loss returns d(weight) to autograd, the path before), one step. Rank 0 saves,
per run and step: the fp32 gradients as DeepSpeed holds them just before step() (accumulated,
reduced, unclipped), the reported grad norm, the fp32 master weights before and after the
step, and every rank's loss inputs (hidden states, labels and head weight each micro-batch's
fused loss got); and, under "uses_head_gradient", whether other engine settings take the path.

    [torchrun --nproc_per_node N] tests/dist_scripts/head_gradient_steps.py OUT_PT MODEL[,MODEL...] MB[,MB...]

Rank r trains sequences r, r+N, ... of `sequences`; every step has the same rows.
"""

import sys

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

from hpsft.config.schema import EngineConfig, OptimConfig
from hpsft.data.batch import collate_jagged, loss_token_count, packed_row
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.models import PackedCausalLM, load_causal_lm
from hpsft.utils.distributed import init_distributed, mesh
from hpsft.workers.training_worker import token_mean_loss

STEPS = 3
NONFINITE_STEP = 2
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0, warmup_ratio=0.0, lr_scheduler="constant")
LENGTHS = [21, 14, 30, 17, 25, 12, 28, 19]
TARGETS_PER_SEQUENCE = 8  # 64 loss tokens a step: a power of two (see test_head_gradient.py)


def sequences(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(LENGTHS):
        loss_mask = torch.zeros(n, dtype=torch.bool)
        loss_mask[n - TARGETS_PER_SEQUENCE:] = True
        out.append({"input_ids": torch.randint(0, vocab, (n,), generator=g), "loss_mask": loss_mask, "index": i})
    return out


def rank_rows(samples: list[dict], micro_batches: int) -> list[dict]:
    mine = samples[dist.get_rank()::dist.get_world_size()]
    return [packed_row(collate_jagged([mine[i] for i in split.tolist()]))
            for split in torch.arange(len(mine)).tensor_split(micro_batches)]


def poisoned_loss(body_param: torch.Tensor, outputs: dict, global_loss_tokens: int) -> torch.Tensor:
    """token_mean_loss, with +inf put into one element of body_param's gradient in this backward."""
    handle = None

    def poison_once(grad):
        handle.remove()
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    handle = body_param.register_hook(poison_once)
    return token_mean_loss(outputs, global_loss_tokens)


def built(model: str, **engine) -> DeepSpeedEngine:
    engine_config = EngineConfig(**engine)
    built_engine = DeepSpeedEngine(engine_config, OPTIM, total_steps=STEPS, mesh=mesh(engine_config))
    packed = PackedCausalLM(load_causal_lm(model))
    built_engine.initialize(packed, head_weight=packed.head_weight)  # as TrainingWorker hands it
    return built_engine


def masters(packed) -> dict:
    return {name: safe_get_full_fp32_param(p).detach().cpu().clone() for name, p in packed.named_parameters()}


def run(model: str, micro_batches: int, path: str, steps: int) -> list[dict]:
    engine = built(model, zero_stage=1, dtype="bfloat16")
    packed = engine.module
    assert engine.head_gradient() is not None
    loss_inputs = []
    token_losses = packed.token_losses

    def recording_token_losses(hidden, labels, reduction, *args):
        loss_inputs.append({"hidden": hidden.detach().float().cpu(), "labels": labels.cpu(),
                            "weight": packed.head_weight.detach().float().cpu().clone()})
        return token_losses(hidden, labels, reduction, *args)

    packed.token_losses = recording_token_losses  # this instance only
    grads = {}
    take_step = engine.engine.step

    def read_grads_then_step():
        for name, param in packed.named_parameters():  # a collective
            grads[name] = safe_get_full_grad(param).detach().cpu().clone()
        take_step()

    engine.engine.step = read_grads_then_step
    samples = sequences(packed.head_weight.shape[0])
    tokens = loss_token_count(collate_jagged(samples))
    rows = rank_rows(samples, micro_batches)
    body_param = packed.get_submodule("model.norm").weight
    results = []
    for step in range(1, steps + 1):
        before = masters(packed)
        loss_inputs.clear()
        grads.clear()
        loss_fn = (lambda out: poisoned_loss(body_param, out, tokens)) if step == NONFINITE_STEP else (
            lambda out: token_mean_loss(out, tokens))
        result = engine.train_batch(rows, loss_fn, loss_weight=1 / tokens if path == "engine" else None)
        every_rank_inputs = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank_inputs, list(loss_inputs))
        results.append({"grads": dict(grads), "grad_norm": result.grad_norm, "masters_before": before,
                        "masters": masters(packed), "tokens": tokens,
                        "loss_inputs": [x for inputs in every_rank_inputs for x in inputs]})
    return results


def main() -> None:
    out_pt, models, counts = sys.argv[1:4]
    init_distributed("gloo")
    results = {(model, count, path): run(model, count, path, STEPS if path == "engine" else 1)
               for model in models.split(",") for count in map(int, counts.split(","))
               for path in ("engine", "autograd")}
    model = models.split(",")[0]
    results["uses_head_gradient"] = {
        settings: built(model, **dict(settings)).head_gradient() is not None
        for settings in ((("zero_stage", 2), ("dtype", "bfloat16")), (("zero_stage", 1), ("dtype", "float32")))}
    if dist.get_rank() == 0:
        torch.save(results, out_pt)


if __name__ == "__main__":
    main()
