"""Host memory of resuming a Megatron engine checkpoint at another layout (checkpoint.resharded).

    torchrun --nproc-per-node N tests/dist_scripts/megatron_reshard_memory.py save MODEL CKPT LAYOUT
    torchrun --nproc-per-node 1 tests/dist_scripts/megatron_reshard_memory.py load MODEL CKPT LAYOUT OUT_JSON

save: an engine of LAYOUT takes one step of step_claims.py's rows (so Adam has moments) and
writes its checkpoint to CKPT. load: an engine of another LAYOUT loads it, the process's
anonymous resident memory (RssAnon, sampled every 2 ms: zero3_load_and_export.PeakSampler) at
the load's start, its peak and its end written to OUT_JSON in MiB, beside the model's fp32 MiB
and its largest Hugging Face tensor's.
"""

import json
import math
import sys

import torch.distributed as dist

from hpsft.utils.distributed import init_distributed
from tests.dist_scripts.step_claims import all_steps, built, run_steps
from tests.dist_scripts.zero3_load_and_export import PeakSampler


def main() -> None:
    mode, model, ckpt, layout, *out = sys.argv[1:]
    init_distributed()
    engine = built(model, layout)
    if mode == "save":
        run_steps(engine, all_steps(engine.hf_config.vocab_size)[:1], 0)
        engine.save_checkpoint(ckpt, "saved")
        return
    from hpsft.engine.megatron.convert import hf_tensor_names

    sizes = [math.prod(shape) * 4 / 2**20 for _, shape in hf_tensor_names(engine.module.hf_architecture)]
    sampler = PeakSampler()
    engine.load_checkpoint(ckpt, "saved")
    load = sampler.end_phase()
    if dist.get_rank() == 0:
        with open(out[0], "w") as f:
            json.dump({"load": load, "model_mib": sum(sizes), "largest_tensor_mib": max(sizes)}, f)


if __name__ == "__main__":
    main()
