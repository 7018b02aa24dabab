"""Per-rank training-state bytes of full fine-tuning, LoRA and QLoRA (nf4, nf4 without double
quantisation, int8) on a Llama-3.2-1B-shaped
model (its widths: 16 layers, hidden 2048, MLP 8192, 32 heads, 8 key/value heads, a tied
128256-token vocabulary), counted tensor by tensor, nothing of 1B size allocated: the model is
built on the meta device (names, shapes), the adapters injected there as hpsft's add_lora
does, and each distinct adapted-layer shape is quantised once for real (bf16, hpsft's
qlora.quantized_linear) to count its buffers (an NF4Tensor's inner tensors: qlora.stored_bytes).

The state one rank holds at DP=1 without ZeRO, bf16 mixed precision (DeepSpeed's): every
weight in bf16 (QLoRA: the adapted layers' quantised), and per trainable value a bf16 gradient,
an fp32 master copy and Adam's two fp32 moments. Activations are not counted.

    python benchmarks/bench_qlora_memory.py [--rank 16]
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpsft.config.schema import LoraConfig
from hpsft.models.lora import add_lora, lora_layers
from hpsft.models.qlora import quantized_linear, stored_bytes

LLAMA_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
BF16, TRAINED = 2, 2 + 4 + 4 + 4  # bytes per weight; per trained value: grad bf16, master, Adam m and v fp32


QUANTIZED = {"nf4": LoraConfig(rank=1, quantize_base="nf4"),
             "nf4, double_quant=false": LoraConfig(rank=1, quantize_base="nf4", double_quant=False),
             "int8": LoraConfig(rank=1, quantize_base="int8")}


def quantized_bytes(shape: tuple[int, int], lora_config) -> int:
    """Bytes of one base layer of `shape` quantised from bf16 as `lora_config` says."""
    linear = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16)
    return stored_bytes(quantized_linear("bench", linear, lora_config))


def state_bytes(rank: int) -> dict[str, dict[str, int]]:
    with torch.device("meta"):
        full = LlamaForCausalLM(LLAMA_1B)
        lora = add_lora(LlamaForCausalLM(LLAMA_1B), LoraConfig(rank=rank, alpha=2 * rank), seed=0)
    full_weights = sum(p.numel() for p in full.parameters())
    rows = {"full fine-tuning": {"weights": full_weights * BF16, "trained state": full_weights * TRAINED}}
    frozen = sum(p.numel() for p in lora.parameters() if not p.requires_grad)
    trained = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    rows[f"LoRA r={rank}"] = {"weights": frozen * BF16 + trained * BF16, "trained state": trained * TRAINED}
    shapes = [tuple(layer.base_layer.weight.shape) for layer in lora_layers(lora).values()]
    adapted = sum(rows * cols for rows, cols in shapes)
    for name, lora_config in QUANTIZED.items():
        per_shape = {shape: quantized_bytes(shape, lora_config) for shape in set(shapes)}
        rows[f"QLoRA r={rank} ({name})"] = {"weights": (frozen - adapted) * BF16 + sum(per_shape[s] for s in shapes)
                                            + trained * BF16, "trained state": trained * TRAINED}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    print(f"{'':36} {'weights GiB':>12} {'trained state GiB':>18} {'total GiB':>10}")
    for name, row in state_bytes(args.rank).items():
        total = row["weights"] + row["trained state"]
        print(f"{name:36} {row['weights'] / 2**30:12.3f} {row['trained state'] / 2**30:18.3f} {total / 2**30:10.3f}")


if __name__ == "__main__":
    main()
