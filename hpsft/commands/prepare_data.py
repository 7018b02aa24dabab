"""Chat data -> the parquet hpsft trains on, with a report of what was kept and why not.

    hpsft prepare-data --out .cache/data/chatterbot          the packaged corpora (what `make data` builds)
    hpsft prepare-data --out .cache/data/sharegpt --sharegpt 100000 --sharegpt-only
                                                             the packaged ShareGPT alone (`make data-sharegpt`)
    hpsft prepare-data chats.jsonl more.parquet --out data/mine --val-fraction 0.05
    hpsft prepare-data sharegpt.json --dedupe --out data/sg         ShareGPT, Alpaca, ...: found from the rows
    hpsft prepare-data alpaca.json --out data/alpaca
    hpsft prepare-data qa.jsonl --prompt-key question --response-key answer --out data/qa
    hpsft prepare-data my_hf_dataset/ --split train --out data/hf \
        --tokenizer .cache/models/smollm2-135m --max-length 512
    hpsft prepare-data sharegpt.json --out data/sg --tokenizer .cache/models/smollm2-135m \
        --max-length 2048 --truncation split

Inputs: .jsonl, .json (one array of rows, or one row a line), .parquet, or a folder written
by Hugging Face `datasets` (`Dataset.save_to_disk` / `DatasetDict.save_to_disk`; needs the
datasets package). A row's layout is found from its keys (or --layout): OpenAI `messages`,
ShareGPT `conversations` of `{"from", "value"}` (LLaMA-Factory's roles), Alpaca
`instruction`/`input`/`output` (+ `system`, `history`), `prompt`/`response`,
`prompt`/`completion`; --*-key name other columns (docs/data.md, "Row layouts").
Written to --out: train.parquet (and val.parquet with --val-fraction), one `messages`
column (plus `tools` when rows have them) that data.train_files reads with the default
keys, and report.json: rows read, kept, dropped by reason (malformed, empty, duplicate,
over_max_length), token-length percentiles with --tokenizer. A row over --max-length is cut
to its leading whole turns (--truncation turns, the default), written as several rows cut at
turn boundaries, their history turns marked as context (weight 0) (--truncation split), or
dropped (--truncation drop); the report says how many rows each took and the supervised
tokens lost: docs/data.md, "Long conversations".
"""

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

from hpsft.assets import chat_corpora
from hpsft.commands import command_parser
from hpsft.data.layouts import COLUMN_KEYS, FLAGS, LAYOUT_NAMES
from hpsft.data.preparation import default_num_proc
from hpsft.data.prepare_files import kept_rows, report_text, split_rows, write, write_store
from hpsft.data.rows import TokenizeOptions, chat_template_text
from hpsft.utils.errors import UserInputError, exits_2_on_user_error

# The column keys' flags (data.<key> in a config): help, default (None: the layout's own column).
COLUMN_HELP = {
    "messages_key": ("column of the chat turns (default: messages, or conversations for ShareGPT)", None),
    "role_key": ("a turn's speaker key (default: role, or from for ShareGPT turns)", None),
    "content_key": ("a turn's text key (default: content, or value for ShareGPT turns)", None),
    "prompt_key": ("single-turn rows: the prompt column (default: prompt, or instruction for Alpaca)", None),
    "query_key": ("single-turn rows: a column appended to the prompt (default: Alpaca's input)", None),
    "response_key": ("single-turn rows: the reply column (default: response, completion, or Alpaca's output)",
                     None),
    "system_key": ("a system prompt column (default: system, for ShareGPT and Alpaca rows)", None),
    "history_key": ("single-turn rows: earlier [prompt, response] pairs (default: Alpaca's history)", None),
    "tools_key": ("column of per-row tool schemas (default tools)", "tools"),
}


