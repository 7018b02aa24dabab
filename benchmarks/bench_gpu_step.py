"""An end-to-end bf16 training step of a Llama-3.2-1B-shaped model on packed micro-batches.

The model is built from a LlamaConfig with Llama-3.2-1B's shape (16 layers, hidden 2048,
MLP 8192, 32 query / 8 key-value heads, vocabulary 128256, tied embedding) and random
weights: nothing is downloaded. It runs through hpsft's own pieces as the trainer does:
PackedCausalLM (the fused varlen loss, hpsft_varlen attention) in hpsft's DeepSpeedEngine
(engine.dtype=bfloat16, ZeRO-1), on packed rows of --tokens tokens (documents of 256-4096
tokens, the last two thirds of each supervised). Prints, per step after a warm-up, the step
time, tokens/s and MFU (model FLOPs as the trainer counts them, hpsft/utils/perf.py, over
--peak-tflops per rank), and then hpsft's loss against Liger-Kernel's fused linear
cross-entropy on the same hidden states, LM-head weight and labels (when liger_kernel is
importable; a line says so otherwise): loss and d(hidden) within bf16 tolerances.

With --engine megatron the same step runs on hpsft's Megatron-Core engine (engine.name=megatron,
--tensor-parallel-size TP; DP = the other ranks): tokens/s of the replicas' rows and MFU per
rank (a replica's FLOPs over its TP ranks); no Liger comparison there.

    python benchmarks/bench_gpu_step.py --out DIR                  # one GPU (scripts/gpu_checks.sh)
    python benchmarks/bench_gpu_step.py --engine megatron --out DIR                                  # TP=1
    torchrun --nproc_per_node 2 benchmarks/bench_gpu_step.py --engine megatron --tensor-parallel-size 2 ...
    torchrun --nproc_per_node 2 benchmarks/bench_gpu_step.py ...   # 2 ranks
    .venv/bin/python benchmarks/bench_gpu_step.py --shape tiny --device cpu --tokens 256   # the flow, on CPU

Exit status 0, or 3 when hpsft's loss and Liger's disagree.
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # LlamaConfig keyword arguments
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
               max_position_embeddings=131072),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=True,
                 max_position_embeddings=4096),
}
# hpsft vs Liger on the same bf16 inputs, both accumulating in fp32: the loss differs by the
# order of fp32 sums; d(hidden) by one bf16 rounding of d(logits) each (2^-9 relative).
LOSS_RTOL = 1e-3
GRAD_RTOL = 2e-2


def packed_micro_batch(tokens: int, vocab_size: int, generator: torch.Generator) -> tuple[dict, list[int]]:
    """One packed row of exactly `tokens` tokens and its documents' lengths."""
    from hpsft.data.batch import collate_jagged, packed_row

    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(256, 4097, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - tokens
    lengths = [n for n in lengths if n > 0]
    samples = []
    for index, n in enumerate(lengths):
        loss_mask = torch.zeros(n, dtype=torch.bool)
        loss_mask[n // 3:] = True
        samples.append({"input_ids": torch.randint(0, vocab_size, (n,), generator=generator), "loss_mask": loss_mask,
                        "index": index})
    return packed_row(collate_jagged(samples)), lengths


def build_engine(shape: str, dtype: str, device: torch.device, engine_name: str, tp: int):
    """DeepSpeed ZeRO-1 (one process: DP = the ranks), or the Megatron engine at TP = tp (DP = the
    rest of the ranks), on the random-init Llama of `shape`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpsft.config.schema import EngineConfig, OptimConfig
    from hpsft.engine.factory import engine_class
    from hpsft.utils.distributed import Mesh, mesh
    from hpsft.models import PackedCausalLM
    from hpsft.models.varlen_attention import ATTN_IMPLEMENTATION

    config = LlamaConfig(**SHAPES[shape], use_cache=False)
    config._attn_implementation = ATTN_IMPLEMENTATION
    torch.manual_seed(0)
    with device:  # random init on the device: seconds on a GPU, not minutes on its host
        lm = LlamaForCausalLM(config)
    if engine_name == "deepspeed":
        engine_config, layout = EngineConfig(zero_stage=1, dtype=dtype), Mesh(dp_size=1)  # one process
    else:
        engine_config = EngineConfig(name="megatron", tensor_parallel_size=tp, dtype=dtype)
        layout = mesh(engine_config)
    engine = engine_class(engine_config.name)(engine_config, OptimConfig(), total_steps=1000, mesh=layout)
    engine.initialize(PackedCausalLM(lm))
    return engine, lm


def compare_with_liger(module, micro_batch: dict, device: torch.device) -> dict:
    """hpsft's fused loss and Liger's on the same hidden states, weight and labels."""
    from hpsft.data.batch import shifted_labels
    from hpsft.ops import varlen_linear_cross_entropy

    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in micro_batch.items()}
    with torch.no_grad():
        hidden, _ = module.hidden_states(batch["input_ids"], batch["position_ids"], batch["offsets"], batch["max_length"])
    labels = shifted_labels(batch["input_ids"][0], batch["loss_mask"], batch["offsets"])
    weight = module.lm.get_output_embeddings().weight.detach()
    results = {}
    for name in ("hpsft", "liger"):
        x = hidden.detach().clone().requires_grad_(True)
        if name == "hpsft":
            loss = varlen_linear_cross_entropy(x, weight, labels=labels, reduction="sum").loss
        else:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, x, labels)
        loss.backward()
        results[name] = (loss.item(), x.grad.float())
    (loss_h, grad_h), (loss_l, grad_l) = results["hpsft"], results["liger"]
    return {"loss_hpsft": loss_h, "loss_liger": loss_l, "loss_rel_diff": abs(loss_h - loss_l) / abs(loss_l),
            "grad_hidden_rel_diff": float((grad_h - grad_l).norm() / grad_l.norm())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of each packed micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="measured steps, after one warm-up step")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per rank (H100/H200: 989)")
    parser.add_argument("--engine", choices=["deepspeed", "megatron"], default="deepspeed",
                        help="hpsft's DeepSpeed engine (ZeRO-1) or its Megatron-Core engine")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="the Megatron engine's TP size")
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")

    from hpsft.utils import distributed
    from hpsft.data.batch import target_mask
    from hpsft.data.device_feed import device_feed, pinned
    from hpsft.utils.perf import flop_counts, model_flops

    distributed.init_distributed()
    rank, world = distributed.rank(), distributed.world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.engine == "deepspeed" and args.tensor_parallel_size != 1:
        sys.exit("--tensor-parallel-size: the Megatron engine's (--engine megatron); DeepSpeed runs ZeRO-1 here")
    engine, lm = build_engine(args.shape, args.dtype, device, args.engine, args.tensor_parallel_size)
    tp = args.tensor_parallel_size if args.engine == "megatron" else 1
    replicas = world // tp  # data-parallel replicas: each its own rows
    body, head = flop_counts(lm)
    generator = torch.Generator().manual_seed(1000 + rank // tp)  # each replica its own data (a TP group the same)
    steps = [[packed_micro_batch(args.tokens, lm.config.vocab_size, generator) for _ in range(args.micro_batches)]
             for _ in range(args.steps + 1)]
    feed = device_feed(device)
    loss_fn = lambda out: out["loss"] / out["n_tokens"].clamp_min(1)  # noqa: E731 (each micro-batch its own mean)

    rows = []
    for index, step in enumerate(steps):
        # Pinned on CUDA, outside the timed step: as TrainingWorker builds its rows before it times.
        micro_batches = [pinned(mb, feed) for mb, _ in step]
        lengths = [n for _, doc_lengths in step for n in doc_lengths]
        loss_tokens = sum(int(target_mask(mb["loss_mask"], mb["offsets"]).sum()) for mb in micro_batches)
        sync()
        start = time.perf_counter()
        result = engine.train_batch(micro_batches, loss_fn)
        sync()
        seconds = time.perf_counter() - start
        flops = model_flops(body, head, lm.config.num_hidden_layers, lm.config.hidden_size, lengths, loss_tokens)
        loss = statistics.fmean(float(out["loss"] / out["n_tokens"]) for out in result.outputs) if result.outputs \
            else float("nan")  # a rank that reports no outputs (not the last stage)
        rows.append({"step": index, "seconds": seconds, "tokens": sum(lengths), "flops": flops, "loss": loss,
                     "grad_norm": result.grad_norm})
    measured = rows[1:] or rows
    seconds = statistics.median(r["seconds"] for r in measured)
    tokens_per_s = replicas * measured[0]["tokens"] / seconds
    # MFU per rank: a TP group shares one replica's FLOPs.
    mfu = statistics.median(r["flops"] / tp / r["seconds"] for r in measured) / (args.peak_tflops * 1e12)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    summary = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "engine": args.engine, "tensor_parallel_size": tp, "ranks": world, "dtype": args.dtype,
               "tokens_per_micro_batch": args.tokens,
               "micro_batches": args.micro_batches, "step_s": seconds, "tokens_per_s": tokens_per_s, "mfu": mfu,
               "max_memory_allocated_gib": peak_gib, "steps": rows,
               "parameters": sum(p.numel() for p in lm.parameters())}
    if rank == 0:
        layout = "ZeRO-1" if args.engine == "deepspeed" else f"Megatron engine, TP={tp}"
        print(f"{args.shape}-shaped Llama ({summary['parameters'] / 1e9:.2f}B parameters), {world} rank(s), "
              f"{args.dtype}, {layout}, {args.micro_batches} micro-batches of {args.tokens} packed tokens a step")
        print("| step | seconds | tokens (all ranks) | tokens/s | MFU | loss | grad norm |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['step']}{' (warm-up)' if r['step'] == 0 else ''} | {r['seconds']:.3f} | {replicas * r['tokens']} | "
                  f"{replicas * r['tokens'] / r['seconds']:.0f} | {r['flops'] / tp / r['seconds'] / (args.peak_tflops * 1e12):.1%} "
                  f"| {r['loss']:.4f} | {r['grad_norm']:.3f} |")
        print(f"median after the warm-up: {seconds:.3f} s a step, {tokens_per_s:.0f} tokens/s, MFU {mfu:.1%} of "
              f"{args.peak_tflops:g} TFLOP/s per rank; max_memory_allocated {peak_gib:.1f} GiB")
    status = 0
    if importlib.util.find_spec("liger_kernel") is None:
        if rank == 0:
            print("Liger-Kernel: not importable here, no loss comparison")
    elif args.engine == "megatron":
        if rank == 0:
            print("Liger-Kernel: not compared on the Megatron engine (its hidden states are Megatron's GPTModel's)")
    elif args.device == "cuda":  # Liger's kernels are Triton on CUDA only
        compared = compare_with_liger(engine.module, steps[0][0][0], device)
        summary["liger"] = compared
        ok = compared["loss_rel_diff"] <= LOSS_RTOL and compared["grad_hidden_rel_diff"] <= GRAD_RTOL
        if rank == 0:
            print(f"loss on micro-batch 0: hpsft {compared['loss_hpsft']:.6g}, Liger {compared['loss_liger']:.6g}, "
                  f"relative difference {compared['loss_rel_diff']:.2e} (<= {LOSS_RTOL:g}); d(hidden) "
                  f"{compared['grad_hidden_rel_diff']:.2e} of its norm (<= {GRAD_RTOL:g}): {'agree' if ok else 'DISAGREE'}")
        status = 0 if ok else 3
    elif rank == 0:
        print("Liger-Kernel: its kernels need CUDA, no loss comparison on CPU")
    if rank == 0 and args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = ("gpu_step" if args.engine == "deepspeed" else f"gpu_step_megatron_tp{tp}") + \
            ("" if world == 1 else f"_{world}ranks") + ".json"
        (args.out / name).write_text(json.dumps(summary, indent=1))
    sys.exit(status)


if __name__ == "__main__":
    main()
