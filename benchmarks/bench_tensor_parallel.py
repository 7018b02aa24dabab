"""Step time and per-rank memory of tensor parallelism (DeepSpeed AutoTP, docs/tensor_parallel.md):
TP=1 (one process) against TP=2 (2 ranks, DP=1), engine.zero_stage=1, the trainer's own pieces
(hpsft's DeepSpeedEngine, PackedCausalLM, its packed varlen attention and fused loss).

The model: SmolLM2-135M's widths (hidden 576, MLP 1536, vocabulary 49152, tied embedding) cut to
--layers decoder layers, with 8 query / 4 key-value heads of 72 (SmolLM2's 9 / 3 heads of 64 do
not divide by 2), random init from a LlamaConfig: nothing is read from disk. Each step trains
--micro-batches packed rows of --tokens random tokens (documents of 256-4096 tokens, the last two
thirds supervised; bench_gpu_step.packed_micro_batch), the same rows on every rank and every TP
size; one warm-up step, then --steps measured ones.

Memory per rank, two ways:
  - parameter + gradient + optimizer bytes, counted by tensor as the last step's optimizer
    step starts (every gradient reduced, the AdamW moments of the step before alive): the
    module's parameters and their .grad, the torch AdamW's parameters (ZeRO's fp32 master
    partitions), their .grad and its state, and every tensor DeepSpeed's ZeRO optimizer holds
    (its reduced gradients, buckets and master partitions); each storage counted once, whatever
    views share it. ZeRO's step then flattens its reduced gradients into one more partition-
    sized buffer for a moment (DeepSpeed's stage_1_and_2.py), not counted here;
  - RssAnon (anonymous resident memory, /proc/self/status) sampled every 5 ms: its peak over
    the whole process (AutoTP shards the model built whole on every rank) and over the steps.
Each configuration runs in its own processes (torchrun), OMP threads = CPU cores / ranks.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--tp 1,2,2v] [--layers 4] [--tokens 2048] [--steps 2]
    python3 benchmarks/bench_tensor_parallel.py --device cuda --tp 1,2 ...   # GPUs: one per rank
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench_gpu_step import packed_micro_batch

MIB = 2**20
# SmolLM2-135M's widths with heads that TP=2 (and 4) divides.
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, head_dim=72,
             vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192)


class RssAnonPeak:
    """The peak of this process's RssAnon, sampled by a thread; `reset` starts a new window."""

    def __init__(self, interval_s: float = 0.005):
        from hpsft.utils.perf import rss_anon_bytes

        self.read = rss_anon_bytes
        self.whole = self.window = self.read()
        self.interval_s = interval_s
        threading.Thread(target=self.sample, daemon=True).start()

    def sample(self) -> None:
        while True:
            now = self.read()
            self.whole, self.window = max(self.whole, now), max(self.window, now)
            time.sleep(self.interval_s)

    def reset(self) -> None:
        self.window = self.read()


def tensors_in(value, depth: int = 0):
    """The tensors in an attribute of DeepSpeed's optimizer: a tensor, or lists/dicts of them."""
    if torch.is_tensor(value):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth + 1)


def training_state_bytes(engine) -> dict:
    """This rank's parameter, gradient and optimizer bytes, by tensor, each storage once. The
    module's parameters are counted first, so ZeRO's flat buffer they are views of is a
    parameter; without ZeRO the optimizer's parameters are the module's own."""
    seen, totals, sources = set(), {"param": 0, "grad": 0, "optim": 0}, {}

    def count(tensor: torch.Tensor, kind: str, source: str) -> None:
        if tensor.is_meta:  # DeepSpeed's shape-only records hold no memory
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            totals[kind] += storage.nbytes()
            sources[f"{kind}: {source}"] = sources.get(f"{kind}: {source}", 0) + storage.nbytes()

    ds_optimizer = engine.engine.optimizer
    torch_optimizer = getattr(ds_optimizer, "optimizer", ds_optimizer)
    for p in engine.module.parameters():
        count(p, "param", "module parameters")
        if p.grad is not None:
            count(p.grad, "grad", "module parameters' .grad")
    for group in torch_optimizer.param_groups:
        for p in group["params"]:
            count(p, "optim", "AdamW's parameters (ZeRO's fp32 master partitions)")
            if p.grad is not None:
                count(p.grad, "grad", "AdamW's parameters' .grad")
    for state in torch_optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                count(value, "optim", f"AdamW state {key}")
    if ds_optimizer is not torch_optimizer:  # ZeRO's own buffers: gradient buckets and partitions
        for name, value in vars(ds_optimizer).items():
            for tensor in tensors_in(value):
                count(tensor, "grad" if "grad" in name or "ipg" in name else "optim", f"ZeRO optimizer .{name}")
    return {"totals": totals, "sources": sources}


