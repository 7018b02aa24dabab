"""The vocabulary-parallel fused loss (hpsft/ops/vocab_parallel.py) against the one-rank op.

Default (CPU time): one fwd+bwd of a reduction-sum loss w.r.t. hidden and the weight, fp32, at
TP=1 (one process with 2 threads, and with 1) and at TP=2 (2 gloo processes of 1 thread each,
started together on this machine's cores: on the 2-core development machine, one core each), for
the C++ and the torch shard kernels. Each configuration runs in fresh processes: inputs built
from one seed on every rank, one warm-up step, then --repeats measured steps between barriers.
Wall = the slowest rank's, CPU = the ranks' process CPU seconds summed (median over steps);
"in row work" is the share of the wall time spent between the logit GEMM and the gradient GEMMs
(statistics pass, the two all-reduces, gradient pass), "in all-reduces" the share in the
collectives: the statistics' two per chunk and the caller's d(hidden) sum (sum_grad_over_tp). Every configuration's loss and summed d(hidden) are checked against TP=1's (2
threads, C++) of the same run (rtol 1e-5; d(hidden) 1e-5 of its largest entry).

--account: no timing; the GPU path's peak extra memory per TP rank from the byte accounting
(byte_accounting.py: bf16, H=4096, V=128256 padded to a multiple of 128 x TP, 8k and 32k
tokens, TP=1/2/8, d(weight) returned in bf16 or summed into the engine's fp32 buffer), against
the one-rank figure / TP + the communication buffers (the (T, H) partial d(hidden) and one
chunk's (rows, 1) and (rows, 2) fp32 all-reduce buffers).

    .venv/bin/python benchmarks/bench_vocab_parallel_ce.py             # CPU time, TP=2 vs TP=1
    .venv/bin/python benchmarks/bench_vocab_parallel_ce.py --account   # GPU memory, counted on CPU
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpsft.ops import varlen_linear_cross_entropy, vocab_parallel
from hpsft.utils.distributed import free_port

# (TP, threads per process, backend of the shard kernels)
CONFIGS = [(1, 2, "cpp"), (1, 1, "cpp"), (2, 1, "cpp"), (2, 1, "torch"), (1, 2, "torch")]


def inputs(hidden_size, vocab_size, tokens, seq_len=512):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g)
    weight = torch.randn(vocab_size, hidden_size, generator=g) * hidden_size**-0.5
    labels = torch.randint(0, vocab_size, (tokens,), generator=g)
    labels[seq_len - 1::seq_len] = -100  # a sequence's last row predicts nothing
    offsets = torch.arange(0, tokens + 1, seq_len)
    return hidden, weight, labels, offsets


class Timed:
    """Wall seconds spent inside a function, summed (this benchmark's processes only)."""

    def __init__(self, owner, name):
        self.owner, self.name, self.inner, self.seconds = owner, name, getattr(owner, name), 0.0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def __get__(self, instance, owner=None):  # as a method, when it wraps one
        return self if instance is None else lambda *a, **k: self(instance, *a, **k)


def child(rank, tp, threads, backend, shape, repeats, port, out_dir):
    torch.set_num_threads(threads)
    group = None
    if tp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
        group = dist.group.WORLD
    hidden, weight, labels, offsets = inputs(*shape)
    rows = -(-weight.shape[0] // tp)
    shard = weight[rank * rows:(rank + 1) * rows].clone()
    row_work = Timed(vocab_parallel.VocabParallelRows, "__call__") if tp > 1 else None
    collectives = Timed(vocab_parallel, "_all_reduce") if tp > 1 else None

    def step():
        h, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        out = varlen_linear_cross_entropy(vocab_parallel.sum_grad_over_tp(h, group), w, labels=labels, offsets=offsets,
                                          backend=backend, tp_group=group, vocab_size=weight.shape[0])
        out.loss.backward()
        return out.loss.item(), h.grad

    step()
    walls, cpus, shares = [], [], []
    for _ in range(repeats):
        if group is not None:
            dist.barrier()
            row_work.seconds = collectives.seconds = 0.0
        wall, cpu = time.perf_counter(), time.process_time()
        loss, grad_hidden = step()
        if group is not None:
            dist.barrier()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        if group is not None:
            shares.append((row_work.seconds / walls[-1], collectives.seconds / walls[-1]))
    result = {"walls": walls, "cpus": cpus, "shares": shares, "loss": loss}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        torch.save(grad_hidden, Path(out_dir, "grad_hidden.pt"))
    if group is not None:
        dist.destroy_process_group()


def run_config(tp, threads, backend, shape, repeats):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(child, args=(tp, threads, backend, shape, repeats, free_port(), out_dir), nprocs=tp)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(tp)]
        grad_hidden = torch.load(Path(out_dir, "grad_hidden.pt"))
    walls = [max(r["walls"][i] for r in ranks) for i in range(repeats)]
    cpus = [sum(r["cpus"][i] for r in ranks) for i in range(repeats)]
    shares = ranks[0]["shares"]
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "loss": ranks[0]["loss"],
            "grad_hidden": grad_hidden, "row_share": statistics.median(s[0] for s in shares) if shares else None,
            "collective_share": statistics.median(s[1] for s in shares) if shares else None}


