"""A checkpoint written by the engine running one DeepSpeed stage, resumed (one process) by the
engine running another: the resumed engine's next steps against the writer's own. A stage is
`default` (what engine.zero_stage=2 runs in one process) or DeepSpeed's stage forced: `ds0`,
`ds1`, `ds2`. Saves both runs' gradient norms, final weights and stages.

    python tests/dist_scripts/checkpoint_across_stages.py MODEL CHECKPOINT_DIR OUT_PT WRITER READER
"""

import sys

import torch

from engine_steps_vs_torch import built_engine, random_steps, stepped
from hpsft.utils.distributed import init_distributed
from hpsft.models import load_causal_lm


def main() -> None:
    model, checkpoint_dir, out_pt, writer_stage, reader_stage = sys.argv[1:6]
    init_distributed()
    torch.manual_seed(0)
    steps = random_steps(load_causal_lm(model).config.vocab_size)
    writer = built_engine(model, writer_stage)
    stepped(writer, steps[:1])
    writer.save_checkpoint(checkpoint_dir, "step_1")
    results = {"writer": stepped(writer, steps[1:])}
    resumed = built_engine(model, reader_stage)
    resumed.load_checkpoint(checkpoint_dir, "step_1")
    results["resumed"] = stepped(resumed, steps[1:])
    torch.save(results, out_pt)


if __name__ == "__main__":
    main()
