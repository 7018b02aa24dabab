"""torch.compile of the decoder layers on CPU: is a training forward + backward faster, and is
it the same? Eager and compiled copies of one model (layer.compile(dynamic=True): packed rows
change length every step) take turns on the same packed rows of chat conversations; the
first compiled step (the compilation) is timed on its own. Loss and gradients are compared
per step (relative to the eager gradient's largest element).

    python benchmarks/bench_compile_layers.py [--model DIR] [--data FILE] [--batch 8] [--steps 4]
"""

import argparse
import time

import torch

from bench_packing import load_sequences


def forward_backward(model, row) -> tuple[float, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = model(**row)
    (out["loss"] / out["n_tokens"]).backward()
    seconds = time.perf_counter() - start
    return seconds, out["loss"].detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".cache/models/smollm2-135m-4l")
    parser.add_argument("--data", default=".cache/data/chatterbot/train.parquet")
    parser.add_argument("--batch", type=int, default=8, help="conversations per packed row")
    parser.add_argument("--steps", type=int, default=4, help="measured rows (after the compiling one)")
    args = parser.parse_args()

    from hpsft.data.batch import collate_jagged, packed_row
    from hpsft.models import PackedCausalLM, load_causal_lm

    torch.manual_seed(0)
    samples = load_sequences(args.data, args.model, args.batch * (args.steps + 1))
    rows = [packed_row(collate_jagged(samples[i:i + args.batch])) for i in range(0, len(samples), args.batch)]
    eager = PackedCausalLM(load_causal_lm(args.model))
    lm = load_causal_lm(args.model)
    for layer in lm.model.layers:
        layer.compile(dynamic=True)
    compiled = PackedCausalLM(lm)
    compile_seconds = forward_backward(compiled, rows[0])[0]
    forward_backward(eager, rows[0])  # warm-up
    print(f"model={args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"first compiled step (compiling): {compile_seconds:.0f} s")
    print("| tokens | eager s | compiled s | loss diff | max grad diff / max grad |")
    print("|---|---|---|---|---|")
    totals = [0.0, 0.0]
    for row in rows[1:]:
        (te, loss_e, grads_e), (tc, loss_c, grads_c) = forward_backward(eager, row), forward_backward(compiled, row)
        totals[0] += te
        totals[1] += tc
        grad_diff = max(float((grads_e[n] - grads_c[n]).abs().max() / grads_e[n].abs().max().clamp_min(1e-30))
                        for n in grads_e)
        print(f"| {row['input_ids'].numel()} | {te:.3f} | {tc:.3f} | {float((loss_e - loss_c).abs()):.2e} | "
              f"{grad_diff:.1e} |")
    print(f"total: eager {totals[0]:.2f} s, compiled {totals[1]:.2f} s, compiled / eager = {totals[1] / totals[0]:.3f}")


if __name__ == "__main__":
    main()
