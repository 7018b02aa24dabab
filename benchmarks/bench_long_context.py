"""The longest single sequence that trains within a per-rank memory budget, at SP=1 and SP=2,
with and without tiled MLPs, all with activation checkpointing (docs/sequence_parallel.md).

One measurement = one optimizer step (fp32, CPU, gloo, hpsft's DeepSpeedEngine, ZeRO stage
`--zero-stage`, default 0: every rank then holds the same weights, gradients and AdamW
moments, so per-rank memory differs between SP sizes by the sequence split only) on one
row holding one sequence of L random tokens, every token supervised, in fresh processes
(torchrun, SP ranks), after a warm-up step on 128 tokens (which creates AdamW's moments
and the communicators' buffers, whatever L is). Each rank reports its resident memory just
before the measured step (framework, weights, AdamW moments: the same at every L) and the
step's peak (VmHWM, reset just before the step), and the step's wall time. "The step's
memory" is peak minus before: what the step itself holds at its peak (gradients, the
fused loss's fixed-size logit block, and the activations, which grow with L).
`--budget-of step` (default) puts the budget `--budget-gib` on that, per rank; `--budget-of
peak` on the step's peak RSS. A watchdog thread ends a rank as soon as its resident memory
passes the budget, so lengths far over it cost little.

The search per layout: L = --start, doubled while it fits, then bisection between the last
fitting and the first failing length down to --precision (relative), lengths multiples of
--multiple. The bisection assumes peak memory grows with L; peak RSS does not always (it
holds what the C allocator kept: measured 1.89 GiB at 8192 tokens, 1.87 at 16384, see
docs/sequence_parallel.md). So the ranks run with a fixed glibc mmap threshold
(--mmap-threshold, 64 KiB): every block from that size up is mmapped and returned to the
system when freed, and resident memory then follows the live tensors.

The model: SmolLM2-135M's config (hidden 576, intermediate 1536, vocab 49152, tied
embeddings) cut to --layers decoder layers, with --heads query heads and --kv-heads
key/value heads of head_dim 576 / heads: SmolLM2-135M's 9 heads admit SP in {1, 3, 9} only,
so SP=2 needs 8 heads (head_dim 72; 2 key/value heads). Random weights (seeded): memory and
throughput do not depend on the values.

    python benchmarks/bench_long_context.py [--budget-gib 1.0] [--budget-of step|peak] [--layers 4] [--heads 8]
        [--kv-heads 2]
        [--layouts sp1-ckpt,sp1-ckpt-tiled,sp2-ckpt,sp2-ckpt-tiled] [--tile-tokens 1024]
        [--start 2048] [--precision 0.05] [--mmap-threshold 65536] [--quick]

`--quick`: a smoke test: a 1-layer model, 0.3 GiB of step memory, layouts sp1-ckpt and
sp2-ckpt, lengths from 1024, one bisection step (5.5 min on the shared 2-core machine at
load ~7: longest 3072 and 6144 tokens).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / ".cache" / "models" / "smollm2-135m-4l" / "config.json"  # SmolLM2-135M's, 4 layers
GIB = 2 ** 30


def layout_of(name: str) -> dict:
    """'sp2-ckpt-tiled' -> {"sp": 2, "checkpointing": True, "tiled": True}."""
    parts = name.split("-")
    if not parts[0].startswith("sp") or not parts[0][2:].isdigit() or not set(parts[1:]) <= {"ckpt", "tiled"}:
        raise SystemExit(f"bench_long_context: error: layout {name!r}: expected spN[-ckpt][-tiled], "
                         "e.g. sp2-ckpt-tiled")
    return {"name": name, "sp": int(parts[0][2:]), "checkpointing": "ckpt" in parts, "tiled": "tiled" in parts}


def build_model(folder: Path, layers: int, heads: int, kv_heads: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    values = json.loads(CONFIG.read_text())
    values.update(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=values["hidden_size"] // heads, max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**values)).save_pretrained(folder)


# ---------------------------------------------------------------- one measurement (a rank)

def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM (the peak resident memory) again from the current resident memory."""
    Path("/proc/self/clear_refs").write_text("5")


def watch_budget(limit: int, marker: Path) -> None:
    """End this rank as soon as it holds more than `limit` bytes, leaving `marker` (the
    launcher then ends the others): the length does not fit, no need to finish its step."""
    def watch():
        while True:
            if status_bytes("VmRSS") > limit:
                marker.touch()
                os._exit(1)
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()


def over_budget_marker(out) -> Path:
    return Path(f"{out}.over-budget")


WARMUP_TOKENS = 128