def worker(args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpsft.config import load_config
    from hpsft.data.batch import target_mask
    from hpsft.data.device_feed import device_feed, pinned
    from hpsft.engine.deepspeed import DeepSpeedEngine
    from hpsft.models import PackedCausalLM
    from hpsft.models.tensor_parallel import check_tensor_parallel
    from hpsft.models.varlen_attention import ATTN_IMPLEMENTATION
    from hpsft.utils import distributed
    from hpsft.workers.training_worker import token_mean_loss

    rss = RssAnonPeak()
    distributed.init_distributed("nccl" if args.device == "cuda" else "gloo")
    tp = distributed.world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    config = load_config(None, ["engine.zero_stage=1", f"engine.tensor_parallel_size={tp}",
                                f"engine.dtype={args.dtype}", f"engine.vocab_parallel_head={args.vocab_parallel_head}"])
    lm_config = LlamaConfig(**SHAPE, num_hidden_layers=args.layers, use_cache=False)
    lm_config._attn_implementation = ATTN_IMPLEMENTATION
    check_tensor_parallel(lm_config, tp)
    torch.manual_seed(0)
    with device:
        lm = LlamaForCausalLM(lm_config)
    parameters = sum(p.numel() for p in lm.parameters())
    engine = DeepSpeedEngine(config.engine, config.optim, total_steps=1000, mesh=distributed.mesh(config.engine))
    engine.initialize(PackedCausalLM(lm))
    counted = {}
    optimizer_step = engine.engine.optimizer.step

    def counting_step(*step_args, **step_kwargs):  # the census as the step starts: all gradients reduced
        counted.update(training_state_bytes(engine))
        return optimizer_step(*step_args, **step_kwargs)

    engine.engine.optimizer.step = counting_step

    generator = torch.Generator().manual_seed(1000)  # the same rows on every rank: DP=1
    steps = [[packed_micro_batch(args.tokens, lm_config.vocab_size, generator)[0] for _ in range(args.micro_batches)]
             for _ in range(args.steps + 1)]
    feed = device_feed(device)
    times, losses = [], []
    for index, step in enumerate(steps):
        micro_batches = [pinned(mb, feed) for mb in step]
        total = sum(int(target_mask(mb["loss_mask"], mb["offsets"]).sum()) for mb in micro_batches)
        if index == 1:
            rss.reset()  # the steps' window starts after the warm-up
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        result = engine.train_batch(micro_batches, lambda out: token_mean_loss(out, total))
        sync()
        times.append(time.perf_counter() - start)
        losses.append(sum(float(out["nll"]) for out in result.outputs) / total)
    time.sleep(0.02)  # one more RssAnon sample
    out = {"rank": distributed.rank(), "tp": tp, "parameters": parameters, "step_s": times, "losses": losses,
           "tokens_per_step": args.tokens * args.micro_batches, "threads": torch.get_num_threads(),
           "bytes": counted, "rss_anon_peak": rss.whole, "rss_anon_steps_peak": rss.window,
           "cuda_max_allocated": torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
           "engine_stage": engine.stage}
    Path(args.out, f"{run_label(tp, args.vocab_parallel_head)}_rank{distributed.rank()}.json").write_text(json.dumps(out))


def run_label(tp: int, vocab_parallel_head: bool) -> str:
    """A run's name in --tp: the TP size, with "v" when the head is sharded by vocabulary."""
    return f"{tp}v" if vocab_parallel_head else str(tp)


def launch(args, label: str, folder: str) -> list[dict]:
    """One configuration in its own processes: torchrun with `tp` ranks (engine.vocab_parallel_head
    when the label ends in "v")."""
    tp, vocab_parallel_head = int(label.rstrip("v")), label.endswith("v")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // tp)))
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}", __file__,
               "--worker", "--out", folder, "--layers", str(args.layers), "--tokens", str(args.tokens),
               "--micro-batches", str(args.micro_batches), "--steps", str(args.steps), "--device", args.device,
               "--dtype", args.dtype, *(["--vocab-parallel-head"] if vocab_parallel_head else [])]
    subprocess.run(command, env=env, check=True)
    return [json.loads(Path(folder, f"{label}_rank{r}.json").read_text()) for r in range(tp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,2,2v", help="TP sizes to run, comma-separated (1 first: the baseline); "
                        "a size ending in v runs with engine.vocab_parallel_head=true (the head sharded by vocabulary)")
    parser.add_argument("--vocab-parallel-head", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of each packed micro-batch")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=2, help="measured steps, after one warm-up step")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="a folder for each rank's JSON (a temporary one by default)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    sizes = args.tp.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or scratch
        Path(folder).mkdir(parents=True, exist_ok=True)
        runs = {tp: launch(args, tp, folder) for tp in sizes}
    first = runs[sizes[0]][0]
    print(f"{args.layers}-layer SmolLM2-135M-shaped Llama (8 heads / 4 KV heads of 72, {first['parameters'] / 1e6:.1f}M "
          f"parameters, random init), {args.dtype} on {args.device}, engine.zero_stage=1, {args.micro_batches} "
          f"packed micro-batch(es) of {args.tokens} random tokens a step; medians of {args.steps} steps after one "
          f"warm-up; torch {torch.__version__}")
    print("| TP | head | ranks | ZeRO stage run | threads/rank | step s | tokens/s | param+grad+optim MiB per rank "
          "(param / grad / optim) | ratio to TP=1 | RssAnon MiB per rank, peak (during the steps) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for tp, ranks in runs.items():
        step_s = statistics.median(max(r["step_s"][i] for r in ranks) for i in range(1, args.steps + 1))
        state = max(sum(r["bytes"]["totals"].values()) for r in ranks)
        base = base or state
        parts = " / ".join(f"{max(r['bytes']['totals'][k] for r in ranks) / MIB:.1f}" for k in ("param", "grad", "optim"))
        rss = f"{max(r['rss_anon_peak'] for r in ranks) / MIB:.0f} ({max(r['rss_anon_steps_peak'] for r in ranks) / MIB:.0f})"
        cuda = ranks[0]["cuda_max_allocated"]
        if cuda is not None:
            rss += f"; max_memory_allocated {max(r['cuda_max_allocated'] for r in ranks) / MIB:.0f}"
        head = "vocabulary-sharded" if tp.endswith("v") else "replicated"
        print(f"| {tp.rstrip('v')} | {head} | {len(ranks)} | {ranks[0]['engine_stage']} | {ranks[0]['threads']} | {step_s:.3f} | "
              f"{ranks[0]['tokens_per_step'] / step_s:.0f} | {state / MIB:.1f} ({parts}) | {state / base:.2f}x | {rss} |")
    for tp, ranks in runs.items():
        print(f"TP={tp} losses per step (rank 0): {', '.join(f'{x:.6f}' for x in ranks[0]['losses'])}; rank 0's "
              "tensors, MiB: " + "; ".join(f"{k} {v / MIB:.1f}" for k, v in ranks[0]["bytes"]["sources"].items()))


if __name__ == "__main__":
    main()
