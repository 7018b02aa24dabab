"""Where a CPU training step's time goes: the default engine on the full model, step by step.

The full SmolLM2-135M in fp32, one process, the default engine (ZeRO-2) and data settings
(micro-batches of 8 conversations), optimizer steps of N chatterbot conversations. Several
engine variants live in one process and take turns on the same batches, so a busy
neighbour slows them alike:
  zero2            the default engine (engine.zero_stage=2: in one process, no ZeRO since session 7)
  zero0            engine.zero_stage=0 (the baseline ZeRO-2 on one rank should match)
  zero1-ds         DeepSpeed's stage 1 in one process (what zero2 ran in session 6)
  zero2-ds         DeepSpeed's stage 2 in one process (what zero2 ran before session 6)
  zero2-adamw      the default engine with torch's single-tensor AdamW (before the fused one)
  zero2-noncontig  DeepSpeed's stage 2 with its contiguous_gradients off

Each engine call is timed (forward, backward, step) and, inside them, DeepSpeed's gradient
reduction hooks (backward: copies into its bucket and flat gradient partition), the gradient
norm and clipping (inside step() under ZeRO, before it without), and the AdamW step; the
rest of step() is, under ZeRO, flattening the gradients and copying the fp32 partition
back into the model's weights. "other": the rest of train_batch (zero_grad, the LR). The
fixed per-step cost is the intercept a of step time = a + b * tokens,
fitted over the default engine's steps of every batch size, split into forward+backward's own
intercept (the same fit of their time: matmuls on few rows run below peak) and the engine's
work outside them (step(), norm and clip, bookkeeping), and the same fit against each step's
model FLOPs instead of its tokens (the LM head multiplies supervised rows only). MFU is model FLOPs (as the
trainer counts them) over a GEMM peak of the model's MLP shape measured in this run
(before and after the steps; the larger reading).

    python benchmarks/bench_train_step.py [--batches 4,8,16,32] [--compare 8,32] [--steps 3]
        [--variants zero2,zero0,zero1-ds] [--model DIR] [--data FILE]

Every engine holds ~2-5 GB (fp32 weights, AdamW moments, gradients; under ZeRO also its fp32
copy and gradient buffers): on a small machine run two or three variants per process.
"""

import argparse
import functools
import statistics
import time
from collections import defaultdict

import torch

from bench_packing import load_sequences

# name -> (engine.zero_stage, the stage DeepSpeed is made to run or None for the engine's
# choice, DeepSpeed zero_optimization overrides)
VARIANTS = {
    "zero2": (2, None, {}),
    "zero0": (0, None, {}),
    "zero1-ds": (2, 1, {}),
    "zero2-ds": (2, 2, {}),
    "zero2-adamw": (2, None, {}),
    "zero2-noncontig": (2, 2, {"contiguous_gradients": False}),
}
PARTS = ("forward", "backward", "zero_reduce", "grad_norm_clip", "optimizer", "step", "total")