def measure(args) -> None:
    """A warm-up step on WARMUP_TOKENS tokens, then the measured optimizer step on one
    L-token sequence; rank 0 writes every rank's figures to --out."""
    import torch
    import torch.distributed as dist

    from hpsft.utils import distributed
    from hpsft.config import load_config
    from hpsft.data.batch import collate_jagged, loss_token_count, packed_row
    from hpsft.data.sequence_split import split_row
    from hpsft.engine.deepspeed import DeepSpeedEngine
    from hpsft.models import PackedCausalLM, load_causal_lm
    from hpsft.models.tiled_mlp import tile_mlps
    from hpsft.workers.training_worker import token_mean_loss

    layout = layout_of(args.layout)
    sp = layout["sp"]
    distributed.init_distributed("gloo")
    config = load_config(None, [f"model.path={args.model}", f"engine.zero_stage={args.zero_stage}",
                                f"model.gradient_checkpointing={str(layout['checkpointing']).lower()}",
                                "optim.warmup_ratio=0", "optim.lr_scheduler=constant"])
    place = distributed.Mesh.of_world(distributed.world_size(), distributed.rank(), sp_size=sp)
    engine = DeepSpeedEngine(config.engine, config.optim, total_steps=2, mesh=place)
    model = PackedCausalLM(load_causal_lm(config.model.path, gradient_checkpointing=layout["checkpointing"]))
    engine.initialize(model)
    if layout["tiled"]:
        tile_mlps(model.lm, args.tile_tokens)
    sp_rank = place.sp_rank
    if sp > 1:
        model.enable_sequence_parallel(distributed.sequence_parallel_group(place), sp, sp_rank)

    def step(length: int) -> None:
        generator = torch.Generator().manual_seed(length)
        sample = {"input_ids": torch.randint(0, model.lm.config.vocab_size, (length,), generator=generator),
                  "loss_mask": torch.ones(length, dtype=torch.bool), "index": 0}
        batch = collate_jagged([sample])
        row = packed_row(batch)
        row = split_row(row, sp_rank, sp) if sp > 1 else row
        engine.train_batch([row], lambda out: token_mean_loss(out, loss_token_count(batch)))

    # The warm-up creates what the first step creates whatever L is (AdamW's moments, the
    # communicators' buffers): the measured step then adds what it needs itself.
    step(WARMUP_TOKENS)
    dist.barrier()
    before = status_bytes("VmRSS")
    reset_peak()
    watch_budget(int(args.budget_gib * GIB) + (before if args.budget_of == "step" else 0),
                 over_budget_marker(args.out))
    start = time.perf_counter()
    step(args.length)
    seconds = time.perf_counter() - start
    figures = {"peak": status_bytes("VmHWM"), "before": before, "seconds": seconds}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))


# ---------------------------------------------------------------- the search (the driver)

