"""Per-rank training state of the Megatron engine (engine.name: megatron, docs/megatron.md) at
TP=1 (one process), TP=2 (2 ranks) and PP=2 (2 ranks), DP=1, with a tied and an untied
embedding: parameter + gradient + optimizer bytes counted by tensor, each storage once, as the
second step's optimizer step starts (every gradient reduced, Adam's moments of the first step
alive), and each layout's ratio to TP=1's in the same run (the same embedding).

The model: SmolLM2-135M's widths with 8 query / 4 key-value heads of 72 (bench_tensor_parallel's
SHAPE, which TP=2 divides) cut to --layers decoder layers, random init; each step trains one packed
row of --tokens random tokens (bench_gpu_step.packed_micro_batch). Counted on each rank:

  - param: the GPTModel's parameters (views of Megatron DDP's parameter buffer: the buffer once);
  - grad: their main_grad (DDP's gradient buffer, fp32) and any .grad left on them;
  - optim: the distributed optimizer's fp32 master shards (under bf16; in fp32 they are views of
    the parameters, counted there), their .grad, and Adam's moments (exp_avg, exp_avg_sq).

Not counted: the Hugging Face model the engine is built from and keeps (engine.py: a second
copy of the weights in host memory, not yet released), activations, communication buffers.

    .venv/bin/python benchmarks/bench_megatron_memory.py [--layers 4] [--tokens 256] [--dtype float32]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench_gpu_step import packed_micro_batch
from bench_tensor_parallel import SHAPE, tensors_in

MIB = 2**20
# name: (ranks, engine overrides)
LAYOUTS = {"TP=1": (1, []), "TP=2": (2, ["engine.tensor_parallel_size=2"]),
           "PP=2": (2, ["engine.pipeline_parallel_size=2"])}


def training_state_bytes(engine) -> dict:
    """This rank's parameter, gradient and optimizer bytes of the Megatron engine, by tensor, each
    storage once (the parameters first: the optimizer's fp32 shards in fp32 are their views)."""
    seen, totals = set(), {"param": 0, "grad": 0, "optim": 0}

    def count(tensor: torch.Tensor, kind: str) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            totals[kind] += storage.nbytes()

    for p in engine.module.parameters():
        count(p, "param")
    for p in engine.module.parameters():
        for grad in (getattr(p, "main_grad", None), p.grad):
            if grad is not None:
                count(grad, "grad")
    for chained in engine.optimizer.chained_optimizers:
        for groups in (chained.shard_fp32_groups, chained.shard_fp32_from_float16_groups):
            for master in tensors_in(groups):
                count(master, "optim")
                if master.grad is not None:
                    count(master.grad, "optim")
        for state in chained.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    count(value, "optim")
    return totals


def worker(args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpsft.config import load_config
    from hpsft.data.batch import target_mask
    from hpsft.engine.megatron.engine import MegatronEngine
    from hpsft.models import PackedCausalLM
    from hpsft.utils import distributed
    from hpsft.workers.training_worker import token_mean_loss

    distributed.init_distributed("gloo")
    config = load_config(None, ["engine.name=megatron", f"engine.dtype={args.dtype}", *args.overrides])
    lm_config = LlamaConfig(**{**SHAPE, "tie_word_embeddings": args.tied}, num_hidden_layers=args.layers,
                            use_cache=False)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(lm_config)
    engine = MegatronEngine(config.engine, config.optim, total_steps=10, mesh=distributed.mesh(config.engine))
    engine.initialize(PackedCausalLM(lm))
    counted = {}
    optimizer_step = engine.optimizer_step

    def counting_step():
        if engine.taken == 1:  # the second step: Adam's moments exist
            counted.update(training_state_bytes(engine))
        return optimizer_step()

    engine.optimizer_step = counting_step
    generator = torch.Generator().manual_seed(1000)
    for _ in range(2):
        row = packed_micro_batch(args.tokens, lm_config.vocab_size, generator)[0]
        total = int(target_mask(row["loss_mask"], row["offsets"]).sum())
        engine.train_batch([row], lambda out: token_mean_loss(out, total))
    Path(args.out, f"rank{distributed.rank()}.json").write_text(json.dumps(
        {"bytes": counted, "parameters": sum(p.numel() for p in lm.parameters())}))


def launch(args, ranks: int, overrides: list[str], tied: bool, folder: Path) -> list[dict]:
    folder.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)), CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__,
               "--worker", "--out", str(folder), "--layers", str(args.layers), "--tokens", str(args.tokens),
               "--dtype", args.dtype, *(["--tied"] if tied else []), "--", *overrides]
    subprocess.run(command, env=env, check=True)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the packed row each step trains")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tied", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    print(f"{args.layers}-layer SmolLM2-135M-shaped Llama (hidden 576, MLP 1536, vocabulary 49152, 8 heads / 4 KV "
          f"heads of 72, random init), engine.name=megatron, {args.dtype}, DP=1; torch {torch.__version__}")
    print("| embedding | layout | ranks | parameters (HF) | param+grad+optim MiB, largest rank (param / grad / optim) "
          "| each rank's MiB | ratio to TP=1 |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for tied in (True, False):
            base = None
            for name, (ranks, overrides) in LAYOUTS.items():
                runs = launch(args, ranks, overrides, tied, Path(scratch, f"{name}-{tied}".replace("=", "")))
                states = [sum(r["bytes"].values()) for r in runs]
                largest = runs[states.index(max(states))]["bytes"]
                base = base or max(states)
                parts = " / ".join(f"{largest[k] / MIB:.1f}" for k in ("param", "grad", "optim"))
                print(f"| {'tied' if tied else 'untied'} | {name} | {ranks} | {runs[0]['parameters'] / 1e6:.1f}M | "
                      f"{max(states) / MIB:.1f} ({parts}) | {', '.join(f'{s / MIB:.1f}' for s in states)} | "
                      f"{max(states) / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