def prepare_files(args) -> dict:
    if args.max_length is not None and args.tokenizer is None:
        raise UserInputError("--max-length needs --tokenizer (a model folder) to count tokens")
    if args.max_length is not None and args.max_length < 1:
        raise UserInputError(f"--max-length must be positive, got {args.max_length}")
    if args.store and args.tokenizer is None:
        raise UserInputError("--store tokenizes the written rows: give --tokenizer (the model folder the store is "
                             "for)")
    if args.truncation is not None and args.max_length is None:
        raise UserInputError(f"--truncation {args.truncation} fits rows to --max-length: give --max-length "
                             "(and --tokenizer)")
    if args.sharegpt or args.sharegpt_only:
        raise UserInputError("--sharegpt and --sharegpt-only take packaged ShareGPT conversations: they go without "
                             "input files")
    val_fraction = args.val_fraction or 0.0
    truncation = args.truncation or "turns"
    if not 0 <= val_fraction < 1:
        raise UserInputError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    opts = TokenizeOptions(layout=args.layout, **{key: getattr(args, key) for key in COLUMN_KEYS},
                           chat_template=chat_template_text(args.chat_template),
                           max_length=args.max_length or sys.maxsize,
                           # drop: kept_rows() drops an over-long row itself, the sequences are never cut.
                           truncation={"drop": "error"}.get(truncation, truncation), bad_rows="skip")
    tokenizer = None
    if args.tokenizer is not None:
        from hpsft.models.loading import load_tokenizer

        tokenizer = load_tokenizer(str(args.tokenizer))
        if opts.chat_template is None and tokenizer.chat_template is None:
            raise UserInputError(f"the tokenizer of {args.tokenizer} has no chat template: give one with "
                                 "--chat-template <Jinja text or .jinja file>")
    num_proc = args.num_proc or default_num_proc()
    kept, report = kept_rows(args.inputs, opts, tokenizer, args.split, args.dedupe, progress=sys.stderr.isatty(),
                           num_proc=num_proc)
    if not kept:
        raise UserInputError(f"no row of {[str(p) for p in args.inputs]} was kept: {report['dropped']}, e.g. "
                             f"{next(iter(report['dropped_examples'].values()), [''])[0]}")
    # A row's records go to the same file: a split row's history must not be another split's target.
    val_idx = split_rows(len(kept), val_fraction, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    train_path, val_path = args.out / "train.parquet", args.out / "val.parquet"
    train = [record for i, records in enumerate(kept) if i not in val_idx for record in records]
    write(train, train_path)
    report["written"] = {str(train_path): len(train)}
    if val_idx:
        val = [record for i, records in enumerate(kept) if i in val_idx for record in records]
        write(val, val_path)
        report["written"][str(val_path)] = len(val)
    else:
        val_path.unlink(missing_ok=True)  # a previous run's split would no longer match train.parquet
    report.update(val_fraction=val_fraction, seed=args.seed)
    if args.store:
        report["stores"] = {str(path.with_suffix(".store")): write_store(path, tokenizer, opts, num_proc, args.shard_mb)
                            for path in map(Path, report["written"])}
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = command_parser("hpsft prepare-data", __doc__)
    parser.add_argument("inputs", nargs="*", type=Path,
                        help="data files or datasets folders (none: the packaged corpora)")
    parser.add_argument("--out", required=True, type=Path, help="output folder (train.parquet, val.parquet, "
                        "report.json)")
    parser.add_argument("--layout", choices=LAYOUT_NAMES, default="auto",
                        help="the rows' layout (default auto: found from each row's keys)")
    for key, (help_text, default) in COLUMN_HELP.items():
        parser.add_argument(FLAGS[key], default=default, help=help_text)
    parser.add_argument("--split", default=None, help="the split of a DatasetDict folder (default: train, or "
                        "its only split)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a model folder: count tokens through its chat template (and --max-length)")
    parser.add_argument("--max-length", type=int, default=None, help="fit rows to this many tokens (--truncation)")
    parser.add_argument("--truncation", choices=("drop", "turns", "split"), default=None,
                        help="a row over --max-length: keep its leading whole turns (turns, the default), split it "
                             "into rows at turn boundaries (history as context), or drop it")
    parser.add_argument("--chat-template", default=None, help="Jinja text or file replacing the tokenizer's")
    parser.add_argument("--dedupe", action="store_true", help="drop rows repeating an earlier row")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="rows held out to val.parquet (default: 0 for input files, 0.05 packaged)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument("--store", action="store_true",
                        help="also tokenize the written files into token stores beside them (train.store/, "
                             "val.store/) that data.train_files / data.val_files name: needs --tokenizer")
    parser.add_argument("--num-proc", type=int, default=None,
                        help="worker processes tokenizing (default: the cores this process may use)")
    parser.add_argument("--shard-mb", type=float, default=None, help="input per store shard (default 16)")
    parser.add_argument("--sharegpt", type=int, default=0,
                        help="packaged corpora only: also take the first N packaged ShareGPT conversations")
    parser.add_argument("--sharegpt-only", action="store_true",
                        help="packaged corpora only: the --sharegpt conversations without the chatterbot ones")
    args = parser.parse_args(argv)
    if not args.inputs:
        given = [f"--{name.replace('_', '-')}" for name in ("tokenizer", "max_length", "chat_template", "split",
                                                             "dedupe", "store", "num_proc", "shard_mb")
                 if getattr(args, name)]
        given += ["--truncation"] if args.truncation is not None else []
        if given:
            raise UserInputError(f"{', '.join(given)} go with input files; the packaged corpora take --out, "
                                 "--val-fraction, --seed and --sharegpt")
        if args.sharegpt_only and not args.sharegpt:
            raise UserInputError("--sharegpt-only keeps the packaged ShareGPT conversations alone: give --sharegpt N")
        val_fraction = 0.05 if args.val_fraction is None else args.val_fraction
        for path in chat_corpora.build(args.out, val_fraction, args.sharegpt, args.seed, not args.sharegpt_only):
            print(f"{path} ({pq.read_metadata(path).num_rows} rows)")
        return 0
    print(report_text(prepare_files(args)))
    print(args.out / "report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
