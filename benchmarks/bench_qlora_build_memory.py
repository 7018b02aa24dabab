"""Peak host memory of building a QLoRA model: the dense build (the fp32 model loaded whole,
adapters injected, the adapted layers quantised: what every rank did, ZeRO-3 included, before
hpsft.models.qlora_build) against the streamed build (load_qlora_causal_lm: the parameters never
allocated, each adapted weight quantised as it is read from the folder).

A Llama of about 400M parameters (20 layers, hidden 1024, MLP 4096, a 32000-token vocabulary,
untied head) is built once with random weights and saved to a temp folder, in bf16 (as models
are published; 0.8 GB) or fp32 (--dtype float32, 1.6 GB). Each variant then runs in a fresh
process, which samples its own /proc/self/status every millisecond on a thread and reports the
peaks above its figures after the imports: RssAnon (anonymous memory) and RssAnon + RssFile
(resident, the mapped safetensors pages included: from_pretrained keeps an fp32 folder's tensors
mapped when no cast is needed, file pages the kernel may drop, not anonymous memory). The
expected bytes are counted by tensor: the dense build holds the fp32 model whole; the streamed
one the unquantised fp32 tensors (embedding, head, norms), the quantised buffers and the
largest adapted weight in fp32 while it is quantised.

    PYTHONPATH=. python benchmarks/bench_qlora_build_memory.py [--dtype bfloat16] [--settings nf4 int8]
        [--layers 20] [--keep DIR]
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

import torch

SETTINGS = {"nf4": ("nf4", True), "nf4, double_quant=false": ("nf4", False), "int8": ("int8", True)}
RANK = 16


def resident() -> tuple[int, int]:
    """This process's (RssAnon, RssAnon + RssFile) in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    anon, file = (int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssFile"))
    return anon, anon + file


def write_model(folder: Path, layers: int, dtype: torch.dtype) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                                 num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                                 tie_word_embeddings=False)).to(dtype).save_pretrained(folder)


def build(folder: str, way: str, quantize_base: str, double_quant: bool) -> dict:
    """In this (fresh) process: the QLoRA model built `way`; the peaks above the start's."""
    from hpsft.config.schema import LoraConfig
    from hpsft.models.loading import load_causal_lm, load_qlora_causal_lm
    from hpsft.models.lora import add_lora
    from hpsft.models.qlora import stored_bytes
    from tests.test_lora import quantize_base_layers  # the dense build's quantisation (tests' reference)

    config = LoraConfig(rank=RANK, alpha=2 * RANK, quantize_base=quantize_base, double_quant=double_quant)
    start = peak = resident()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = tuple(map(max, peak, resident()))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    began = time.perf_counter()
    if way == "dense":
        lm = add_lora(load_causal_lm(folder), config, seed=0)
        quantize_base_layers(lm, config)
    else:
        lm = load_qlora_causal_lm(folder, config, seed=0)
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    quantized = [m for m in lm.modules() if hasattr(m, "frozen_buffers")]
    quantized_ids = {id(b) for m in quantized for b in m.buffers(recurse=False)}
    end = resident()
    peak = tuple(map(max, peak, end))
    return {"peak_anon": peak[0] - start[0], "peak_rss": peak[1] - start[1], "end_anon": end[0] - start[0],
            "seconds": seconds,
            "quantized": sum(stored_bytes(m) for m in quantized),
            "unquantized": sum(p.numel() * p.element_size() for p in lm.parameters())
            + sum(b.numel() * b.element_size() for b in lm.buffers() if id(b) not in quantized_ids),
            "largest_adapted": max(m.in_features * m.out_features * 4 for m in quantized)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the folder's")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--keep", type=Path, help="build the model folder here (reused if there) and keep it")
    parser.add_argument("--child", nargs=4, metavar=("FOLDER", "WAY", "QUANTIZE_BASE", "DOUBLE_QUANT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, way, quantize_base, double_quant = args.child
        print(json.dumps(build(folder, way, quantize_base, double_quant == "true")))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp) / "llama"
        if not (folder / "config.json").is_file():
            write_model(folder, args.layers, getattr(torch, args.dtype))
        stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        fp32 = stored * (2 if args.dtype == "bfloat16" else 1)  # the model in fp32, as both builds hold it
        print(f"model folder: {stored / 2**30:.3f} GiB of {args.dtype} safetensors, {args.layers} layers; LoRA "
              f"r={RANK} all-linear; peaks above the process's after its imports; load {os.getloadavg()[0]:.1f}")
        print(f"{'':26} {'build':>8} {'peak RssAnon GiB':>17} {'peak RSS GiB':>13} {'end RssAnon GiB':>16} "
              f"{'expected GiB':>13} {'seconds':>8}")
        for name in args.settings:
            quantize_base, double_quant = SETTINGS[name]
            for way in ("dense", "streamed"):
                child = subprocess.run([sys.executable, __file__, "--child", str(folder), way, quantize_base,
                                        str(double_quant).lower()], capture_output=True, text=True, timeout=1800)
                if child.returncode:
                    raise RuntimeError(child.stderr[-3000:])
                row = json.loads(child.stdout.strip().splitlines()[-1])
                # dense: the fp32 model whole (the first layer's quantisation frees as much as it adds);
                # streamed: what the model holds at the end plus the one adapted weight read in fp32
                expected = fp32 if way == "dense" else row["unquantized"] + row["quantized"] + row["largest_adapted"]
                print(f"{name:26} {way:>8} {row['peak_anon'] / 2**30:17.3f} {row['peak_rss'] / 2**30:13.3f} "
                      f"{row['end_anon'] / 2**30:16.3f} {expected / 2**30:13.3f} {row['seconds']:8.1f}")


if __name__ == "__main__":
    main()
