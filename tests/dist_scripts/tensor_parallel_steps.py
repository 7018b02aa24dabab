"""Optimizer steps through hpsft's DeepSpeedEngine under tensor parallelism (DeepSpeed's
AutoTP), for each of several runs (a model and a ZeRO stage), on given packed rows; rank 0 saves each run's
per-step losses and unclipped gradient norms and its final weights, gathered whole.

    torchrun --nproc_per_node N tests/dist_scripts/tensor_parallel_steps.py SPEC_PT OUT_PT

SPEC_PT holds {"tp": TP, "lr": float, "sequences": [{input_ids, loss_mask}], "steps": [[row, ...],
...] (a row: the sequence indices packed into it), "runs": [{"name", "model": path, "zero_stage",
optionally "dtype": "bfloat16", "sp": SP, "vocab_parallel": true (engine.vocab_parallel_head)}]}. With TP x SP ranks per group there are N/(TP x SP)
data-parallel ranks (distributed.Mesh): dp rank d trains rows d, d+N/(TP x SP), ... of a step, the
same on every rank of its group, each SP rank its slice of each row (what TrainingWorker does
after planning the rows). OUT_PT gets {name: {"losses": [...], "grad_norms":
[...], "weights": {name: tensor}}}, and for a bf16 run also "weight_dtypes" and
"accumulation_errors" (one a step, see fp32_accumulation_check). A run with "unsummed": true gets
the engine's start-up refusal instead (refusal_without_partial_sums). DeepSpeed builds its TP
groups once per process: every run here has the same TP size.
"""

import sys

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

from hpsft.utils import distributed
from hpsft.config import load_config
from hpsft.data.batch import collate_jagged, loss_token_count, packed_row
from hpsft.data.sequence_split import split_row
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.engine.deepspeed import engine as deepspeed_engine
from hpsft.models import PackedCausalLM, load_causal_lm, weight_names
from hpsft.models.families import UnsupportedModel
from hpsft.models.tensor_parallel import check_tensor_parallel
from hpsft.workers.training_worker import token_mean_loss


def fp32_accumulation_check(engine) -> list[float]:
    """Under bf16: before each optimizer step, the relative error (all parameters together, the
    largest over the ranks) of the gradient DeepSpeed holds (fp32, accumulated over the
    micro-batches, reduced over the DP group) against the fp64 sum of the bf16 gradients
    autograd gave each micro-batch on the DP ranks holding the same TP shard, over DP (DeepSpeed
    averages over its DP group). The list it returns fills as steps are taken."""
    params = dict(engine.engine.module.named_parameters())
    sums = {name: torch.zeros(p.shape, dtype=torch.float64) for name, p in params.items()}

    def add_to(total):
        def hook(grad):
            total.add_(grad.double())  # a bf16 micro-batch gradient, before DeepSpeed takes it
        return hook

    for name, p in params.items():
        p.register_hook(add_to(sums[name]))
    errors, take_step, dp_group = [], engine.engine.step, engine.engine.data_parallel_group

    def check_then_step():
        diff = norm = torch.zeros((), dtype=torch.float64)
        for name, p in params.items():
            dist.all_reduce(sums[name], group=dp_group)  # the same shard's pieces on every DP rank
            reference = sums[name] / dist.get_world_size(dp_group)
            diff = diff + (safe_get_full_grad(p).double() - reference).square().sum()
            norm = norm + reference.square().sum()
            sums[name].zero_()
        error = (diff / norm).sqrt()
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        errors.append(float(error))
        take_step()

    engine.engine.step = check_then_step  # this engine instance only
    return errors


def run(spec: dict, run_spec: dict, samples: list[dict]) -> dict:
    tp, sp, dtype = spec["tp"], run_spec.get("sp", 1), run_spec.get("dtype", "float32")
    config = load_config(None, [f"model.path={run_spec['model']}", f"engine.zero_stage={run_spec['zero_stage']}",
                                f"engine.tensor_parallel_size={tp}", f"engine.sequence_parallel_size={sp}",
                                f"engine.dtype={dtype}", f"optim.lr={spec['lr']}", "optim.warmup_ratio=0",
                                "optim.lr_scheduler=constant",
                                f"engine.vocab_parallel_head={run_spec.get('vocab_parallel', False)}"])
    place = distributed.mesh(config.engine)
    engine = DeepSpeedEngine(config.engine, config.optim, total_steps=len(spec["steps"]), mesh=place)
    lm = load_causal_lm(config.model.path)
    check_tensor_parallel(lm.config, tp)
    model = PackedCausalLM(lm)
    engine.initialize(model)
    accumulation_errors = fp32_accumulation_check(engine) if dtype == "bfloat16" else None
    if sp > 1:  # after the engine's start-up check, which runs on whole rows
        model.enable_sequence_parallel(distributed.sequence_parallel_group(place), sp, place.sp_rank, tp)
    losses, grad_norms = [], []
    for rows in spec["steps"]:
        total = loss_token_count(collate_jagged([samples[i] for row in rows for i in row]))
        mine = [packed_row(collate_jagged([samples[i] for i in row])) for row in rows[place.dp_rank::place.dp_size]]
        if sp > 1:
            mine = [split_row(row, place.sp_rank, sp) for row in mine]
        result = engine.train_batch(mine, lambda out: token_mean_loss(out, total))
        nll = torch.tensor(sum(float(o["nll"]) for o in result.outputs) if place.tp_rank == 0 else 0.0,
                           dtype=torch.float64)
        dist.all_reduce(nll)  # each data-parallel rank's rows (each SP rank's slices), counted once per TP group
        losses.append(float(nll) / total)
        grad_norms.append(result.grad_norm)
    weights = dict(engine.gathered_tensors(weight_names(lm)))
    result = {"losses": losses, "grad_norms": grad_norms, "weights": weights}
    if accumulation_errors is not None:
        result |= {"accumulation_errors": accumulation_errors,
                   "weight_dtypes": sorted({str(p.dtype) for p in engine.engine.module.parameters()})}
    return result


def refusal_without_partial_sums(spec: dict, run_spec: dict) -> str:
    """The engine's start-up ShardingCheck on a model whose partial gradients go unsummed: the
    run's model (Qwen3) with sum_partial_gradients_over_tp left out, the bug it fixes. Returns
    the refusal's message ("" if the engine started)."""
    config = load_config(None, [f"model.path={run_spec['model']}", f"engine.zero_stage={run_spec['zero_stage']}",
                                f"engine.tensor_parallel_size={spec['tp']}"])
    engine = DeepSpeedEngine(config.engine, config.optim, total_steps=1, mesh=distributed.mesh(config.engine))
    summed = deepspeed_engine.sum_partial_gradients_over_tp
    deepspeed_engine.sum_partial_gradients_over_tp = lambda module, group: None
    try:
        engine.initialize(PackedCausalLM(load_causal_lm(config.model.path)))
    except UnsupportedModel as err:
        return str(err)
    finally:
        deepspeed_engine.sum_partial_gradients_over_tp = summed
    return ""


def main() -> None:
    spec_pt, out_pt = sys.argv[1:3]
    distributed.init_distributed("gloo")
    spec = torch.load(spec_pt)
    samples = [{**s, "index": i} for i, s in enumerate(spec["sequences"])]
    results = {r["name"]: refusal_without_partial_sums(spec, r) if r.get("unsummed") else run(spec, r, samples)
               for r in spec["runs"]}
    if dist.get_rank() == 0:
        torch.save(results, out_pt)


if __name__ == "__main__":
    main()
