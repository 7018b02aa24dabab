"""Load a Hugging Face model folder, failing early with a message that says what to fix."""

import contextlib
import importlib.util
import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

import torch

from hpsft.utils.errors import UserInputError
from hpsft.models.varlen_attention import ATTN_IMPLEMENTATION


# What transformers' from_pretrained loads weights from (a single file or a sharded index).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_model_path(path: str, trust_remote_code: bool) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise UserInputError(
            f"model.path={path}: no Hugging Face model folder there (config.json missing); "
            "run `make model` for the default or point model.path at a folder"
        )
    if not any((p / name).is_file() for name in WEIGHT_FILES):
        raise UserInputError(
            f"model.path={path}: config.json but no weights ({' or '.join(WEIGHT_FILES)}); "
            "copy the model's weight files there, or point model.path at a complete folder"
        )
    if not trust_remote_code:
        check_no_remote_code(p)
    return p


def check_no_remote_code(folder: Path) -> None:
    """Refuse a folder whose model or tokenizer is Python code shipped with it (`auto_map`),
    before transformers gets to ask (it would prompt, or fail with a message about itself)."""
    for name in ("config.json", "tokenizer_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            auto_map = json.loads(file.read_text()).get("auto_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
            raise UserInputError(f"{file} is not a JSON object: {err}") from None
        if auto_map:
            raise UserInputError(
                f"model.path={folder}: {name} asks for code shipped with the model ({sorted(auto_map)}); hpsft "
                "does not run it unless model.trust_remote_code=true, which executes that folder's Python files "
                "with your permissions: set it only for a source you trust"
            )


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(check_model_path(path, trust_remote_code), trust_remote_code=trust_remote_code)


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def resolve_attn_implementation(name: str) -> str:
    if name == "auto":
        return "flash_attention_2" if flash_attn_available() else ATTN_IMPLEMENTATION
    if name == "flash_attention_2" and not flash_attn_available():
        raise UserInputError(
            "model.attn_implementation=flash_attention_2 needs a GPU and the flash-attn package "
            "(pip install flash-attn); use auto or hpsft_varlen otherwise"
        )
    return name


def model_config(folder, trust_remote_code: bool = False):
    """The folder's transformers config (its config.json)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)


def has_vision_tower(config) -> bool:
    """A vision-language model's config (Qwen2-VL, LLaVA...: docs/vision.md): the one test of it."""
    return getattr(config, "vision_config", None) is not None


def is_vision_language_folder(folder, trust_remote_code: bool = False) -> bool:
    """A model folder whose config has a vision tower."""
    return has_vision_tower(model_config(folder, trust_remote_code))


def auto_model_class(folder, trust_remote_code: bool = False):
    """transformers' auto class that builds the folder's model with its LM head: image-text-to-text
    for a vision-language model, causal LM for the rest."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language_folder(folder, trust_remote_code) else AutoModelForCausalLM


def load_image_processor(path: str, trust_remote_code: bool = False):
    """The image processor of a vision-language model's folder (its preprocessor_config.json); for
    LLaVA, LlavaImages: its processor with the config's tower settings that decide the image tokens."""
    from transformers import AutoConfig, AutoImageProcessor

    from hpsft.data.image_rows import LlavaImages

    try:
        processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserInputError(f"model.path={path} is a vision-language model without a usable image processor "
                             f"({str(err).splitlines()[0][:200]}): add its preprocessor_config.json") from None
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if config.model_type != "llava":
        return processor
    # The count of <image> tokens per image assumes CLIP's features: its CLS first, then one per patch.
    if config.vision_config.model_type != "clip_vision_model" or not hasattr(processor, "crop_size"):
        raise UserInputError(f"model.path={path}: hpsft prepares LLaVA's images for a CLIP vision tower and image "
                             f"processor, not {config.vision_config.model_type} with {type(processor).__name__}")
    if config.vision_feature_select_strategy not in ("default", "full"):
        raise UserInputError(f"model.path={path}: vision_feature_select_strategy="
                             f"{config.vision_feature_select_strategy!r} in config.json, LLaVA's are default, full")
    return LlavaImages(processor, config.vision_config.patch_size, config.vision_feature_select_strategy,
                       config.image_token_id)


def load_causal_lm(path: str, attn_implementation: str = "auto", gradient_checkpointing: bool = False,
                   trust_remote_code: bool = False,
                   model_init: Callable[[], AbstractContextManager[bool]] | None = None) -> torch.nn.Module:
    """The model in fp32 (DeepSpeed keeps fp32 masters and casts for bf16 itself), built inside
    `model_init()` (an engine's TrainEngine.model_init; default: built whole). When that context
    partitions the model across the ranks as it is built (ZeRO-3), the weights are loaded after it
    one tensor at a time (see partitioned.py)."""
    attn_implementation = resolve_attn_implementation(attn_implementation)
    folder = check_model_path(path, trust_remote_code)
    model_class = auto_model_class(folder, trust_remote_code)
    with (model_init or (lambda: contextlib.nullcontext(False)))() as partitioned:
        if partitioned:
            from hpsft.models.partitioned import empty_causal_lm

            model = empty_causal_lm(folder, attn_implementation, trust_remote_code, model_class)
        else:
            model = model_class.from_pretrained(
                folder, dtype=torch.float32, attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
            )
    if partitioned:
        from hpsft.models.partitioned import load_weights_partitioned

        load_weights_partitioned(model, folder)
    return prepared_for_training(model, attn_implementation, gradient_checkpointing)


def load_qlora_causal_lm(path: str, lora_config, seed: int, attn_implementation: str = "auto",
                         gradient_checkpointing: bool = False, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model in fp32 with `model.lora`'s adapters (from `seed`) on its quantised base
    (`model.lora.quantize_base`), built without the whole fp32 model (see qlora_build.py)."""
    from hpsft.models.qlora_build import build_qlora_model

    attn_implementation = resolve_attn_implementation(attn_implementation)
    folder = check_model_path(path, trust_remote_code)
    model = build_qlora_model(folder, attn_implementation, trust_remote_code,
                              auto_model_class(folder, trust_remote_code), lora_config, seed)
    return prepared_for_training(model, attn_implementation, gradient_checkpointing)


def prepared_for_training(model: torch.nn.Module, attn_implementation: str, gradient_checkpointing: bool
                          ) -> torch.nn.Module:
    if has_vision_tower(model.config):
        # The tower attends within each image (not causal): its own sdpa, the decoder the varlen kernel.
        model.set_attn_implementation({"text_config": attn_implementation, "vision_config": "sdpa"})
    model.config.use_cache = False  # a KV cache is useless in training and breaks packing (see PackedCausalLM)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
