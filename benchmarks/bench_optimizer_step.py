"""What the optimizer costs in a CPU training step: torch's fused AdamW (hpsft's default on CPU)
against the single-tensor AdamW it replaced.

Two measurements, both variants in one process and interleaved so that a busy neighbour
slows both alike:
  - optimizer alone: AdamW.step() over copies of the tensors the engine's optimizer steps
    (ZeRO-2 hands it flat fp32 partitions, not the model's ~270 tensors), random gradients;
  - a full step of the default engine (ZeRO-2, one rank, fp32) on batches of chat
    conversations: the same DeepSpeedEngine, differing only in the optimizer it builds.

    python benchmarks/bench_optimizer_step.py [--model DIR] [--data FILE] [--batch 8] [--steps 4]
"""

import argparse
import statistics
import time

import torch

from bench_packing import load_sequences


def optimizer_alone(params, fused: bool) -> float:
    copies = [torch.randn_like(p).requires_grad_() for p in params]
    for p in copies:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(copies, lr=1e-4, weight_decay=0.01, fused=fused)
    optimizer.step()  # allocates the moments
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".cache/models/smollm2-135m")
    parser.add_argument("--data", default=".cache/data/chatterbot/train.parquet")
    parser.add_argument("--batch", type=int, default=8, help="conversations per step")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per variant (after one warm-up)")
    args = parser.parse_args()

    from hpsft.utils import distributed
    from hpsft.config.schema import EngineConfig, OptimConfig
    from hpsft.data.batch import collate_jagged, packed_row
    from hpsft.engine.deepspeed import DeepSpeedEngine
    from hpsft.utils.distributed import Mesh
    from hpsft.models import PackedCausalLM, load_causal_lm

    class EngineWithAdamW(DeepSpeedEngine):
        def __init__(self, fused: bool):
            super().__init__(EngineConfig(), OptimConfig(), total_steps=1000, mesh=Mesh(dp_size=1))  # one process
            self.fused = fused

        def build_optimizer(self, module):
            optimizer = super().build_optimizer(module)
            for group in optimizer.param_groups:
                group["fused"] = self.fused  # read at every step()
            return optimizer

    torch.manual_seed(0)
    distributed.init_distributed()
    samples = load_sequences(args.data, args.model, args.batch * (args.steps + 1))
    batches = [[packed_row(collate_jagged(samples[i:i + args.batch]))]
               for i in range(0, len(samples) - args.batch + 1, args.batch)]
    tokens = [sum(row["input_ids"].numel() for row in batch) for batch in batches]
    engines = {}
    for fused in (True, False):
        engines[fused] = EngineWithAdamW(fused)
        engines[fused].initialize(PackedCausalLM(load_causal_lm(args.model)))
    inner = engines[True].engine.optimizer  # DeepSpeed's wrapper around the torch AdamW
    stepped = [p for group in getattr(inner, "optimizer", inner).param_groups for p in group["params"]]
    params = [torch.empty(p.shape, dtype=p.dtype) for p in stepped]
    n_params = sum(p.numel() for p in engines[True].module.parameters())

    step_times, optimizer_times = {True: [], False: []}, {True: [], False: []}
    for i, batch in enumerate(batches):
        for fused, engine in engines.items():
            start = time.perf_counter()
            engine.train_batch(batch, lambda out: out["loss"] / out["n_tokens"].clamp_min(1))
            if i:  # the first step warms up
                step_times[fused].append(time.perf_counter() - start)
                optimizer_times[fused].append(optimizer_alone(params, fused))

    print(f"model={args.model} ({n_params / 1e6:.1f}M parameters, fp32), default engine (ZeRO-2, 1 rank), "
          f"{args.batch} conversations per step ({statistics.median(tokens[1:]):.0f} tokens median), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {args.steps} steps; "
          f"optimizer over {len(params)} tensors")
    print("| AdamW | optimizer step alone s | full step s | rest of the step s |")
    print("|---|---|---|---|")
    for fused in (False, True):
        opt, step = statistics.median(optimizer_times[fused]), statistics.median(step_times[fused])
        print(f"| {'fused' if fused else 'single-tensor'} | {opt:.3f} | {step:.3f} | {step - opt:.3f} |")
    saving = statistics.median(step_times[False]) - statistics.median(step_times[True])
    print(f"fused saves {saving:.3f} s per step ({saving / statistics.median(step_times[False]):.0%}); "
          f"optimizer alone {statistics.median(optimizer_times[False]) / statistics.median(optimizer_times[True]):.1f}x faster")


if __name__ == "__main__":
    main()
