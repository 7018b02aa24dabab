"""A model -> a Hugging Face folder hpsft trains from (config, safetensors weights, tokenizer
and chat template), loaded back and checked before it is put in place.

    hpsft prepare-model --out .cache/models/smollm2-135m                   the packaged SmolLM2 GGUF (make model)
    hpsft prepare-model --out .cache/models/smollm2-135m-4l --num-layers 4  its first 4 layers
    hpsft prepare-model SmolLM2-360M-Instruct.Q8_0.gguf --out models/smollm2-360m
    hpsft prepare-model ~/models/Qwen2.5-0.5B-Instruct --out models/qwen2.5-0.5b-4l --num-layers 4

A GGUF file is read by transformers' GGUF loader (needs the gguf package; 60-90 s for
SmolLM2-135M, mostly metadata parsing), its weights dequantised to fp32. transformers refuses
to save a GGUF-loaded model, so a plain model is built from its config and given the weights.
A Hugging Face folder is checked (config.json, weights, a tokenizer; a warning when the
tokenizer has no chat template) and written again as safetensors in its stored dtype; a
folder whose model is code shipped with it (auto_map) is refused. --num-layers K keeps the
first K decoder layers: a weakened but real model, for fast tests and demos. The written
folder is loaded back and must give the source model's logits on a probe text (the dtype's
default torch.testing tolerances); it is written to a temporary sibling and renamed, so an
interrupted run never leaves a folder that looks complete. Without a source, the packaged
model is converted once and cached: a complete --out folder is kept as it is.
"""

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hpsft.utils.errors import UserInputError, exits_2_on_user_error

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Fine-tuning checks: 1, 2, 3."


def load_gguf(path: Path):
    """(plain fp32 model, tokenizer) of a GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise UserInputError(f"{path}: reading a GGUF file needs the gguf package (pip install 'hpsft[assets]')")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch converting {path}: missing={missing} unexpected={unexpected}")
    return model, tokenizer


def load_folder(path: Path):
    """(model in its stored dtype, tokenizer) of a Hugging Face folder, checked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpsft.models.loading import check_model_path

    check_model_path(str(path), trust_remote_code=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise UserInputError(f"{path}: no tokenizer loads from it ({err}); copy the model's tokenizer files "
                             "(tokenizer.json, tokenizer_config.json, ...) there") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    except (OSError, ValueError) as err:
        raise UserInputError(f"{path}: transformers cannot load it as a causal LM ({err})") from None
    return model, tokenizer


def keep_layers(model, num_layers: int) -> None:
    """Keep only the first `num_layers` decoder layers (Llama-style `model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UserInputError(f"--num-layers: {type(model).__name__} keeps its decoder layers elsewhere than "
                             "model.layers; cut it by hand or drop --num-layers")
    if not 1 <= num_layers <= len(layers):
        raise UserInputError(f"--num-layers must be in [1, {len(layers)}], got {num_layers}")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]


def probe_logits(model, tokenizer):
    import torch

    ids = tokenizer(PROBE_TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return ids, model(input_ids=ids, use_cache=False).logits


def check_reloads(folder: Path, ids, logits) -> None:
    """The saved folder loads, tokenizes the probe as the source did and gives its logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    reloaded_ids, reloaded = probe_logits(model, tokenizer)
    if not torch.equal(reloaded_ids, ids):
        raise RuntimeError(f"{folder}: the saved tokenizer splits the probe text differently from the source's")
    torch.testing.assert_close(reloaded, logits, msg=lambda m: f"{folder}: saved model's logits differ: {m}")


def replace_dir(tmp: Path, out_dir: Path) -> None:
    """Put `tmp` at `out_dir`, moving a previous folder aside first (rename cannot replace a
    non-empty directory)."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=out_dir.name + ".old.", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old)


def convert(source: Path, out_dir: Path, num_layers: int | None = None, overwrite: bool = False) -> Path:
    """Write `source` (a .gguf file or a Hugging Face folder) to `out_dir`, checked."""
    from hpsft.utils.files import umask_mode  # imports torch: not at module level, so --help stays quick

    source, out_dir = Path(source), Path(out_dir)
    if not source.exists():
        raise UserInputError(f"{source} does not exist: give a .gguf file or a Hugging Face model folder")
    if source.resolve() == out_dir.resolve():
        raise UserInputError(f"--out {out_dir} is the source itself: write to another folder")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserInputError(f"--out {out_dir} exists and is not empty: choose another folder, or --overwrite")
    if source.is_dir():
        model, tokenizer = load_folder(source)
    elif source.suffix.lower() == ".gguf":
        model, tokenizer = load_gguf(source)
    else:
        raise UserInputError(f"{source} is neither a .gguf file nor a Hugging Face model folder")
    if tokenizer.chat_template is None:
        print(f"hpsft prepare-model: warning: the tokenizer of {source} has no chat template; training on chat "
              "data will need data.chat_template=<Jinja text or .jinja file>", file=sys.stderr)
    if num_layers is not None:
        keep_layers(model, num_layers)
    ids, logits = probe_logits(model, tokenizer)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source_record = {"source": str(source), "num_layers": model.config.num_hidden_layers}
        (tmp / "hpsft_source.json").write_text(json.dumps(source_record) + "\n")
        del model  # the reloaded copy takes its place in memory
        check_reloads(tmp, ids, logits)
        tmp.chmod(umask_mode(0o777))  # mkdtemp's 0700 would ignore the user's umask
        replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def packaged(out_dir: Path, num_layers: int | None = None, full_dir: Path | None = None) -> Path:
    """The packaged SmolLM2-135M-Instruct as a folder, converted once (a complete folder is
    kept); with num_layers, cut from the full conversion cached in `full_dir`."""
    from hpsft.assets.smollm2 import find_gguf

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    if num_layers is None:
        return convert(find_gguf(), out_dir, overwrite=True)
    full = packaged(full_dir or out_dir.parent / "smollm2-135m")
    return convert(full, out_dir, num_layers, overwrite=True)


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hpsft prepare-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", type=Path, default=None,
                        help="a .gguf file or a Hugging Face model folder (none: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--out", required=True, type=Path, help="output Hugging Face folder")
    parser.add_argument("--num-layers", type=int, default=None, help="keep only the first K decoder layers")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    parser.add_argument("--full", type=Path, default=None,
                        help="packaged model with --num-layers: where its full conversion is cached "
                        "(default: <out parent>/smollm2-135m)")
    args = parser.parse_args(argv)
    if args.source is None:
        out = packaged(args.out, args.num_layers, args.full)
    elif args.full is not None:
        raise UserInputError("--full names where the packaged model's full conversion is cached: it goes "
                             "without a source")
    else:
        out = convert(args.source, args.out, args.num_layers, args.overwrite)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
