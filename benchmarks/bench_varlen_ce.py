"""Fused varlen linear cross-entropy vs materialised logits vs torch's F.linear_cross_entropy.

Each (shape, method) runs in its own process: inputs are built, one warm-up fwd+bwd runs,
the RSS high-water mark is reset (/proc/self/clear_refs), then the measured fwd+bwd runs.
"peak extra" = VmHWM during the measured runs - RSS before them: the memory the loss adds on
top of its inputs (logits, softmax, gradients, including d(weight) and d(hidden), which
every method produces). Time is the median fwd+bwd wall time over --repeats runs.

Before a time is printed, every method's loss and gradients are cross-checked against an
fp64 reference computed in its own process from the same inputs (online log-sum-exp over
row and vocabulary blocks, so it never holds the logits or an fp64 weight): the loss, the
d(hidden) rows of 8 sampled supervised tokens and the d(weight) rows of 8 sampled
vocabulary entries (4 of them labels). A method that disagrees is reported, not timed.

--account: no timing; the peak extra memory the GPU run would measure, from the byte
accounting (hpsft/ops/byte_accounting.py: the CUDA path's allocations replayed on meta
tensors), for hpsft and for Liger-Kernel's algorithm at the same shapes, in seconds on CPU.

--device cuda: bf16 inputs (what a GPU trainer feeds the LM head), time between
torch.cuda.synchronize() calls, peak extra = torch.cuda.max_memory_allocated() after
reset_peak_memory_stats() minus memory_allocated() before the measured runs. Adds rows for
Liger-Kernel's fused linear cross-entropy (when installed),
and an achieved TFLOP/s column counting 6*N*H*V FLOPs (N supervised tokens: the three
GEMMs, logits, d(hidden) and d(weight), of 2*N*H*V each) with its fraction of --peak-tflops.

    .venv/bin/python benchmarks/bench_varlen_ce.py            # the table in docs/ops.md
    .venv/bin/python benchmarks/bench_varlen_ce.py --quick    # small shapes, seconds
    .venv/bin/python benchmarks/bench_varlen_ce.py --account  # GPU memory, counted on CPU
    python benchmarks/bench_varlen_ce.py --device cuda        # GPU table (scripts/gpu_checks.sh)
"""

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from hpsft.ops.chunk_rows import cpu_chunk_rows

METHODS = {
    "hpsft": "hpsft varlen_linear_cross_entropy (backend auto)",
    "materialised": "F.cross_entropy on materialised logits",
    "torch_linear_ce": "F.linear_cross_entropy (chunked, same rows per chunk)",
}
FULL_CASES = [  # (H, V, tokens, supervised fraction): SmolLM2-135M's LM head, and Llama-3-8B's
    (576, 49152, 8192, 1.0),
    (576, 49152, 8192, 1 / 3),
    (4096, 128256, 2048, 1.0),
]
QUICK_CASES = [(64, 4096, 512, 1.0), (64, 4096, 512, 1 / 3)]
# GPU-only methods (the CPU table keeps the three above).
GPU_METHODS = {
    "liger": "Liger-Kernel LigerFusedLinearCrossEntropyLoss",
    # d(weight) summed into an fp32 (V, H) buffer that exists before the step, as the engine's
    # fp32 gradient does under bf16 ZeRO-0/1 (the trainer's path there): its own chunk rule.
    "hpsft_engine": "hpsft varlen_linear_cross_entropy, d(weight) into an fp32 buffer",
    # The chunk cap of the design before (4096 rows): how much time the memory budget costs.
    "hpsft_4096": "hpsft varlen_linear_cross_entropy, chunk_rows=4096",
}
# GPU targets: hpsft fwd+bwd >= 60 % of bf16 dense peak, and extra memory <= Liger's, at N=8192
# and 32768, H=4096, V=128256 (issue 12). Measured on an H200: docs/gpu_results.md.
GPU_CASES = [
    (4096, 128256, 8192, 1.0),
    (4096, 128256, 32768, 1.0),
]
TARGET_CASES = GPU_CASES
TARGET_FRACTION_OF_PEAK = 0.6


def rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def make_inputs(hidden_size, vocab_size, tokens, supervised_fraction, seq_len=512, device="cpu"):
    # fp32 on CPU; bf16 on GPU. The random values are drawn on the device itself (a CPU draw of
    # a 128256 x 4096 weight costs seconds per process); on CPU .to()/.cpu() below are no-ops.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocab_size, hidden_size, generator=gen, device=device) / hidden_size**0.5).to(dtype).requires_grad_()
    input_ids = torch.randint(0, vocab_size, (tokens,), generator=gen, device=device).cpu()
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
    return (hidden, weight, *(t.to(device) for t in (input_ids, offsets, loss_mask, labels)))


def loss_fn(method, hidden, weight, input_ids, offsets, loss_mask, labels, weight_grad_buffer=None):
    if method.startswith("hpsft"):
        from hpsft.ops import varlen_linear_cross_entropy

        # grad_scale=1: the upstream gradient loss.backward() sends. As in the trainer, which
        # passes its step's scale, the gradients are finished in forward and backward has no
        # pass over them (Liger skips its scaling pass when the upstream gradient is 1).
        chunk_rows = 4096 if method == "hpsft_4096" else None
        out = varlen_linear_cross_entropy(hidden, weight, input_ids=input_ids, offsets=offsets, loss_mask=loss_mask,
                                          chunk_rows=chunk_rows, grad_scale=1.0, grad_weight_into=weight_grad_buffer)
        return out.loss, out.backend
    if method == "materialised":
        # .float(): the usual Hugging Face loss upcasts bf16 logits (a no-op on fp32 CPU inputs).
        return F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="sum"), "torch"
    if method == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        # Liger 0.8.x: forward(lin_weight, _input, target, bias=None); ignore_index defaults to -100.
        return LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, hidden, labels), "liger"
    # CPU: the same rows per chunk as hpsft (LinearCrossEntropyOptions() ("auto") measured 10-20x
    # slower than materialised logits on this CPU at 1024 tokens); GPU: torch's own choice.
    on_cpu = hidden.device.type == "cpu"
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=cpu_chunk_rows(weight.shape[0], 4)) if on_cpu else None
    return F.linear_cross_entropy(hidden, weight, labels, reduction="sum", ignore_index=-100, options=options), "torch"


PROBES = 8  # sampled rows of d(hidden) and of d(weight) in the cross-check


