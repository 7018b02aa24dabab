"""The blank image's cost (packed_vision_lm.py: a micro-batch without images runs the tower on a
blank image, its features added times 0, so every data-parallel rank reduces the same gradients):
a training step (forward + backward) of an imageless packed row through PackedVisionLM with the
blank-image tower pass and without it (tower_every_row off, what a frozen, unpartitioned tower
does), timed in the same run, on the tests' tiny Qwen2-VL and on Qwen2-VL-2B's vision tower
(its config.json's vision_config, random init) in front of a decoder of Qwen2-VL-2B's width with
--decoder-layers of its 28 layers. fp32 on CPU, bf16 on CUDA by default (--dtype), the
model's parameters trained (gradients kept between steps, as DeepSpeed's buffers are).

    python benchmarks/bench_blank_image.py [--tokens N] [--decoder-layers L] [--steps S] [--device cuda]
"""

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from hpsft.models.packed_vision_lm import PackedVisionLM

VOCAB = 49152  # SmolLM2's (the tests' tokenizer), not Qwen2-VL's 151936: the head is not what is measured
SPECIAL = {"image_token_id": VOCAB - 1, "video_token_id": VOCAB - 2, "vision_start_token_id": VOCAB - 3,
           "vision_end_token_id": VOCAB - 4}
ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
SHAPES = {  # name -> (text_config, vision_config), decoder layers filled in by main
    "tiny (tests' Qwen2-VL)": (
        {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rope_parameters": {**ROPE, "mrope_section": [2, 3, 3]}},
        {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, "hidden_size": 64}),
    "Qwen2-VL-2B tower": (
        {"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
         "rope_parameters": {**ROPE, "mrope_section": [16, 24, 24]}},
        {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "hidden_size": 1536}),
}


def build(text: dict, vision: dict, layers: int, device: str, dtype: torch.dtype) -> PackedVisionLM:
    config = AutoConfig.for_model(
        "qwen2_vl", text_config={**text, "vocab_size": VOCAB, "num_hidden_layers": layers, "bos_token_id": None,
                                 "eos_token_id": None},
        vision_config={**vision, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}, **SPECIAL)
    torch.manual_seed(0)
    lm = AutoModelForImageTextToText.from_config(config).to(device, dtype)
    lm.set_attn_implementation({"text_config": "hpsft_varlen", "vision_config": "sdpa"})
    return PackedVisionLM(lm)


def imageless_row(tokens: int, device: str) -> dict:
    """Two text-only sequences of tokens / 2, each supervised on its second half, on `device`."""
    half = tokens // 2
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.tensor(([False] * (half - half // 2) + [True] * (half // 2)) * 2)
    return {"input_ids": torch.randint(0, VOCAB - 4, (1, 2 * half), generator=g).to(device),
            "position_ids": torch.arange(half).repeat(2)[None].to(device),
            "offsets": torch.tensor([0, half, 2 * half]).to(device), "max_length": half,
            "loss_mask": loss_mask.to(device)}


def step_seconds(model: PackedVisionLM, row: dict, blank: bool, steps: int) -> float:
    """The median forward + backward of `steps` (after one warm-up step)."""
    model.tower_every_row = blank
    times = []
    cuda = row["input_ids"].is_cuda
    for _ in range(steps + 1):
        start = time.perf_counter()
        out = model(**row)
        (out["loss"] / out["n_tokens"]).backward()
        if cuda:  # the kernels are asynchronous: time their end, not their launch
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[steps // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--decoder-layers", type=int, default=4, help="of the 2B shape's decoder (the tiny's: 2)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="default: fp32 on cpu, bf16 on cuda")
    args = parser.parse_args()
    dtype = torch.bfloat16 if (args.dtype or ("bf16" if args.device == "cuda" else "fp32")) == "bf16" else torch.float32
    row = imageless_row(args.tokens, args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"torch {torch.__version__}, {where}, {dtype}, one imageless packed row of "
          f"{args.tokens} tokens (2 sequences), median of {args.steps} steps\n")
    print("| shape | tower params | decoder params | step without blank image (s) | with (s) | blank pass (s) "
          "| ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, (text, vision) in SHAPES.items():
        model = build(text, vision, 2 if name.startswith("tiny") else args.decoder_layers, args.device, dtype)
        tower = sum(p.numel() for p in model.lm.model.visual.parameters())
        decoder = sum(p.numel() for p in model.parameters()) - tower
        # Alternate the two, so that a load change on the shared machine hits both.
        without, with_blank = [], []
        for _ in range(2):
            without.append(step_seconds(model, row, False, args.steps))
            with_blank.append(step_seconds(model, row, True, args.steps))
        plain, blank = min(without), min(with_blank)
        print(f"| {name} | {tower / 1e6:.1f}M | {decoder / 1e6:.1f}M | {plain:.4f} | {blank:.4f} | "
              f"{blank - plain:.4f} | {blank / plain:.2f}x |", flush=True)
        del model


if __name__ == "__main__":
    main()
