"""Sample replies from a model, through its chat template, for a quick look.

    hpsft generate runs/default --prompt "What is a pope?"          the run's exported hf/ folder
    hpsft generate .cache/models/smollm2-135m --prompt "Hi" --prompt "Tell me a joke" --max-new-tokens 64
    hpsft generate runs/vl --image cat.jpg --image dog.png --prompt "Which is bigger?"   a vision-language model

Greedy by default (the same reply every time); --temperature > 0 samples (with --seed).
"""

import sys
from pathlib import Path

import torch

from hpsft.commands import command_parser
from hpsft.models.generation import generate_replies, load_for_generation, model_folder
from hpsft.models.loading import is_vision_language_folder, load_image_processor
from hpsft.utils.errors import UserInputError, exits_2_on_user_error


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = command_parser("hpsft generate", __doc__)
    parser.add_argument("model", type=Path, help="a model folder, or a run directory with an exported hf/")
    parser.add_argument("--prompt", action="append", required=True, help="a user message (repeatable)")
    parser.add_argument("--image", action="append", type=Path, default=[],
                        help="an image of the prompt, before its text (repeatable; a vision-language model, "
                        "one --prompt)")
    parser.add_argument("--system", default=None, help="a system message before each prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the model folder")
    args = parser.parse_args(argv)
    folder = model_folder(args.model)
    processor = None
    if args.image:  # refused before the model is loaded
        if len(args.prompt) != 1:
            raise UserInputError(f"--image goes with one --prompt, got {len(args.prompt)} prompts: run one "
                                 "hpsft generate per prompt that has images")
        if not is_vision_language_folder(folder, args.trust_remote_code):
            raise UserInputError(f"--image: {folder} is a text model (its config.json has no vision_config); give "
                                 "a vision-language model folder (Qwen2-VL, ...: docs/vision.md) or drop --image")
        processor = load_image_processor(str(folder), args.trust_remote_code)
    model, tokenizer = load_for_generation(folder, args.trust_remote_code)
    torch.manual_seed(args.seed)
    replies = generate_replies(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.system,
                               args.image, processor)
    for prompt, reply in zip(args.prompt, replies):
        images = "".join(f"[image {path}]\n" for path in args.image)
        print(f"### user\n{images}{prompt}\n### assistant\n{reply}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