def probe_indices(labels, vocab_size):
    """(token rows, vocabulary rows) whose gradients are cross-checked: supervised tokens, and
    vocabulary entries half of which are their labels (rows with a large gradient)."""
    gen = torch.Generator().manual_seed(1)
    supervised = (labels.cpu() != -100).nonzero().squeeze(1)
    rows = supervised[torch.randperm(len(supervised), generator=gen)[:PROBES]]
    vocab = torch.cat([labels.cpu()[rows[: PROBES // 2]], torch.randint(0, vocab_size, (PROBES - PROBES // 2,), generator=gen)])
    return rows, vocab


def probe(loss, grad_hidden, grad_weight, labels):
    rows, vocab = probe_indices(labels, grad_weight.shape[0])
    return {
        "loss": float(loss),
        "grad_hidden": grad_hidden[rows.to(grad_hidden.device)].double().cpu().tolist(),
        "grad_weight": grad_weight[vocab.to(grad_weight.device)].double().cpu().tolist(),
    }


def reference_probe(hidden, weight, labels, row_block=1024, vocab_block=8192):
    """The probe in fp64, from the definition: loss = sum over supervised rows of lse - z_y,
    d z = softmax - onehot. Blocks keep memory small (an fp64 copy of a 128k x 4096 weight is 4 GiB)."""
    rows_all = (labels != -100).nonzero().squeeze(1)
    x, y = hidden.detach()[rows_all], labels[rows_all]
    w = weight.detach()
    lse = torch.empty(len(rows_all), dtype=torch.float64, device=x.device)
    for r in range(0, len(rows_all), row_block):
        xs = x[r : r + row_block].double()
        running = torch.full((len(xs),), float("-inf"), dtype=torch.float64, device=x.device)
        for v in range(0, w.shape[0], vocab_block):
            running = torch.logaddexp(running, torch.logsumexp(xs @ w[v : v + vocab_block].double().t(), dim=1))
        lse[r : r + row_block] = running
    target = (x.double() * w[y].double()).sum(dim=1)
    probe_rows, probe_vocab = probe_indices(labels, w.shape[0])
    # d(hidden) of a probed token: (softmax - onehot) @ W over the whole vocabulary.
    position = {t: i for i, t in enumerate(rows_all.tolist())}
    probed = torch.tensor([position[t] for t in probe_rows.tolist()], device=x.device)
    xp, lse_p = x[probed].double(), lse[probed]
    grad_hidden = -w[y[probed]].double()
    for v in range(0, w.shape[0], vocab_block):
        wb = w[v : v + vocab_block].double()
        grad_hidden += torch.exp(xp @ wb.t() - lse_p[:, None]) @ wb
    # d(weight) of a probed vocabulary row v: sum over tokens of (p_tv - [y_t == v]) x_t.
    wv = w[probe_vocab.to(w.device)].double()
    grad_weight = torch.zeros_like(wv)
    for r in range(0, len(rows_all), row_block):
        xs = x[r : r + row_block].double()
        dz = torch.exp(xs @ wv.t() - lse[r : r + row_block, None]) - (y[r : r + row_block, None] == probe_vocab.to(y.device)).double()
        grad_weight += dz.t() @ xs
    return {"loss": float((lse - target).sum()), "grad_hidden": grad_hidden.cpu().tolist(),
            "grad_weight": grad_weight.cpu().tolist()}


def cross_check(result, reference, device):
    """None when the method's probe agrees with the fp64 reference, else what differs."""
    # fp32 on CPU (seen: ~1e-7 relative on the loss, ~1e-5 of the scale on gradients); on GPU
    # the methods return bf16 gradients (step 2^-8) of bf16 inputs.
    rtol = 1e-4 if device == "cpu" else 3e-2
    for key in ("loss", "grad_hidden", "grad_weight"):
        actual, expected = torch.tensor(result["check"][key]), torch.tensor(reference[key])
        scale = expected.abs().max().item()
        if not torch.allclose(actual, expected, rtol=rtol, atol=rtol * scale):
            worst = (actual - expected).abs().max().item()
            return f"{key} differs from the fp64 reference by {worst:.3g} (scale {scale:.3g}, rtol {rtol:g})"
    return None


def run_one(method, hidden_size, vocab_size, tokens, fraction, repeats, device="cpu"):
    inputs = make_inputs(hidden_size, vocab_size, tokens, fraction, device=device)
    hidden, weight = inputs[:2]
    if method == "reference":
        return reference_probe(hidden, weight, inputs[5])
    on_gpu = device != "cpu"
    # GPU work is asynchronous: the clock is read between synchronisations (on CPU: no-op).
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    # The engine's fp32 gradient of the weight: there before the step, zeroed by the engine
    # after each optimizer step (here: before each measured one, outside the clock).
    buffer = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if method == "hpsft_engine" else None

    def step():
        hidden.grad = weight.grad = None
        loss, backend = loss_fn(method, *inputs, weight_grad_buffer=buffer)
        loss.backward()
        return loss.item(), backend

    loss, backend = step()  # warm-up: JIT/lazy init, thread pools, allocator
    hidden.grad = weight.grad = None
    if on_gpu:
        sync()
        torch.cuda.reset_peak_memory_stats()
        before_bytes = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # reset VmHWM to the current RSS
        before = rss_kib("VmRSS")
    wall, cpu = [], []
    for _ in range(repeats):
        if buffer is not None:
            buffer.zero_()
        sync()
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        step()
        sync()
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    if on_gpu:
        peak_extra_mib = (torch.cuda.max_memory_allocated() - before_bytes) / 2**20
    else:
        peak_extra_mib = (rss_kib("VmHWM") - before) / 1024
    return {
        # gradients of the last measured step
        "check": probe(loss, hidden.grad, weight.grad if buffer is None else buffer, inputs[5]),
        "time_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),  # all threads; less sensitive than wall time to other load
        "peak_extra_mib": peak_extra_mib,
        "loss": loss,
        "backend": backend,
        "n_supervised": int((inputs[5] != -100).sum()),  # N in the FLOP count
    }


def run_isolated(method, case, repeats, device="cpu"):
    command = [sys.executable, __file__, "--child", method, *map(str, case), "--repeats", str(repeats), "--device", device]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr else f"exit {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def checked_results(methods, case, repeats, device, missing=None):
    """Each method's result, replaced by an error when it fails the cross-check (or the
    reference cannot be computed): no time is printed for a result that is not checked."""
    reference = run_isolated("reference", case, repeats, device)
    results = {}
    for method in methods:
        if missing and missing.get(method):
            results[method] = {"error": missing[method]}
            continue
        result = run_isolated(method, case, repeats, device)
        if "error" not in result:
            mismatch = reference.get("error") and f"no fp64 reference: {reference['error']}"
            mismatch = mismatch or cross_check(result, reference, device)
            if mismatch:
                result = {"error": f"cross-check failed, not timed: {mismatch}"}
        results[method] = result
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", nargs=4, type=float, action="append", metavar=("H", "V", "TOKENS", "FRACTION"),
                        help="run only this shape (repeatable)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: bf16 inputs, GPU timing and memory, a Liger row, TFLOP/s")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="bf16 dense peak for the %% of peak column (989: H100/H200 SXM)")
    parser.add_argument("--account", action="store_true",
                        help="accounted GPU peak extra memory (bf16) of hpsft and Liger, no timing")
    parser.add_argument("--grid", action="store_true", help="with --account: the N x H x V table of docs/ops.md")
    parser.add_argument("--child", nargs=5, metavar=("METHOD", "H", "V", "TOKENS", "FRACTION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, h, v, tokens, fraction = args.child
        print(json.dumps(run_one(method, int(h), int(v), int(tokens), float(fraction), args.repeats, args.device)))
        return
    if args.account:
        account_main(args)
        return
    if args.device == "cuda":
        gpu_main(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, fwd+bwd, reduction sum; "
          "every row cross-checked against an fp64 reference before it is timed")
    print("F.linear_cross_entropy: " + ("present" if hasattr(F, "linear_cross_entropy") else "absent in this torch"))
    header = (
        "| H | V | tokens | supervised | method | wall s | CPU s | peak extra MiB "
        "| wall / materialised | CPU / materialised | memory / materialised |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    cases = [(int(h), int(v), int(t), f) for h, v, t, f in args.case] if args.case else QUICK_CASES if args.quick else FULL_CASES
    for case in cases:
        results = checked_results(METHODS, case, args.repeats, "cpu")
        base = results["materialised"]
        for method, result in results.items():
            h, v, tokens, fraction = case
            prefix = f"| {h} | {v} | {tokens} | {fraction:.2f} | {METHODS[method]}"
            if "error" in result:
                print(f"{prefix} | failed: {result['error']} | | | | | |")
                continue
            name = f"{prefix} [{result['backend']}]" if method.startswith("hpsft") else prefix
            ratios = " | |"
            if "error" not in base:
                ratios = " | ".join(
                    f"{result[key] / max(base[key], 1e-9):.{digits}f}"
                    for key, digits in (("time_s", 2), ("cpu_s", 2), ("peak_extra_mib", 3))
                )
            print(f"{name} | {result['time_s']:.2f} | {result['cpu_s']:.2f} | {result['peak_extra_mib']:.0f} | {ratios} |", flush=True)
    print(f"load average after the run: {open('/proc/loadavg').read().split()[:3]}")


# The accounted hpsft rows, as the GPU table's: what each method passes.
ACCOUNTED_HPSFT = {"hpsft": {"grad_scale": 1.0}, "hpsft, d(weight) into an fp32 buffer": {"weight_grad_in_engine": True},
                   "hpsft, chunk_rows=4096": {"grad_scale": 1.0, "chunk_rows": 4096}}
ACCOUNT_GRID = [(h, v, tokens, 1.0) for h in (2048, 4096, 8192) for v in (32000, 128256, 256000)
                for tokens in (2048, 8192, 32768, 131072)]


def account_main(args):
    """Accounted peak extra MiB of one bf16 fwd+bwd (reduction sum) on CUDA: hpsft's rows and
    Liger's, per shape, and their ratio; --grid: the N x H x V table of docs/ops.md."""
    from hpsft.ops.byte_accounting import account_hpsft, account_liger
    from hpsft.ops.chunk_rows import cuda_chunk_rows

    print("accounted on CPU (meta tensors, hpsft/ops/byte_accounting.py): peak extra MiB of one bf16 fwd+bwd, "
          "reduction sum, what bench_varlen_ce.py --device cuda measures")
    if args.grid:
        header = ("| H | V | tokens | Liger MiB | hpsft MiB | / Liger | rows | hpsft, d(weight) into the engine's buffer "
                  "MiB | / Liger | rows |")
        print(header)
        print("|---" * (header.count("|") - 1) + "|")
        for h, v, tokens, _ in ACCOUNT_GRID:
            liger = account_liger(tokens, h, v, torch.bfloat16)
            cells = []
            for into_engine in (False, True):
                accounted = account_hpsft(tokens, h, v, torch.bfloat16, weight_grad_in_engine=into_engine)
                rows = cuda_chunk_rows(tokens, tokens - tokens // 512, h, v, 2, into_engine)
                cells.append(f"{accounted.peak_mib:.0f} | {accounted.peak_bytes / liger.peak_bytes:.2f} | {rows}")
            print(f"| {h} | {v} | {tokens} | {liger.peak_mib:.0f} | {' | '.join(cells)} |", flush=True)
        return
    header = "| H | V | tokens | supervised | method | peak extra MiB | memory / Liger | largest buffers at the peak (MiB) |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    cases = [(int(h), int(v), int(t), f) for h, v, t, f in args.case] if args.case else GPU_CASES
    for h, v, tokens, fraction in cases:
        liger = account_liger(tokens, h, v, torch.bfloat16, supervised_fraction=fraction)
        rows = {name: account_hpsft(tokens, h, v, torch.bfloat16, supervised_fraction=fraction, **options)
                for name, options in ACCOUNTED_HPSFT.items()}
        for name, accounted in {**rows, "Liger-Kernel (its algorithm, accounted)": liger}.items():
            print(f"| {h} | {v} | {tokens} | {fraction:.2f} | {name} | {accounted.peak_mib:.0f} "
                  f"| {accounted.peak_bytes / liger.peak_bytes:.2f} | {accounted.describe(4)} |", flush=True)


# The accounting of each GPU row (hpsft/ops/byte_accounting.py), printed beside the measurement.
ACCOUNTED_GPU_METHODS = {"hpsft": {"grad_scale": 1.0}, "hpsft_engine": {"weight_grad_in_engine": True},
                         "hpsft_4096": {"grad_scale": 1.0, "chunk_rows": 4096}}
ACCOUNTING_RTOL = 0.02  # measured vs accounted peak extra memory


def accounted_mib(method, h, v, tokens, fraction):
    from hpsft.ops.byte_accounting import account_hpsft, account_liger

    if method == "liger":
        return account_liger(tokens, h, v, torch.bfloat16, supervised_fraction=fraction).peak_mib
    if method in ACCOUNTED_GPU_METHODS:
        return account_hpsft(tokens, h, v, torch.bfloat16, supervised_fraction=fraction,
                             **ACCOUNTED_GPU_METHODS[method]).peak_mib
    return None


def gpu_main(args):
    """The GPU table: like the CPU one, plus TFLOP/s (6*N*H*V FLOPs, N supervised tokens), time
    and memory against Liger's, and the byte accounting's figure for the same row."""
    if not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")
    has_liger = importlib.util.find_spec("liger_kernel") is not None
    has_torch_linear_ce = hasattr(F, "linear_cross_entropy")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16 inputs, fwd+bwd, reduction sum, "
          f"median of {args.repeats}; peak {args.peak_tflops:g} TFLOP/s (--peak-tflops)")
    print("F.linear_cross_entropy: " + ("present" if has_torch_linear_ce else "absent in this torch"))
    print("Liger-Kernel: " + ("installed" if has_liger else "not installed"))
    header = ("| H | V | tokens | supervised | method | time ms | peak extra MiB | accounted MiB | measured / accounted "
              "| TFLOP/s | of peak | time / materialised | time / Liger | memory / Liger |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    methods = {**METHODS, **GPU_METHODS}
    missing = {"torch_linear_ce": None if has_torch_linear_ce else "absent in this torch",
               "liger": None if has_liger else "not installed (pip install liger-kernel)"}
    cases = [(int(h), int(v), int(t), f) for h, v, t, f in args.case] if args.case else QUICK_CASES if args.quick else GPU_CASES
    verdicts = []
    for case in cases:
        h, v, tokens, fraction = case
        results = checked_results(methods, case, args.repeats, "cuda", missing)
        base, liger = results["materialised"], results["liger"]
        for method, result in results.items():
            prefix = f"| {h} | {v} | {tokens} | {fraction:.2f} | {methods[method]}"
            if "error" in result:
                print(f"{prefix} | {result['error']} |" + " |" * 12)
                continue
            name = f"{prefix} [{result['backend']}]" if method.startswith("hpsft") else prefix
            tflops = 6 * result["n_supervised"] * h * v / result["time_s"] / 1e12  # three GEMMs of 2NHV
            of_peak = tflops / args.peak_tflops
            accounted = accounted_mib(method, h, v, tokens, fraction)
            agreement = "" if accounted is None else f"{result['peak_extra_mib'] / accounted:.3f}"
            if accounted is not None and abs(result["peak_extra_mib"] / accounted - 1) > ACCOUNTING_RTOL:
                verdicts.append(f"accounting NOT confirmed for {method} at N={tokens}: measured "
                                f"{result['peak_extra_mib']:.0f} MiB, accounted {accounted:.0f} (tolerance {ACCOUNTING_RTOL:.0%})")
            time_vs_base = "" if "error" in base else f"{result['time_s'] / base['time_s']:.2f}"
            time_vs_liger = "" if "error" in liger else f"{result['time_s'] / liger['time_s']:.2f}"
            memory_vs_liger = "" if "error" in liger else f"{result['peak_extra_mib'] / max(liger['peak_extra_mib'], 1e-9):.2f}"
            print(f"{name} | {result['time_s'] * 1e3:.1f} | {result['peak_extra_mib']:.0f} | "
                  f"{'' if accounted is None else f'{accounted:.0f}'} | {agreement} | {tflops:.0f} | {of_peak:.0%} | "
                  f"{time_vs_base} | {time_vs_liger} | {memory_vs_liger} |", flush=True)
            if method in ("hpsft", "hpsft_engine") and case in TARGET_CASES:
                verdicts.append(
                    f"target {method} at N={tokens}, H={h}, V={v}: {of_peak:.0%} of peak (>= {TARGET_FRACTION_OF_PEAK:.0%}: "
                    f"{'met' if of_peak >= TARGET_FRACTION_OF_PEAK else 'NOT met'}); time / Liger's {time_vs_liger or '-'} "
                    f"(<= 1); extra memory / Liger's {memory_vs_liger or '-'} (<= 1; d(weight) into the buffer: <= 0.25)")
    for verdict in verdicts:
        print(verdict)
    if any(verdict.startswith("accounting NOT") for verdict in verdicts):
        sys.exit(3)


if __name__ == "__main__":
    main()
