"""Train a LoRA run with the real trainer (any launcher, any ZeRO stage), then check the trained
engine against the model folder and the end-of-run exports; rank 0 writes
<output_dir>/lora_check.json.

    torchrun --nproc_per_node 2 tests/dist_scripts/train_lora_and_check.py model.lora.rank=4 key=value ...

What it records: the names of the parameters that require gradients and of the adapters; the
base weights that differ (bit for bit) from the model folder's; the adapters left equal to
their initial values (A from the seed, B = 0, rebuilt here on a fresh model); and the largest
relative logit differences between the engine, the merged hf/ folder, and the base model with
hf/adapter loaded by PEFT. A QLoRA run (model.lora.quantize_base nf4 or int8) is compared with
the base it computes with: the model folder's decoder linear weights through torchao's round trip
(tests/nf4_reference.py).
"""

import json
import sys
from pathlib import Path

import torch

from hpsft.config import load_config
from hpsft.trainer import SFTTrainer


def initial_adapters(config) -> dict:
    """The adapters as the run created them: the same injection, seed and model, untrained."""
    from transformers import AutoModelForCausalLM

    from hpsft.models.lora import add_lora, adapter_names

    lm = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    add_lora(lm, config.model.lora, config.trainer.seed)
    params = dict(lm.named_parameters())
    return {name: params[name].detach().clone() for name in adapter_names(lm)}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    config = load_config(None, args)
    trainer = SFTTrainer(config)
    trainer.fit()

    engine = trainer.worker.engine
    module = engine.module
    trainable = sorted(name for name, p in module.named_parameters() if p.requires_grad)
    names = [name for name, _ in module.named_parameters()]
    lora = config.model.lora
    qlora = lora.quantize_base != "none"
    if qlora:  # the quantised base weights are buffers
        names += [name for name, _ in module.named_buffers() if name.endswith(".base_layer.weight")]
    # QLoRA's quantised weights as this rank holds them (whole under ZeRO-3 too): shape, dtype and bytes
    # (buffers, an NF4Tensor's inner tensors); and which parameters ZeRO-3 partitioned.
    from hpsft.models.qlora import stored_bytes

    quantized = {f"{prefix}.weight": {"class": type(layer).__name__, "dtype": str(layer.weight.dtype),
                                      "shape": list(layer.weight.shape), "bytes": stored_bytes(layer)}
                 for prefix, layer in module.named_modules() if hasattr(layer, "dequantized")}
    nf4_buffers = {name: list(b.shape) for name, b in module.named_buffers() if type(b).__name__ == "NF4Tensor"}
    dense = {f"{prefix}.weight": layer.dequantized().clone() for prefix, layer in module.named_modules()
             if hasattr(layer, "dequantized")}  # the weights the quantised layers compute with
    partitioned = sorted(name for name, p in module.named_parameters() if hasattr(p, "ds_id"))
    # Of those, the ones each rank holds a shard of (DeepSpeed keeps those under its persistence threshold whole).
    sharded = sorted(name for name, p in module.named_parameters() if hasattr(p, "ds_id") and not p.ds_persist)
    current = dict(engine.gathered_tensors(names))  # every rank takes part (ZeRO-3 gathers)
    sample = trainer.val_dataset[0]["input_ids"][None]
    positions = torch.arange(sample.shape[1])[None]
    module.eval()
    with torch.no_grad():
        engine_logits = module.logits(sample, positions, torch.tensor([0, sample.shape[1]]))
    if trainer.rank != 0:
        return

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hpsft.models.lora import base_name

    folder = load_file(Path(config.model.path) / "model.safetensors")
    if qlora:  # the base as QLoRA computes with it, against torchao's own round trip of the folder's weights
        from tests.nf4_reference import round_trip

        current = {name: dense.get(name, tensor) for name, tensor in current.items()}
        folder = {name: round_trip(tensor, lora.quantize_base, lora.double_quant)
                  if name in {base_name(n) for n in current if ".base_layer." in n} else tensor
                  for name, tensor in folder.items()}
    initial = initial_adapters(config)
    base_changed = [name for name, tensor in current.items()
                    if name not in initial and base_name(name) in folder and not torch.equal(tensor, folder[base_name(name)])]
    base_compared = [name for name in current if name not in initial and base_name(name) in folder]
    adapters_unchanged = [name for name, tensor in initial.items() if torch.equal(current[name], tensor)]

    hf_dir = Path(config.trainer.output_dir) / "hf"
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        merged_logits = merged(input_ids=sample, position_ids=positions, use_cache=False).logits[0]
        base = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
        if qlora:  # PEFT's adapter on the same dequantised base
            from tests.nf4_reference import dequantized_decoder

            dequantized_decoder(base, lora.quantize_base, lora.double_quant)
        base_logits = base(input_ids=sample, position_ids=positions, use_cache=False).logits[0]
        adapted = PeftModel.from_pretrained(base, hf_dir / "adapter").eval()
        adapter_logits = adapted(input_ids=sample, position_ids=positions, use_cache=False).logits[0]

    def rel(a, b) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    (Path(config.trainer.output_dir) / "lora_check.json").write_text(json.dumps({
        "trainable": trainable,
        "adapters": sorted(initial),
        "base_compared": len(base_compared),
        "base_changed": base_changed,
        "adapters_unchanged": adapters_unchanged,
        "merged_vs_adapter": rel(merged_logits, adapter_logits),
        "engine_vs_adapter": rel(engine_logits, adapter_logits),
        "base_vs_adapter": rel(base_logits, adapter_logits),
        "nf4_buffers": nf4_buffers,
        "quantized": quantized,
        "partitioned": partitioned,
        "sharded": sharded,
    }))


if __name__ == "__main__":
    main()
