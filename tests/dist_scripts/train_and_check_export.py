"""Train with the real trainer (any launcher), then compare the trained engine's logits
with those of the exported Hugging Face folder; rank 0 writes <output_dir>/export_check.json.

    torchrun --nproc_per_node 2 tests/dist_scripts/train_and_check_export.py key=value ...
"""

import json
import sys
from pathlib import Path

import torch

from hpsft.config import load_config
from hpsft.trainer import SFTTrainer


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    config = load_config(None, args)
    trainer = SFTTrainer(config)
    trainer.fit()

    sample = trainer.val_dataset[0]["input_ids"][None]
    positions = torch.arange(sample.shape[1])[None]
    module = trainer.worker.engine.module
    module.eval()
    with torch.no_grad():
        engine_logits = module.logits(sample, positions, torch.tensor([0, sample.shape[1]]))  # every rank: ZeRO-3 gathers collectively
    if trainer.rank != 0:
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = Path(config.trainer.output_dir) / "hf"
    exported = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    with torch.no_grad():
        hf_logits = exported(input_ids=sample, position_ids=positions, use_cache=False).logits[0]
    rel = ((hf_logits - engine_logits).abs().max() / engine_logits.abs().max()).item()
    (Path(config.trainer.output_dir) / "export_check.json").write_text(json.dumps({
        "max_rel_logit_diff": rel,
        "chat_template": tokenizer.chat_template,
        "vocab": len(tokenizer),
    }))


if __name__ == "__main__":
    main()
