"""Replies of a model folder through its chat template (hpsft generate, hpsft samples); a
vision-language folder's replies may take images (hpsft generate --image)."""

from pathlib import Path

import torch

from hpsft.data.chat_messages import BadRow
from hpsft.data.image_rows import expanded_messages, image_layout, image_messages, image_token_counts, process_images
from hpsft.models.loading import auto_model_class, check_model_path, load_tokenizer
from hpsft.utils.errors import UserInputError


def model_folder(path: Path) -> Path:
    """A model folder, or a run directory's exported `hf/`."""
    if (path / "hf" / "config.json").is_file():
        return path / "hf"
    if (path / "config.json").is_file():
        return path
    raise UserInputError(f"{path} is neither a model folder (config.json) nor a run directory with an exported hf/ "
                         "(trainer.export_hf=true, or python -m hpsft.export a checkpoint)")


def load_for_generation(folder: Path, trust_remote_code: bool = False):
    """(model in fp32 on the GPU when there is one, its tokenizer) of a model folder; a
    vision-language folder gives its image-text-to-text model."""
    check_model_path(str(folder), trust_remote_code)
    tokenizer = load_tokenizer(str(folder), trust_remote_code)
    model = auto_model_class(folder, trust_remote_code).from_pretrained(folder, dtype=torch.float32,
                                                                         trust_remote_code=trust_remote_code)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), tokenizer


def prompt_inputs(tokenizer, messages: list[dict], images: list[Path] = (), processor=None) -> dict:
    """The model inputs of a conversation ending in a user turn, with the generation prompt. With
    images, the user turn is content parts (the images, then the text) that go the data stage's way
    (hpsft/data/image_rows.py): each image processed by `processor` and its placeholder expanded to
    as many image tokens as its patches give, so the model sees a prompt as it saw training rows."""
    extra = {}
    if images:
        *head, user = messages
        parts = [{"type": "image", "image": str(Path(p).absolute())} for p in images] + \
                [{"type": "text", "text": user["content"]}]
        try:
            messages, paths = image_messages(head + [{**user, "content": parts}], None, Path.cwd() / "prompt")
            pixels, grids = process_images(processor, paths)
        except BadRow as err:
            raise UserInputError(f"--image: {err}") from None
        messages = expanded_messages(messages, image_token_counts(processor, pixels, grids), processor)
        extra = {"pixel_values": torch.from_numpy(pixels)}
        if grids.shape[1]:  # Qwen2-VL's (t, h, w) grids; LLaVA's images have none
            extra["image_grid_thw"] = torch.from_numpy(grids)
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    if "image_grid_thw" in extra:  # which tokens are image tokens: Qwen2-VL's 3-D rotary positions need it
        extra["mm_token_type_ids"] = (input_ids == tokenizer.convert_tokens_to_ids(image_layout(processor).image_token)).int()
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **extra}


@torch.no_grad()
def generate_replies(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                     system: str | None = None, images: list[Path] = (), processor=None) -> list[str]:
    """One reply per prompt, each a user turn of its own conversation; `images` (with the folder's
    image processor) go with the prompt."""
    if tokenizer.chat_template is None:
        raise UserInputError(f"the tokenizer of {tokenizer.name_or_path} has no chat template")
    replies = []
    for prompt in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        tokens = generated_tokens(model, tokenizer, messages, max_new_tokens, temperature, images, processor)
        replies.append(tokenizer.decode(tokens, skip_special_tokens=True).strip())
    return replies


@torch.no_grad()
def generated_tokens(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float = 0.0,
                     images: list[Path] = (), processor=None) -> torch.Tensor:
    """The token ids the model generates after the conversation's generation prompt (greedy at
    temperature 0)."""
    inputs = {k: v.to(model.device) for k, v in prompt_inputs(tokenizer, messages, images, processor).items()}
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    output = model.generate(**inputs, max_new_tokens=max_new_tokens,
                            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
    return output[0, inputs["input_ids"].shape[1]:]
