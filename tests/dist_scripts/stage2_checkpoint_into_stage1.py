"""A checkpoint written by DeepSpeed's ZeRO stage 2 in one process (what engine.zero_stage=2
ran there before it ran as stage 1) resumed by today's engine: its next steps against those of
the stage-2 engine that wrote it. Saves both runs' gradient norms, final weights and stages.

    python tests/dist_scripts/stage2_checkpoint_into_stage1.py MODEL CHECKPOINT_DIR OUT_PT
"""

import sys

import torch

from engine_steps_vs_torch import built_engine, random_steps, stepped
from hpsft.distributed import init_distributed
from hpsft.engine import DeepSpeedEngine
from hpsft.models import load_causal_lm


class DeepSpeedStage2(DeepSpeedEngine):
    def zero_stage_to_run(self) -> int:
        return 2


def main() -> None:
    model, checkpoint_dir, out_pt = sys.argv[1:4]
    init_distributed()
    torch.manual_seed(0)
    steps = random_steps(load_causal_lm(model).config.vocab_size)
    writer = built_engine(model, 2, DeepSpeedStage2)
    stepped(writer, steps[:1])
    writer.save_checkpoint(checkpoint_dir, "step_1")
    results = {"stage2": stepped(writer, steps[1:])}
    resumed = built_engine(model, 2)
    resumed.load_checkpoint(checkpoint_dir, "step_1")
    results["resumed"] = stepped(resumed, steps[1:])
    torch.save(results, out_pt)


if __name__ == "__main__":
    main()
