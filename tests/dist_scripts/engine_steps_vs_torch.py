"""A few optimizer steps through hpsft's DeepSpeedEngine (one rank) at each stage given, and
the same steps in plain PyTorch: the same model, torch's single-tensor AdamW, LambdaLR,
clip_grad_norm_. Saves each run's gradient norms and final weights to a torch file.

    python tests/dist_scripts/engine_steps_vs_torch.py MODEL OUT_PT STAGE[,STAGE...]

A stage is engine.zero_stage (`0`-`3`, `default` for 2) or `dsN`: DeepSpeed made to run
stage N whatever the engine would choose (one process runs ZeRO-1/2 without ZeRO otherwise).
"""

import sys

import torch

from hpsft.config.schema import EngineConfig, OptimConfig
from hpsft.data.batch import collate_jagged, loss_token_count, packed_row
from hpsft.utils.distributed import init_distributed, mesh
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.engine.optimizer import lr_lambda, param_groups
from hpsft.models import PackedCausalLM, load_causal_lm

STEPS = 3
# A clip this low binds at every step, so clipping is exercised, not just the norm.
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.5, warmup_ratio=0.0)


def random_steps(vocab: int) -> list[tuple[list[dict], int]]:
    """STEPS steps of two packed micro-batches of random sequences, supervised on their second
    half: (rows, loss tokens of the step)."""
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(STEPS):
        batches = [collate_jagged([{"input_ids": torch.randint(0, vocab, (n,), generator=g),
                                    "loss_mask": torch.arange(n) >= n // 2, "index": 0}
                                   for n in lengths]) for lengths in ([30, 17], [24, 41, 9])]
        steps.append(([packed_row(b) for b in batches], sum(loss_token_count(b) for b in batches)))
    return steps


class EngineAtDeepSpeedStage(DeepSpeedEngine):
    def __init__(self, stage: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forced_stage = stage

    def zero_stage_to_run(self) -> int:
        return self.forced_stage


def built_engine(model: str, stage: str) -> DeepSpeedEngine:
    if stage.startswith("ds"):
        engine_config = EngineConfig(zero_stage=max(1, int(stage[2:])))
        engine = EngineAtDeepSpeedStage(int(stage[2:]), engine_config, OPTIM, total_steps=STEPS,
                                        mesh=mesh(engine_config))
    else:
        engine_config = EngineConfig(zero_stage=2 if stage == "default" else int(stage))
        engine = DeepSpeedEngine(engine_config, OPTIM, total_steps=STEPS, mesh=mesh(engine_config))
    engine.initialize(PackedCausalLM(load_causal_lm(model)))
    return engine


def stepped(engine: DeepSpeedEngine, steps: list) -> dict:
    """The engine's gradient norms over `steps`, its weights after them and the stage it ran."""
    norms = [engine.train_batch(rows, lambda out: out["loss"] / tokens).grad_norm for rows, tokens in steps]
    weights = {name: tensor.clone() for name, tensor in engine.gathered_tensors(
        [name for name, _ in engine.module.named_parameters()])}
    return {"grad_norms": norms, "weights": weights, "deepspeed_stage": engine.engine.zero_optimization_stage()}


def engine_run(model: str, stage: str, steps: list) -> dict:
    return stepped(built_engine(model, stage), steps)


def torch_run(model: str, steps: list) -> dict:
    module = PackedCausalLM(load_causal_lm(model))
    optimizer = torch.optim.AdamW(param_groups(module, OPTIM.weight_decay), lr=OPTIM.lr, betas=tuple(OPTIM.betas),
                                  eps=OPTIM.eps, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(STEPS, 0, OPTIM.lr_scheduler, OPTIM.min_lr_ratio))
    norms = []
    for rows, tokens in steps:
        for row in rows:
            (module(**row)["loss"] / tokens).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), OPTIM.grad_clip)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {"grad_norms": norms, "weights": {name: p.detach().clone() for name, p in module.named_parameters()}}


def main() -> None:
    model, out_pt, stages = sys.argv[1:4]
    init_distributed()
    torch.manual_seed(0)
    steps = random_steps(load_causal_lm(model).config.vocab_size)
    results = {"torch": torch_run(model, steps)}
    for stage in stages.split(","):
        results[stage] = engine_run(model, stage, steps)
    torch.save(results, out_pt)


if __name__ == "__main__":
    main()
