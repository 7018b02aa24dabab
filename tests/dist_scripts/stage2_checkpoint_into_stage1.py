"""A checkpoint written by DeepSpeed's ZeRO stage 2 in one process (what engine.zero_stage=2
ran there before it ran as stage 1) resumed by today's engine: its next steps against those of
the stage-2 engine that wrote it. Saves both runs' gradient norms, final weights and stages.

    python tests/dist_scripts/stage2_checkpoint_into_stage1.py MODEL CHECKPOINT_DIR OUT_PT
"""

import sys

import torch

from engine_steps_vs_torch import OPTIM, STEPS, random_steps
from hpsft.config.schema import EngineConfig
from hpsft.distributed import init_distributed
from hpsft.engine import DeepSpeedEngine
from hpsft.models import PackedCausalLM, load_causal_lm


class DeepSpeedStage2(DeepSpeedEngine):
    def zero_stage_to_run(self) -> int:
        return 2


def built(engine_class, model: str) -> DeepSpeedEngine:
    engine = engine_class(EngineConfig(zero_stage=2), OPTIM, total_steps=STEPS)
    engine.initialize(PackedCausalLM(load_causal_lm(model)))
    return engine


def continued(engine: DeepSpeedEngine, steps: list) -> dict:
    norms = [engine.train_batch(rows, lambda out, t=tokens: out["loss"] / t)["grad_norm"] for rows, tokens in steps]
    weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return {"grad_norms": norms, "weights": weights, "deepspeed_stage": engine.engine.zero_optimization_stage()}


def main() -> None:
    model, checkpoint_dir, out_pt = sys.argv[1:4]
    init_distributed()
    torch.manual_seed(0)
    steps = random_steps(load_causal_lm(model).config.vocab_size)
    writer = built(DeepSpeedStage2, model)
    continued(writer, steps[:1])
    writer.save_checkpoint(checkpoint_dir, "step_1")
    results = {"stage2": continued(writer, steps[1:])}
    resumed = built(DeepSpeedEngine, model)
    resumed.load_checkpoint(checkpoint_dir, "step_1")
    results["resumed"] = continued(resumed, steps[1:])
    torch.save(results, out_pt)


if __name__ == "__main__":
    main()