def time_main(args):
    shape = (args.hidden, args.vocab, args.tokens)
    print(f"CPU, fp32, H={args.hidden}, V={args.vocab}, {args.tokens} tokens (all supervised, sequences of 512), "
          f"fwd+bwd, median of {args.repeats}; {os.cpu_count()} cores, load average at start "
          f"{os.getloadavg()[0]:.2f}; torch {torch.__version__}")
    header = ("| TP | processes x threads | shard kernels | wall s | CPU s (all ranks) | wall / TP=1 | CPU / TP=1 "
              "| in row work | in all-reduces (statistics, d(hidden)) | vs TP=1: loss, d(hidden) |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    baseline = None
    for tp, threads, backend in CONFIGS:
        result = run_config(tp, threads, backend, shape, args.repeats)
        baseline = baseline or result
        loss_error = abs(result["loss"] - baseline["loss"]) / abs(baseline["loss"])
        grad_error = ((result["grad_hidden"] - baseline["grad_hidden"]).abs().max()
                      / baseline["grad_hidden"].abs().max()).item()
        checked = "ok" if loss_error <= 1e-5 and grad_error <= 1e-5 else "DIFFERS"
        share = lambda key: f"{result[key]:.0%}" if result[key] is not None else ""
        print(f"| {tp} | {tp} x {threads} | {backend if tp > 1 else backend + ' (one-rank kernel)'} "
              f"| {result['wall']:.2f} | {result['cpu']:.2f} | {result['wall'] / baseline['wall']:.2f} "
              f"| {result['cpu'] / baseline['cpu']:.2f} | {share('row_share')} | {share('collective_share')} "
              f"| {checked} ({loss_error:.1e}, {grad_error:.1e}) |", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


def account_main(args):
    from hpsft.ops.byte_accounting import MiB, account_hpsft, shard_rows
    from hpsft.ops.live_bytes import allocator_bytes

    hidden_size, vocab_size = 4096, 128256
    print(f"accounted on CPU (meta tensors, hpsft/ops/byte_accounting.py): peak extra MiB of one bf16 fwd+bwd on "
          f"TP rank 0, H={hidden_size}, V={vocab_size} padded to a multiple of 128 x TP, every token supervised")
    header = ("| tokens | d(weight) | TP | weight rows per rank | rows per chunk | peak extra MiB | / TP=1 | "
              "bound: TP=1 / TP + buffers | buffers MiB (d(hidden), all-reduce) | largest at the peak (MiB) |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for tokens in (8192, 32768):
        for into_engine, design in ((False, "bf16, returned"), (True, "fp32, into the engine's buffer")):
            one_rank = None
            for tp in (1, 2, 8):
                accounted = account_hpsft(tokens, hidden_size, vocab_size, weight_grad_in_engine=into_engine, tp_size=tp)
                one_rank = one_rank or accounted
                block = next(s for s, dtype, _ in accounted.at_peak if dtype == torch.float32 and len(s) == 2)
                hidden_grad = 2 * tokens * hidden_size
                reduce_buffers = allocator_bytes(4 * block[0]) + allocator_bytes(8 * block[0])
                bound = one_rank.peak_bytes / tp + hidden_grad + reduce_buffers
                rows = vocab_size if tp == 1 else shard_rows(vocab_size, tp)
                print(f"| {tokens} | {design} | {tp} | {rows} | {block[0]} | {accounted.peak_mib:.1f} "
                      f"| {accounted.peak_bytes / one_rank.peak_bytes:.3f} | {bound / MiB:.1f}"
                      f"{'' if accounted.peak_bytes <= bound else ' EXCEEDED'} | {hidden_grad / MiB:.0f} + "
                      f"{reduce_buffers / MiB:.3f} | {accounted.describe(3)} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--account", action="store_true", help="GPU memory per TP rank, by byte accounting")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    account_main(args) if args.account else time_main(args)


if __name__ == "__main__":
    main()
