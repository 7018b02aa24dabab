"""Sample replies from a model, through its chat template, for a quick look.

    hpsft generate runs/default --prompt "What is a pope?"          the run's exported hf/ folder
    hpsft generate .cache/models/smollm2-135m --prompt "Hi" --prompt "Tell me a joke" --max-new-tokens 64

Greedy by default (the same reply every time); --temperature > 0 samples (with --seed).
"""

import argparse
import sys
from pathlib import Path

import torch

from hpsft.utils.errors import UserInputError, exits_2_on_user_error
from hpsft.models.loading import check_model_path, load_tokenizer


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


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hpsft generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a model folder, or a run directory with an exported hf/")
    parser.add_argument("--prompt", action="append", required=True, help="a user message (repeatable)")
    parser.add_argument("--system", default=None, help="a system message before each prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the model folder")
    args = parser.parse_args(argv)
    model, tokenizer = load_for_generation(model_folder(args.model), args.trust_remote_code)
    torch.manual_seed(args.seed)
    for prompt, reply in zip(args.prompt, generate_replies(model, tokenizer, args.prompt, args.max_new_tokens,
                                                           args.temperature, args.system)):
        print(f"### user\n{prompt}\n### assistant\n{reply}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