def timed(obj, name: str, part: str, times: dict) -> None:
    """Replace obj.name by a wrapper adding its wall time to times[part]."""
    inner = getattr(obj, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times[part] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def build_engine(variant: str, model: str):
    from hpsft.config.schema import EngineConfig, OptimConfig
    from hpsft.engine.deepspeed import DeepSpeedEngine
    from hpsft.utils.distributed import Mesh
    from hpsft.models import PackedCausalLM, load_causal_lm

    stage, forced_stage, zero_overrides = VARIANTS[variant]

    class Variant(DeepSpeedEngine):
        def zero_stage_to_run(self):
            return forced_stage if forced_stage is not None else super().zero_stage_to_run()

        def deepspeed_config(self):
            config = super().deepspeed_config()
            config["zero_optimization"].update(zero_overrides)
            return config

        def build_optimizer(self, module):
            optimizer = super().build_optimizer(module)
            if variant == "zero2-adamw":
                for group in optimizer.param_groups:
                    group["fused"] = False  # read at every step()
            return optimizer

    engine = Variant(EngineConfig(zero_stage=stage), OptimConfig(), total_steps=1000, mesh=Mesh(dp_size=1))
    engine.initialize(PackedCausalLM(load_causal_lm(model)))
    times = defaultdict(float)
    ds = engine.engine
    timed(ds, "forward", "forward", times)
    timed(ds, "backward", "backward", times)
    timed(ds, "step", "step", times)
    timed(engine, "train_batch", "total", times)
    zero = ds.optimizer if engine.stage > 0 else None
    torch_optimizer = zero.optimizer if zero is not None else ds.optimizer
    timed(torch_optimizer, "step", "optimizer", times)
    if zero is not None:  # hooks and epilogue of the gradient reduction; norm; clip
        timed(zero, "reduce_independent_p_g_buckets_and_remove_grads", "zero_reduce", times)
        timed(zero, "overlapping_partition_gradients_reduce_epilogue", "zero_reduce", times)
        timed(zero, "scaled_global_norm", "grad_norm_clip", times)
        timed(zero, "unscale_and_clip_grads", "grad_norm_clip", times)
    else:
        timed(engine, "clip_unsharded_grads", "grad_norm_clip", times)
    return engine, times


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b * x."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - b * mean_x, b


def gemm_peak(lm_config) -> float:
    from hpsft.config.schema import DataConfig
    from hpsft.utils.perf import measure_matmul_peak

    rows = min(DataConfig().max_tokens_per_micro_batch or 2048, 4096)  # as the trainer measures it
    return measure_matmul_peak(rows, lm_config.hidden_size, lm_config.intermediate_size, torch.float32,
                               torch.device("cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".cache/models/smollm2-135m")
    parser.add_argument("--data", default=".cache/data/chatterbot/train.parquet")
    parser.add_argument("--batches", default="4,8,16,32", help="conversations per step for the default engine's fit")
    parser.add_argument("--compare", default="8,32", help="conversations per step every variant runs")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per variant and size (after a warm-up)")
    parser.add_argument("--variants", default="zero2,zero0,zero1-ds")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if variants[0] != "zero2" or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: zero2 first, then any of {', '.join(list(VARIANTS)[1:])}")

    from hpsft.utils import distributed
    from hpsft.config.schema import DataConfig
    from hpsft.data.batch import collate_jagged, loss_token_count, packed_row, select, seqlens
    from hpsft.data.microbatch import min_micro_batches, plan_micro_batches
    from hpsft.utils.perf import flop_counts, model_flops

    torch.manual_seed(0)
    distributed.init_distributed()
    fit_sizes = [int(n) for n in args.batches.split(",")]
    compare_sizes = [int(n) for n in args.compare.split(",")]
    sizes = sorted(set(fit_sizes) | set(compare_sizes))
    # Each size's steps take consecutive conversations, different for every step.
    samples = load_sequences(args.data, args.model, sum(sizes) * (args.steps + 1))
    data = DataConfig()
    steps = []  # (size, micro-batches, lengths, loss tokens), in the order they run
    position = 0
    for size in sizes:
        for _ in range(args.steps + 1):
            batch = collate_jagged(samples[position:position + size])
            position += size
            lengths = seqlens(batch).tolist()
            count = min_micro_batches(lengths, data.micro_batch_size_per_gpu, data.max_tokens_per_micro_batch)
            bins = plan_micro_batches(lengths, count, data.micro_batch_size_per_gpu, data.max_tokens_per_micro_batch)
            steps.append((size, [packed_row(select(batch, b)) for b in bins], lengths, loss_token_count(batch)))

    engines = {variant: build_engine(variant, args.model) for variant in variants}
    lm = engines["zero2"][0].module.lm
    body, head = flop_counts(lm)
    cfg = lm.config
    peak_before = gemm_peak(cfg)

    loss_fn = lambda out: out["loss"] / out["n_tokens"].clamp_min(1)  # noqa: E731
    rows = defaultdict(list)  # (variant, size) -> [per-step dict]
    warmed = set()
    for size, micro_batches, lengths, loss_tokens in steps:
        for variant, (engine, times) in engines.items():
            if variant != "zero2" and size not in compare_sizes:
                continue
            times.clear()
            engine.train_batch(micro_batches, loss_fn)
            if (variant, size) not in warmed:  # the first step of each size warms up
                warmed.add((variant, size))
                continue
            flops = model_flops(body, head, cfg.num_hidden_layers, cfg.hidden_size, lengths, loss_tokens)
            rows[variant, size].append({**times, "tokens": sum(lengths), "flops": flops})
    peak = max(peak_before, gemm_peak(cfg))

    n_params = sum(p.numel() for p in lm.parameters())
    print(f"model={args.model} ({n_params / 1e6:.1f}M parameters, fp32), 1 rank, micro-batches of "
          f"{data.micro_batch_size_per_gpu} conversations, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians of {args.steps} steps after a warm-up; GEMM peak "
          f"{peak_before / 1e9:.0f} / {peak / 1e9:.0f} GFLOP/s (before / max)")
    print("| variant | conv. | tokens | step s | forward | backward | of which ZeRO reduce | step() | "
          "grad norm+clip | AdamW | rest of step() | other | MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    medians = {}
    for (variant, size), measured in sorted(rows.items(), key=lambda kv: (kv[0][1], variants.index(kv[0][0]))):
        m = {part: statistics.median(r.get(part, 0.0) for r in measured) for part in (*PARTS, "tokens", "flops")}
        medians[variant, size] = m
        # ZeRO takes the norm and clips inside step(); without ZeRO the engine does, before it.
        norm_in_step = m["grad_norm_clip"] if engines[variant][0].stage > 0 else 0.0
        copies = m["step"] - norm_in_step - m["optimizer"]
        other = m["total"] - m["forward"] - m["backward"] - m["step"] - (m["grad_norm_clip"] - norm_in_step)
        print(f"| {variant} | {size} | {m['tokens']:.0f} | {m['total']:.2f} | {m['forward']:.2f} | "
              f"{m['backward']:.2f} | {m['zero_reduce']:.3f} | {m['step']:.3f} | {m['grad_norm_clip']:.3f} | "
              f"{m['optimizer']:.3f} | {copies:.3f} | {other:.3f} | {m['flops'] / m['total'] / peak:.1%} |")

    default_steps = [r for (variant, size), measured in rows.items()
                     if variant == "zero2" and size in fit_sizes for r in measured]
    a, b = line_fit([(r["tokens"], r["total"]) for r in default_steps])
    a_model, _ = line_fit([(r["tokens"], r["forward"] + r["backward"]) for r in default_steps])
    engine_work = statistics.median(r["total"] - r["forward"] - r["backward"] for r in default_steps)
    step_500 = a + b * 500
    print(f"fixed per-step cost (zero2, step s = a + b * tokens over {len(default_steps)} steps of {args.batches} "
          f"conversations): a = {a:.3f} s, b = {b * 1e3:.2f} ms/token; a is {a / step_500:.0%} of a "
          f"500-token step")
    print(f"  of a: forward+backward's own intercept (the same fit of their time alone) {a_model:.3f} s; "
          f"the engine's work outside them (step(), norm, clip, bookkeeping; median) {engine_work:.3f} s = "
          f"{engine_work / step_500:.1%} of a 500-token step")
    # Tokens are not the work: the LM head multiplies only supervised rows, attention grows
    # with each sequence's length. Against the model FLOPs of each step the intercept is
    # what a step costs beyond its work.
    a_flops, seconds_per_flop = line_fit([(r["flops"], r["total"]) for r in default_steps])
    flops_500 = statistics.fmean(r["flops"] / r["tokens"] for r in default_steps) * 500
    print(f"  step s = a' + FLOPs / rate over the same steps: a' = {a_flops:.3f} s, rate {1 / seconds_per_flop / 1e9:.0f} "
          f"GFLOP/s; a' is {a_flops / (a_flops + flops_500 * seconds_per_flop):.0%} of a step of 500 tokens' "
          "mean FLOPs")
    for variant in variants[1:]:
        for size in compare_sizes:
            ratio = medians["zero2", size]["total"] / medians[variant, size]["total"]
            print(f"{size} conversations: zero2 step time / {variant} = {ratio:.3f}")


if __name__ == "__main__":
    main()
