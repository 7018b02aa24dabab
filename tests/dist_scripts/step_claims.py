"""What the docs claim of the optimizer step, for each engine layout given, in one launch
(torchrun --nproc-per-node N): an engine runs STEPS steps of its data-parallel rank's
micro-batches, the third with a non-finite gradient on the rows of data part 1, saves a
checkpoint after step 3 and goes on; a second engine of the same layout loads that checkpoint
and runs steps 4-5. (A ZeRO-3 engine built second in a process and resumed into the non-finite
step failed in backward: 'tracing error ... expected ... lm_head.weight', so the checkpoint
follows the skip.) Rank 0 saves per layout the unclipped gradient norms, the rates, the final
weights of both engines (Hugging Face names, gathered), and the plain-torch reference of the
same steps (see reference()).

A layout is ENGINE:KEY=VALUE[,KEY=VALUE...] of the config section `engine` (ints, or a word
such as dtype=bfloat16), e.g. deepspeed:zero_stage=2 or
megatron:tensor_parallel_size=2,pipeline_parallel_size=2. The rows
are the same for every layout: two data parts, each on its own data-parallel rank at DP=2, both
on the one rank at DP=1 (every TP / PP rank of a replica gets its replica's rows). Several
models may share the launch, each with its layouts (groups separated by --); the results are
by the model folder's name, each with its own reference.

    torchrun --nproc-per-node N tests/dist_scripts/step_claims.py OUT_PT CKPT_DIR MODEL LAYOUT [LAYOUT...] [-- MODEL LAYOUT...]
    torchrun --nproc-per-node N tests/dist_scripts/step_claims.py OUT_PT CKPT --resume MODEL LAYOUT

A layout A>B resumes A's checkpoint at B too; --resume resumes one checkpoint folder (a
result's "checkpoint") at LAYOUT in a launch of another size (steps 4-5 alone).
"""

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hpsft.config.schema import EngineConfig, OptimConfig
from hpsft.data.batch import collate_jagged, loss_token_count, packed_row
from hpsft.engine.base import TrainEngine
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.engine.factory import engine_class
from hpsft.models import PackedCausalLM, load_causal_lm
from hpsft.utils.distributed import init_distributed, mesh
from tests.numerics import adamw_fp64_step

STEPS = 5
SKIPPED = 2  # the step (0-based) whose gradient is made non-finite, on rank 1 only
SAVED_AFTER = 3  # steps run before the checkpoint: the skipped one included
LOSS_SCALES = [1.0, 4.0, 1.0, 0.25, 2.0]
# lr 1e-2 and weight decay 1.0: decay moves a norm weight (1.0) by 1e-2 a step and a matrix
# entry (~0.02) by 2e-4, both far beyond the comparison's rounding; the clip at 1.0 binds on the
# steps whose loss is scaled up (norms ~1.4 x LOSS_SCALES) and not on the one scaled down, so Adam,
# blind to one scale for all steps, sees a missing clip; one warmup step of five, then cosine to
# 0.1 of the peak.
OPTIM = OptimConfig(lr=1e-2, weight_decay=1.0, grad_clip=1.0, warmup_ratio=0.2, lr_scheduler="cosine",
                    min_lr_ratio=0.1)
# Written out from the docs (linear warmup to the peak, then cosine to min_lr_ratio), not from
# hpsft's lr_lambda: factor k of the schedule's k-th taken step.
LR_FACTORS = [0.5] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(3)]


def decayed(name: str) -> bool:
    """The docs' rule: no weight decay on biases and norms (by name, not hpsft's ndim test)."""
    return not (name.endswith("bias") or "norm" in name)


