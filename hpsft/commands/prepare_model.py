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

import sys
from pathlib import Path

from hpsft.commands import command_parser
from hpsft.models.conversion import convert, packaged
from hpsft.utils.errors import UserInputError, exits_2_on_user_error


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = command_parser("hpsft prepare-model", __doc__)
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
