"""Padded baseline vs hpsft packing: same model, same data, same sequences, one run.

(a) padded: the usual Hugging Face way: fixed micro-batch size, right padding to the
    longest sequence of the micro-batch, attention_mask, labels with -100, model(...).loss
    (full logits materialised).
(b) packed: hpsft: token-budget micro-batches, one packed row each (position ids restart
    per sequence), varlen attention (flash-attn on GPU when installed, per-sequence SDPA
    otherwise), the fused varlen loss on the supervised positions only.
Each mode runs forward + backward over the same sequences (the optimizer step is the same
work in both, so it is left out); the table reports real
tokens/s, padding efficiency (real / computed tokens), peak RSS and MFU against a GEMM
peak measured in this run. Each mode runs in its own process so peak RSS is its own.

    python benchmarks/bench_packing.py [--model DIR] [--data FILE] [--sequences N] [--device cpu|cuda]
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def load_sequences(data: str, model: str, n: int):
    from hpsft.data.preparation import prepared_store
    from hpsft.data.rows import TokenizeOptions
    from hpsft.models import load_tokenizer

    opts = TokenizeOptions("messages", "prompt", "response", "tools", None, 1024, "right", "skip")
    ds = prepared_store(data, load_tokenizer(model), opts, ".cache/tokenized")
    return [ds[i] for i in range(min(n, len(ds)))]


def run_mode(mode: str, args) -> dict:
    from hpsft.data.batch import collate_jagged, packed_row, select, seqlens
    from hpsft.data.microbatch import min_micro_batches, plan_micro_batches
    from hpsft.models import PackedCausalLM, load_causal_lm
    from hpsft.data.batch import loss_token_count
    from hpsft.utils.perf import flop_counts, measure_matmul_peak, model_flops

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    samples = load_sequences(args.data, args.model, args.sequences)
    # The baseline attends the usual way (transformers' sdpa with a padding mask).
    lm = load_causal_lm(args.model, "sdpa" if mode == "padded" else "auto").to(device)
    cfg = lm.config
    peak = measure_matmul_peak(2048, cfg.hidden_size, cfg.intermediate_size, dtype, device)
    model = PackedCausalLM(lm).to(device)
    body_params, head_params = flop_counts(lm)
    lengths = [s["input_ids"].numel() for s in samples]

    if mode == "padded":
        micro_batches = [samples[i:i + args.micro_batch_size] for i in range(0, len(samples), args.micro_batch_size)]
    else:
        batch = collate_jagged(samples)
        lens = seqlens(batch).tolist()
        bins = plan_micro_batches(lens, min_micro_batches(lens, None, args.max_tokens), None, args.max_tokens)
        micro_batches = [packed_row(select(batch, b)) for b in bins]

    def step(mb):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if mode == "padded":
                longest = max(s["input_ids"].numel() for s in mb)
                ids = torch.full((len(mb), longest), cfg.pad_token_id or 0, dtype=torch.long)
                attn = torch.zeros(len(mb), longest, dtype=torch.long)
                labels = torch.full((len(mb), longest), -100, dtype=torch.long)
                for r, s in enumerate(mb):
                    n = s["input_ids"].numel()
                    ids[r, :n], attn[r, :n] = s["input_ids"], 1
                    labels[r, :n] = torch.where(s["loss_mask"], s["input_ids"], -100)
                out = lm(input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device), use_cache=False)
                out.loss.backward()
                return ids.numel()
            row = {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}
            out = model(**row)
            loss_sum, n_tokens = out["loss"], out["n_tokens"]
            (loss_sum / n_tokens.clamp_min(1)).backward()
            return row["input_ids"].numel()

    step(micro_batches[0])  # warm-up
    model.zero_grad()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    computed = 0
    for mb in micro_batches:
        computed += step(mb)
    sync()
    elapsed = time.perf_counter() - start
    loss_tokens = loss_token_count(collate_jagged(samples))
    flops = model_flops(body_params, head_params, cfg.num_hidden_layers, cfg.hidden_size, lengths, loss_tokens)
    peak_mem = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {
        "mode": mode, "sequences": len(samples), "micro_batches": len(micro_batches),
        "tokens_per_s": sum(lengths) / elapsed, "padding_efficiency": sum(lengths) / computed,
        "peak_mem_mib": peak_mem, "mfu": flops / elapsed / peak, "peak_gflops": peak / 1e9, "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".cache/models/smollm2-135m-4l")
    parser.add_argument("--data", default=".cache/data/chatterbot/train.parquet")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mode", choices=["padded", "packed"], help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args)))
        return
    rows = []
    for mode in ("padded", "packed"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]
    print(f"model={args.model} data={args.data} device={args.device} "
          f"padded micro-batch={args.micro_batch_size} seqs, packed budget={args.max_tokens} tokens")
    print("| mode | seqs | micro-batches | tokens/s | x padded | padding eff. | peak mem MiB | GEMM peak GFLOP/s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['sequences']} | {r['micro_batches']} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['padding_efficiency']:.3f} | "
              f"{r['peak_mem_mib']:.0f} | {r['peak_gflops']:.0f} | {r['mfu']:.1%} |")


if __name__ == "__main__":
    main()