def all_steps(vocab: int) -> list[list[list[dict]]]:
    """steps[step][rank]: two packed micro-batches per rank of random sequences of uneven
    lengths, supervised on their second half."""
    g = torch.Generator().manual_seed(0)
    lengths = {0: ([30, 17], [24, 41, 9]), 1: ([12, 33, 5], [27])}
    steps = []
    for _ in range(STEPS):
        steps.append([[collate_jagged([{"input_ids": torch.randint(0, vocab, (n,), generator=g),
                                        "loss_mask": torch.arange(n) >= n // 2, "index": 0} for n in batch])
                       for batch in lengths[rank]] for rank in (0, 1)])
    return steps


def reference(model: str, steps: list) -> dict:
    """The same steps in plain torch, one process: fp32 gradients of every rank's micro-batches
    over the step's loss tokens (times LOSS_SCALES), the norm and the clip (DeepSpeed's max / (norm + 1e-6)) in fp64,
    AdamW in fp64 (tests/numerics.py) at the documented rates; the skipped step left out."""
    module = PackedCausalLM(load_causal_lm(model))
    names = [name for name, _ in module.named_parameters()]
    weights = {name: p.detach().double().clone() for name, p in module.named_parameters()}
    state = {name: (torch.zeros_like(w), torch.zeros_like(w)) for name, w in weights.items()}
    norms, taken = [], 0
    for i, ranks in enumerate(steps):
        if i == SKIPPED:
            norms.append(float("nan"))
            continue
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(weights[name].float())
        module.zero_grad()
        batches = [batch for rank in ranks for batch in rank]
        tokens = sum(loss_token_count(batch) for batch in batches)
        for batch in batches:
            (module(**packed_row(batch))["loss"] * LOSS_SCALES[i] / tokens).backward()
        grads = {name: p.grad.double() for name, p in module.named_parameters()}
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        norms.append(norm)
        scale = min(1.0, OPTIM.grad_clip / (norm + 1e-6))
        taken += 1
        lr = OPTIM.lr * LR_FACTORS[taken - 1]
        for name in names:
            adamw_fp64_step(weights[name], grads[name] * scale, state[name], taken, lr, OPTIM.betas, OPTIM.eps,
                            OPTIM.weight_decay if decayed(name) else 0.0)
    return {"grad_norms": norms, "weights": {name: w.float() for name, w in weights.items()},
            "lrs": [OPTIM.lr * f for f in (LR_FACTORS[0], LR_FACTORS[1], LR_FACTORS[2], LR_FACTORS[2], LR_FACTORS[3])]}


def layout_config(layout: str) -> EngineConfig:
    name, _, options = layout.partition(":")
    keys = dict(option.split("=") for option in options.split(",") if option)
    return EngineConfig(name=name, **{key: int(value) if value.isdigit() else value for key, value in keys.items()})


def built(model: str, layout: str) -> TrainEngine:
    engine_config = layout_config(layout)
    engine = engine_class(engine_config.name)(engine_config, OPTIM, total_steps=STEPS, mesh=mesh(engine_config))
    torch.manual_seed(0)
    engine.initialize(PackedCausalLM(load_causal_lm(model)))
    return engine


def run_steps(engine: TrainEngine, steps: list, first: int) -> tuple[list[float], list[float], list[float]]:
    """Steps of this rank's data-parallel rows: data part d on DP rank d at DP=2, both at DP=1;
    each step's unclipped grad norm, rate and loss (summed over the ranks that report it)."""
    dp_rank, dp_size = engine.mesh.dp_rank, engine.mesh.dp_size
    parts = [part for part in (0, 1) if part % dp_size == dp_rank]
    norms, lrs, losses = [], [], []
    for i, ranks in enumerate(steps, start=first):
        tokens = sum(loss_token_count(batch) for part_batches in ranks for batch in part_batches)
        scale = LOSS_SCALES[i] * (float("inf") if i == SKIPPED and 1 in parts else 1.0)
        step = engine.train_batch([packed_row(batch) for part in parts for batch in ranks[part]],
                                  lambda out: out["loss"] * scale / tokens)
        loss = torch.tensor(sum(float(out["loss"]) for out in step.outputs) / tokens if engine.mesh.reports_counts
                            else 0.0, dtype=torch.float64)
        dist.all_reduce(loss)
        norms.append(step.grad_norm)
        lrs.append(step.lr)
        losses.append(float(loss))
    return norms, lrs, losses


def weights(engine: TrainEngine, names: list[str]) -> dict:
    return dict(engine.gathered_tensors(names))


def released(engine: TrainEngine) -> None:
    """Two live engines in one process confuse ZeRO-3's parameter fetching; Megatron's
    parallel state is built anew by the next engine."""
    if isinstance(engine, DeepSpeedEngine):
        engine.engine.destroy()
    else:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def model_groups(args: list[str]) -> list[tuple[str, list[str]]]:
    """MODEL LAYOUT... [-- MODEL LAYOUT...] as (model folder, its layouts) pairs."""
    groups, group = [], []
    for arg in [*args, "--"]:
        if arg != "--":
            group.append(arg)
            continue
        if len(group) < 2:
            raise SystemExit(f"step_claims.py: a model folder and at least one layout per group, got {group}")
        groups.append((group[0], group[1:]))
        group = []
    return groups


def resumed_run(model: str, layout: str, ckpt: str, steps: list, names: list[str]) -> dict:
    """An engine of `layout` loading the checkpoint in `ckpt` and running the steps after it."""
    resumed = built(model, layout)
    resumed.load_checkpoint(ckpt, "saved")
    # A validation before the resumed steps (trainer.val_before_train): it must leave nothing
    # behind (an MoE forward's router logits once joined the next training row's loss).
    resumed.infer_batch([packed_row(batch) for part in steps[SAVED_AFTER] for batch in part])
    norms, lrs, losses = run_steps(resumed, steps[SAVED_AFTER:], SAVED_AFTER)
    result = {"mesh": resumed.mesh.coordinates(), "grad_norms": norms, "lrs": lrs, "losses": losses,
              "weights": weights(resumed, names), "global_steps": resumed.steps}
    released(resumed)
    return result


def run_model(model: str, layouts: list[str], ckpt: str) -> dict:
    """The reference and every layout's straight and resumed runs of one model. A layout
    A>B[>C...] is run straight and resumed at A, and resumed at B, C, ... too (results[A>B]
    ["resumed_at"][B]) from A's checkpoint (results[...]["checkpoint"], for other launches)."""
    steps = all_steps(load_causal_lm(model).config.vocab_size)
    results = {"reference": reference(model, steps)}
    names = list(results["reference"]["weights"])
    for n, spec in enumerate(layouts):
        layout, *others = spec.split(">")
        straight = built(model, layout)
        norms, lrs, losses = run_steps(straight, steps[:SAVED_AFTER], 0)
        straight.save_checkpoint(f"{ckpt}/{n}", "saved")
        more_norms, more_lrs, more_losses = run_steps(straight, steps[SAVED_AFTER:], SAVED_AFTER)
        results[spec] = {"mesh": straight.mesh.coordinates(), "dp_size": straight.mesh.dp_size,
                         "grad_norms": norms + more_norms, "lrs": lrs + more_lrs, "losses": losses + more_losses,
                         "weights": weights(straight, names), "global_steps": straight.steps,
                         "model": model, "checkpoint": f"{ckpt}/{n}"}
        if isinstance(straight, DeepSpeedEngine):
            results[spec].update(deepspeed_stage=straight.engine.zero_optimization_stage(),
                                 skipped_steps=straight.engine.skipped_steps)
        released(straight)
        del straight
        results[spec]["resumed"] = resumed_run(model, layout, f"{ckpt}/{n}", steps, names)
        results[spec]["resumed_at"] = {other: resumed_run(model, other, f"{ckpt}/{n}", steps, names)
                                       for other in others}
    return results


def main() -> None:
    out_pt, ckpt, *args = sys.argv[1:]
    init_distributed()
    if args[0] == "--resume":  # --resume MODEL LAYOUT: CKPT resumed at LAYOUT alone, no reference
        model, layout = args[1:]
        steps = all_steps(load_causal_lm(model).config.vocab_size)
        names = [name for name, _ in PackedCausalLM(load_causal_lm(model)).named_parameters()]
        results = resumed_run(model, layout, ckpt, steps, names)
    else:
        results = {Path(model).name: run_model(model, layouts, f"{ckpt}/{Path(model).name}")
                   for model, layouts in model_groups(args)}
    if dist.get_rank() == 0:
        torch.save(results, out_pt)
    dist.barrier()


if __name__ == "__main__":
    main()