def run_measurement(args, layout: dict, length: int, model: Path, scratch: Path) -> dict:
    """{"fits", "peak", "before", "step" (bytes, each the max over ranks), "seconds",
    "tokens_per_s"} of one step at `length`; a run the watchdog ended has fits False and no
    figures."""
    out = scratch / f"{layout['name']}-{length}.json"
    worker = [str(Path(__file__).resolve()), "--measure", "--layout", layout["name"], "--length", str(length),
              "--model", str(model), "--out", str(out), "--zero-stage", str(args.zero_stage),
              "--tile-tokens", str(args.tile_tokens), "--budget-gib", str(args.budget_gib),
              "--budget-of", args.budget_of]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={layout['sp']}",
               *worker]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // layout["sp"]))}
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if not out.exists():
        if over_budget_marker(out).exists():
            return {"fits": False}
        raise SystemExit(f"bench_long_context: error: {layout['name']} at {length} tokens failed "
                         f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    ranks = json.loads(out.read_text())
    figures = {name: max(r[name] for r in ranks) for name in ("peak", "before", "seconds")}
    figures["step"] = max(r["peak"] - r["before"] for r in ranks)
    return {"fits": figures[args.budget_of] <= args.budget_gib * GIB, **figures,
            "tokens_per_s": length / figures["seconds"]}


def round_to(length: int, multiple: int) -> int:
    return max(multiple, length // multiple * multiple)


def longest(args, layout: dict, model: Path, scratch: Path, measured: dict) -> int:
    """The longest length that fits (0 if even --start does not); every run lands in measured."""
    def fits(length: int) -> bool:
        if length not in measured:
            measured[length] = run_measurement(args, layout, length, model, scratch)
            m = measured[length]
            figures = (f"step {m['step'] / GIB:.3f} GiB/rank (peak RSS {m['peak'] / GIB:.3f}, before "
                       f"{m['before'] / GIB:.3f}), {m['tokens_per_s']:.0f} tok/s" if "peak" in m
                       else "over budget (stopped)")
            print(f"  {layout['name']:>16} L={length:>6}: {figures}", flush=True)
        return measured[length]["fits"]

    good, bad = 0, args.start
    while fits(bad):
        good, bad = bad, bad * 2
    while good and bad - good > max(args.multiple, args.precision * good):
        middle = round_to((good + bad) // 2, args.multiple)
        if middle in (good, bad):
            break
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def cell(m: dict | None) -> str:
    if m is None:
        return "-"
    if "peak" not in m:
        return "> budget"
    return f"{m['step'] / GIB:.3f} / {m['peak'] / GIB:.3f}"


def report(args, layouts: list[dict], results: dict) -> None:
    heads = f"{args.heads} heads ({args.kv_heads} KV, head_dim {576 // args.heads})"
    measure = {"step": "the step's peak RSS minus the RSS before it", "peak": "the step's peak RSS"}[args.budget_of]
    print(f"\nSmolLM2-135M config cut to {args.layers} layers, {heads}, random weights; fp32, CPU, gloo, "
          f"ZeRO-{args.zero_stage}; one optimizer step on one sequence after a {WARMUP_TOKENS}-token warm-up step; "
          f"budget {args.budget_gib} GiB per rank of {measure}; tiles of {args.tile_tokens} tokens; "
          f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'glibc default'}.")
    print("\nthe step's memory / its peak RSS, per rank (GiB, max over ranks), at the doubling lengths of the search:\n")
    print("| length | " + " | ".join(layout["name"] for layout in layouts) + " |")
    print("|---:|" + "---:|" * len(layouts))
    doubled = {args.start * 2 ** k for k in range(32)}
    lengths = sorted({length for r in results.values() for length in r["measured"] if length in doubled})
    for length in lengths:
        print(f"| {length} | " + " | ".join(cell(results[layout["name"]]["measured"].get(length))
                                           for layout in layouts) + " |")
    print("\nlongest sequence within the budget:\n")
    print("| layout | longest L | the step's memory/rank (GiB) | peak RSS/rank (GiB) | RSS before the step (GiB) "
          "| tokens/s | L / L(sp1, same tiling) | L / L(sp1-ckpt) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for layout in layouts:
        r = results[layout["name"]]
        m = r["measured"].get(r["longest"], {})
        ratios = []
        for reference in ("-".join(["sp1", *layout["name"].split("-")[1:]]), "sp1-ckpt"):
            found = results.get(reference)
            ratios.append(f"{r['longest'] / found['longest']:.2f}" if found and found["longest"] else "-")
        if "peak" in m:
            print(f"| {layout['name']} | {r['longest']} | {m['step'] / GIB:.3f} | {m['peak'] / GIB:.3f} | "
                  f"{m['before'] / GIB:.3f} | {m['tokens_per_s']:.0f} | {ratios[0]} | {ratios[1]} |")
        else:
            print(f"| {layout['name']} | none from {args.start} | - | - | - | - | - | - |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gib", type=float, default=1.0, help="per rank, of what --budget-of says")
    parser.add_argument("--budget-of", choices=("step", "peak"), default="step",
                        help="step: the measured step's peak RSS minus the RSS before it; peak: the step's peak RSS")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layouts", default="sp1-ckpt,sp1-ckpt-tiled,sp2-ckpt,sp2-ckpt-tiled")
    parser.add_argument("--tile-tokens", type=int, default=1024, help="model.tiled_mlp_tokens of the -tiled layouts")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--mmap-threshold", type=int, default=65536,
                        help="glibc MALLOC_MMAP_THRESHOLD_ of the ranks (0: glibc's moving default)")
    parser.add_argument("--start", type=int, default=2048, help="the first length tried, then doubled")
    parser.add_argument("--precision", type=float, default=0.05, help="bisection stops at this relative gap")
    parser.add_argument("--multiple", type=int, default=64, help="lengths tried are multiples of this")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1 layer, 0.3 GiB of step memory, two layouts, coarse search")
    # one measurement, run by the driver under torchrun
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args)
        return
    if args.quick:
        args.layers, args.budget_gib, args.budget_of, args.start, args.precision, args.tile_tokens = (
            1, 0.3, "step", 1024, 0.5, 256)
        args.layouts = "sp1-ckpt,sp2-ckpt"
    layouts = [layout_of(name) for name in args.layouts.split(",")]
    for layout in layouts:
        if args.heads % layout["sp"]:
            raise SystemExit(f"bench_long_context: error: --heads {args.heads} is not divisible by SP={layout['sp']} "
                             f"of layout {layout['name']}")
    with tempfile.TemporaryDirectory(prefix="bench_long_context-") as tmp:
        scratch = Path(tmp)
        model = scratch / "model"
        build_model(model, args.layers, args.heads, args.kv_heads)
        results = {}
        for layout in layouts:
            measured: dict = {}
            results[layout["name"]] = {"longest": longest(args, layout, model, scratch, measured),
                                       "measured": measured}
        report(args, layouts, results)


if __name__ == "__main__":
    main()
