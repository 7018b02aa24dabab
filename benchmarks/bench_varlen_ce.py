"""Fused varlen linear cross-entropy vs materialised logits vs torch's F.linear_cross_entropy.

Each (shape, method) runs in its own process: inputs are built, one warm-up fwd+bwd runs,
the RSS high-water mark is reset (/proc/self/clear_refs), then the measured fwd+bwd runs.
"peak extra" = VmHWM during the measured runs - RSS before them: the memory the loss adds on
top of its inputs (logits, softmax, gradients, including d(weight) and d(hidden), which
every method produces). Time is the median fwd+bwd wall time over --repeats runs.

    .venv/bin/python benchmarks/bench_varlen_ce.py            # the table in docs/ops.md
    .venv/bin/python benchmarks/bench_varlen_ce.py --quick    # small shapes, seconds
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from hpsft.ops.fused_linear_ce import default_chunk_rows

METHODS = {
    "hpsft": "hpsft varlen_linear_cross_entropy (backend auto)",
    "materialised": "F.cross_entropy on materialised logits",
    "torch_linear_ce": "F.linear_cross_entropy (chunked, same rows per chunk)",
}
FULL_CASES = [  # (H, V, tokens, supervised fraction)
    (576, 49152, 1024, 1.0),
    (576, 49152, 4096, 1.0),
    (576, 49152, 8192, 1.0),
    (576, 49152, 8192, 1 / 3),
    (4096, 128256, 256, 1.0),
]
QUICK_CASES = [(64, 4096, 512, 1.0), (64, 4096, 512, 1 / 3)]


def rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def make_inputs(hidden_size, vocab_size, tokens, supervised_fraction, seq_len=512):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab_size, hidden_size, generator=gen) / hidden_size**0.5).requires_grad_()
    input_ids = torch.randint(0, vocab_size, (tokens,), generator=gen)
    offsets = torch.arange(0, tokens + 1, min(seq_len, tokens))
    # Chat-like: the first (1 - fraction) of every sequence is prompt, the rest is supervised.
    position = torch.arange(tokens) % min(seq_len, tokens)
    loss_mask = (position >= round((1 - supervised_fraction) * min(seq_len, tokens))).long()
    # The same supervision as aligned labels, for the methods that take per-row targets.
    labels = torch.full((tokens,), -100)
    starts = torch.zeros(tokens + 1, dtype=torch.bool)
    starts[offsets] = True
    predicts = loss_mask[1:].bool() & ~starts[1:tokens]
    labels[:-1][predicts] = input_ids[1:][predicts]
    return hidden, weight, input_ids, offsets, loss_mask, labels


def loss_fn(method, hidden, weight, input_ids, offsets, loss_mask, labels):
    if method == "hpsft":
        from hpsft.ops import varlen_linear_cross_entropy

        out = varlen_linear_cross_entropy(hidden, weight, input_ids=input_ids, offsets=offsets, loss_mask=loss_mask)
        return out.loss, out.backend
    if method == "materialised":
        return F.cross_entropy(hidden @ weight.t(), labels, reduction="sum"), "torch"
    # Same rows per chunk as hpsft: LinearCrossEntropyOptions() ("auto") measured 10-20x slower
    # than materialised logits on this CPU at 1024 tokens.
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=default_chunk_rows(weight.shape[0], torch.float32))
    return F.linear_cross_entropy(hidden, weight, labels, reduction="sum", ignore_index=-100, options=options), "torch"


def run_one(method, hidden_size, vocab_size, tokens, fraction, repeats):
    inputs = make_inputs(hidden_size, vocab_size, tokens, fraction)
    hidden, weight = inputs[:2]

    def step():
        hidden.grad = weight.grad = None
        loss, backend = loss_fn(method, *inputs)
        loss.backward()
        return loss.item(), backend

    loss, backend = step()  # warm-up: JIT/lazy init, thread pools, allocator
    hidden.grad = weight.grad = None
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM to the current RSS
    before = rss_kib("VmRSS")
    wall, cpu = [], []
    for _ in range(repeats):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    return {
        "time_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),  # all threads; less sensitive than wall time to other load
        "peak_extra_mib": (rss_kib("VmHWM") - before) / 1024,
        "loss": loss,
        "backend": backend,
    }


def run_isolated(method, case, repeats):
    command = [sys.executable, __file__, "--child", method, *map(str, case), "--repeats", str(repeats)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr else f"exit {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", nargs=4, type=float, action="append", metavar=("H", "V", "TOKENS", "FRACTION"),
                        help="run only this shape (repeatable)")
    parser.add_argument("--child", nargs=5, metavar=("METHOD", "H", "V", "TOKENS", "FRACTION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, h, v, tokens, fraction = args.child
        print(json.dumps(run_one(method, int(h), int(v), int(tokens), float(fraction), args.repeats)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, fwd+bwd, reduction sum")
    print("F.linear_cross_entropy: " + ("present" if hasattr(F, "linear_cross_entropy") else "absent in this torch"))
    header = (
        "| H | V | tokens | supervised | method | wall s | CPU s | peak extra MiB "
        "| wall / materialised | CPU / materialised | memory / materialised |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    cases = [(int(h), int(v), int(t), f) for h, v, t, f in args.case] if args.case else QUICK_CASES if args.quick else FULL_CASES
    for case in cases:
        results = {method: run_isolated(method, case, args.repeats) for method in METHODS}
        base = results["materialised"]
        for method, result in results.items():
            h, v, tokens, fraction = case
            prefix = f"| {h} | {v} | {tokens} | {fraction:.2f} | {METHODS[method]}"
            if "error" in result:
                print(f"{prefix} | failed: {result['error']} | | | | | |")
                continue
            name = f"{prefix} [{result['backend']}]" if method == "hpsft" else prefix
            ratios = " | |"
            if "error" not in base:
                ratios = " | ".join(
                    f"{result[key] / max(base[key], 1e-9):.{digits}f}"
                    for key, digits in (("time_s", 2), ("cpu_s", 2), ("peak_extra_mib", 3))
                )
            print(f"{name} | {result['time_s']:.2f} | {result['cpu_s']:.2f} | {result['peak_extra_mib']:.0f} | {ratios} |", flush=True)
    print(f"load average after the run: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
