"""Build a model under ZeRO-3 and export it, measuring every rank's host memory per phase.

    torchrun --nproc_per_node 2 tests/dist_scripts/zero3_load_and_export.py OUT_DIR key=value ...

No training step: the export must then hold the model folder's own weights. Memory is the
process's anonymous resident memory (RssAnon: what the process itself holds, without the
page cache of files it maps, such as the safetensors it reads), sampled every 2 ms by a
thread; each rank writes OUT_DIR/memory_rank<R>.json with, in MiB, the value once the
framework is up (torch, DeepSpeed, transformers imported, process group formed), then for
each phase (building the model partitioned, building the engine, exporting to OUT_DIR/hf in
64 MB shards) the value at its start, its peak and at its end, and the parameter bytes this
rank holds once the model is built.
"""

import json
import sys
import threading
import time
from pathlib import Path


def anonymous_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Each phase's RssAnon at its start and its peak (sampled) until the next phase."""

    def __init__(self):
        self.start = self.peak = anonymous_rss_mib()
        self.lock = threading.Lock()
        threading.Thread(target=self.sample, daemon=True).start()

    def sample(self):
        while True:
            value = anonymous_rss_mib()
            with self.lock:
                self.peak = max(self.peak, value)
            time.sleep(0.002)

    def end_phase(self) -> dict:
        value = anonymous_rss_mib()
        with self.lock:
            phase = {"start": round(self.start, 1), "peak": round(max(self.peak, value), 1), "end": round(value, 1)}
            self.start = self.peak = value
        return phase


def main() -> None:
    out = Path(sys.argv[1])
    import deepspeed  # noqa: F401  (the framework is part of the baseline)
    import transformers  # noqa: F401

    from hpsft.utils import distributed
    from hpsft.config import load_config
    from hpsft.models import PackedCausalLM, load_causal_lm, load_tokenizer
    from hpsft.workers import TrainingWorker

    config = load_config(None, sys.argv[2:])
    distributed.init_distributed("gloo")
    tokenizer = load_tokenizer(config.model.path)
    sampler = PeakSampler()
    memory = {"framework": sampler.end_phase()["end"]}
    worker = TrainingWorker(config.model, config.loss, config.engine, config.optim, config.data, total_steps=1,
                            mesh=distributed.mesh(config.engine), peak_flops=1e12)
    engine = worker.engine
    lm = load_causal_lm(config.model.path, model_init=engine.model_init)
    memory["model_built"] = sampler.end_phase()
    # What this rank holds of the parameters (its partitions; small ones stay whole).
    memory["parameter_mib"] = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in lm.parameters()) / 2**20
    engine.initialize(PackedCausalLM(lm))
    worker.lm = lm  # what init_model keeps, and export_hf writes
    memory["engine_built"] = sampler.end_phase()
    worker.export_hf(str(out / "hf"), tokenizer, max_shard_mb=64)
    memory["exported"] = sampler.end_phase()
    rank = distributed.rank()
    (out / f"memory_rank{rank}.json").write_text(json.dumps(memory))
    print(f"rank {rank} RssAnon MiB: {memory}", flush=True)


if __name__ == "__main__":
    main()
