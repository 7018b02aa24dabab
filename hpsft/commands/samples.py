"""What training changed, in words: replies of the model before and after a run, on held-out prompts.

    hpsft samples runs/demo                         -> runs/demo/samples.md and samples.jsonl
    hpsft samples runs/demo --prompts data/val.parquet --n 8 --max-new-tokens 64

The model before is the run's `model.path` (from its config.yaml), the model after is the
run's exported `hf/` folder. The prompts are the first user turns of the first --n
conversations of --prompts (default: the run's first validation file), shown with the
reply the data holds. Greedy decoding: the same files every time.
"""

import json
import sys
from pathlib import Path

from hpsft.commands import command_parser
from hpsft.config import load_config
from hpsft.data.layouts import row_messages
from hpsft.data.rows import TokenizeOptions
from hpsft.data.shards import read_rows
from hpsft.models.generation import generate_replies, load_for_generation, model_folder
from hpsft.utils.errors import UserInputError, exits_2_on_user_error


def held_out_prompts(path: Path, n: int, opts: TokenizeOptions) -> list[tuple[str, str]]:
    """(first user message, the assistant reply after it) of the first n conversations that have both."""
    pairs = []
    for row in read_rows(path):
        messages, _ = row_messages(row, opts)
        for i, message in enumerate(messages[:-1]):
            if message["role"] == "user" and messages[i + 1]["role"] == "assistant" and "content" in messages[i + 1]:
                pairs.append((message["content"], messages[i + 1]["content"]))
                break
        if len(pairs) == n:
            break
    if not pairs:
        raise UserInputError(f"{path} has no conversation with a user turn followed by an assistant turn")
    return pairs


def replies_of(folder: Path, prompts: list[str], max_new_tokens: int, trust_remote_code: bool) -> list[str]:
    model, tokenizer = load_for_generation(folder, trust_remote_code)
    return generate_replies(model, tokenizer, prompts, max_new_tokens)


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = command_parser("hpsft samples", __doc__)
    parser.add_argument("run_dir", type=Path, help="a run directory with config.yaml and an exported hf/")
    parser.add_argument("--prompts", type=Path, default=None, help="a chat data file (default: the run's val file)")
    parser.add_argument("--n", type=int, default=4, help="prompts (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    if not (args.run_dir / "config.yaml").is_file():
        raise UserInputError(f"{args.run_dir} has no config.yaml: give a run directory (trainer.output_dir)")
    config = load_config(str(args.run_dir / "config.yaml"))
    prompts_file = args.prompts or (Path(config.data.val_sources()[0].path) if config.data.val_files else None)
    if prompts_file is None:
        raise UserInputError("the run has no validation file: name a file of held-out chats with --prompts")
    pairs = held_out_prompts(prompts_file, args.n, TokenizeOptions.from_data_config(config.data))
    prompts = [prompt for prompt, _ in pairs]
    trust = config.model.trust_remote_code
    before = replies_of(Path(config.model.path), prompts, args.max_new_tokens, trust)
    after = replies_of(model_folder(args.run_dir), prompts, args.max_new_tokens, trust)
    records = [{"prompt": p, "reference": r, "before": b, "after": a}
               for (p, r), b, a in zip(pairs, before, after)]
    with open(args.run_dir / "samples.jsonl", "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    lines = ["# Replies before and after training", "",
             f"Before: `{config.model.path}`; after: `{args.run_dir / 'hf'}`. Greedy, at most "
             f"{args.max_new_tokens} new tokens. Prompts: the first user turns of `{prompts_file}`.", ""]
    for i, record in enumerate(records, 1):
        lines += [f"## {i}. {record['prompt']}", "", f"- data: {record['reference']}",
                  f"- before: {record['before']}", f"- after: {record['after']}", ""]
    (args.run_dir / "samples.md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
