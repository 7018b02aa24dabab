"""Replies of a model folder through its chat template (hpsft generate, hpsft samples)."""

from pathlib import Path

import torch

from hpsft.models.loading import check_model_path, load_tokenizer
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
    """(model in fp32 on the GPU when there is one, its tokenizer) of a model folder."""
    from transformers import AutoModelForCausalLM

    check_model_path(str(folder), trust_remote_code)
    tokenizer = load_tokenizer(str(folder), trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), tokenizer


@torch.no_grad()
def generate_replies(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                     system: str | None = None) -> list[str]:
    """One reply per prompt, each a user turn of its own conversation."""
    if tokenizer.chat_template is None:
        raise UserInputError(f"the tokenizer of {tokenizer.name_or_path} has no chat template")
    replies = []
    for prompt in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"].to(model.device)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
        replies.append(tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True).strip())
    return replies
