"""Chat data -> the parquet hpsft trains on, with a report of what was kept and why not.

    hpsft prepare-data --out .cache/data/chatterbot          the packaged corpora (what `make data` builds)
    hpsft prepare-data --out .cache/data/sharegpt --sharegpt 100000 --sharegpt-only
                                                             the packaged ShareGPT alone (`make data-sharegpt`)
    hpsft prepare-data chats.jsonl more.parquet --out data/mine --val-fraction 0.05
    hpsft prepare-data sharegpt.json --messages-key conversations --dedupe --out data/sg
    hpsft prepare-data alpaca.json --prompt-key instruction --response-key output --out data/alpaca
    hpsft prepare-data my_hf_dataset/ --split train --out data/hf \\
        --tokenizer .cache/models/smollm2-135m --max-length 512
    hpsft prepare-data sharegpt.json --out data/sg --tokenizer .cache/models/smollm2-135m \\
        --max-length 2048 --truncation split

Inputs: .jsonl, .json (one array of rows, or one row a line), .parquet, or a folder written
by Hugging Face `datasets` (`Dataset.save_to_disk` / `DatasetDict.save_to_disk`; needs the
datasets package). A row holds `messages` (OpenAI roles; ShareGPT turns `{"from": "human" |
"gpt" | "system" | ..., "value"}` are converted) or a prompt and a response; --*-key name
the columns. Written to --out: train.parquet (and val.parquet with --val-fraction), one
`messages` column (plus `tools` when rows have them) that data.train_files reads with the
default keys, and report.json: rows read, kept, dropped by reason (malformed, empty,
duplicate, over_max_length), token-length percentiles with --tokenizer. A row over
--max-length is dropped, or (--truncation turns) cut to its leading whole turns, or
(--truncation split) written as several rows cut at turn boundaries, their history turns
marked as context (weight 0): docs/data.md, "Long conversations".
"""

import argparse
import dataclasses
import json
import multiprocessing
import random
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hpsft.assets import chat_corpora
from hpsft.data.chat_messages import BadRow, normalize_messages, normalize_tools
from hpsft.data.preparation import default_num_proc
from hpsft.data.row_sequences import row_conversations
from hpsft.data.rows import TokenizeOptions, UnreadableRow, chat_template_text, drop_nulls, read_rows, \
    row_to_messages
from hpsft.data.sharegpt import is_sharegpt, sharegpt_messages
from hpsft.utils.errors import UserInputError, exits_2_on_user_error

DROP_REASONS = ("malformed", "empty", "duplicate", "over_max_length")
EXAMPLES_PER_REASON = 5  # where and why, for the first few dropped rows of each reason


class Dropped(Exception):
    def __init__(self, reason: str, detail: str, counts: Counter | None = None):
        super().__init__(detail)
        self.reason = reason
        self.counts = counts or Counter()  # the data stage's counts of a row dropped for its length


def is_dataset_folder(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (a DatasetDict, or one Dataset)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def load_dataset_folder(path: Path, split: str | None):
    try:
        import datasets
    except ImportError:
        raise UserInputError(f"{path} is a Hugging Face datasets folder: reading it needs the datasets package "
                             "(pip install 'hpsft[data]')") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        name = split or ("train" if "train" in loaded else names[0] if len(names) == 1 else None)
        if name not in loaded:
            raise UserInputError(f"{path} holds the splits {names}: choose one with --split")
        return loaded[name]
    if split is not None:
        raise UserInputError(f"--split {split}: {path} holds one Dataset, not a DatasetDict of splits; drop --split")
    return loaded


def input_rows(path: Path, split: str | None):
    """(row count or None when unknown before reading, iterator of (where, row))."""
    if path.is_dir():
        if not is_dataset_folder(path):
            raise UserInputError(f"{path} is a folder but not one written by datasets' save_to_disk (no "
                                 "dataset_dict.json or state.json in it): give data files or such a folder")
        dataset = load_dataset_folder(path, split)

        def rows():
            # Arrow batches: a struct column gives every row every key seen in it (as None), like parquet.
            for i, row in enumerate(r for batch in dataset.with_format("arrow").iter(1000) for r in batch.to_pylist()):
                yield f"{path} row {i}", drop_nulls(row)
        return len(dataset), rows()
    if not path.exists():
        raise UserInputError(f"{path} does not exist")
    count = None
    if path.suffix.lower() == ".parquet":
        try:
            count = pq.read_metadata(path).num_rows
        except (pa.ArrowException, OSError):
            pass  # read_rows says what is wrong with the file
    return count, ((f"{path} row {i}", row) for i, row in enumerate(read_rows(path, unreadable="yield")))


def conversation(row, opts: TokenizeOptions) -> tuple[list[dict], list[dict] | None]:
    """The row's checked messages and tools; Dropped says why a row cannot be kept."""
    if isinstance(row, UnreadableRow):
        raise Dropped("malformed", row.reason)
    try:
        messages, tools = row_to_messages(row, opts)
        if is_sharegpt(messages):
            messages = sharegpt_messages(messages)
        if isinstance(messages, (list, tuple)) and not messages:
            raise Dropped("empty", "no messages")
        messages, tools = normalize_messages(messages), normalize_tools(tools)
    except BadRow as err:
        raise Dropped("malformed", str(err)) from None
    for i, message in enumerate(messages):
        # A turn with no text teaches nothing (or, as an assistant turn, to say nothing).
        if message["role"] != "system" and "tool_calls" not in message and not message.get("content", "").strip():
            raise Dropped("empty", f"message {i} ({message['role']}) has no text")
    return messages, tools


def parquet_record(messages: list[dict], tools: list[dict] | None) -> dict:
    """A row as written: tool-call arguments and tool schemas as JSON strings (the loader takes
    both), since parquet gives one type per column and they differ from row to row."""
    def stored(message: dict) -> dict:
        if "tool_calls" not in message:
            return message
        calls = [{**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
                 for call in message["tool_calls"]]
        return {**message, "tool_calls": calls}

    return {"messages": [stored(m) for m in messages], **({"tools": json.dumps(tools)} if tools else {})}


def fitted_records(messages, tools, tokenizer,
                   opts: TokenizeOptions) -> tuple[list[dict], list[tuple[int, int]], Counter]:
    """The records a kept row is written as, the (tokens, supervised tokens) of the sequences
    they train, and the data stage's counts. A row within opts.max_length is written as it is;
    one over it is dropped (opts.truncation=error) or written as the conversations its turn
    policy keeps (turns, split), history turns as context (weight 0)."""
    try:
        fitted = row_conversations({opts.messages_key: messages, opts.tools_key: tools}, tokenizer, opts)
    except BadRow as err:
        raise Dropped("malformed", str(err)) from None
    if fitted.dropped:
        raise Dropped("over_max_length", fitted.dropped, fitted.counts)
    longest = max(len(c.input_ids) for c in fitted.conversations)
    if longest > opts.max_length:
        raise Dropped("over_max_length", f"{longest} tokens > --max-length {opts.max_length}", fitted.counts)
    lengths = [(len(c.input_ids), sum(c.loss_mask)) for c in fitted.conversations]
    if not fitted.counts["over_max_length_rows"]:
        return [parquet_record(messages, tools)], lengths, fitted.counts
    return [parquet_record(c.rendered.messages, tools) for c in fitted.conversations], lengths, fitted.counts


FITTING: dict = {}  # the tokenizer and options of a process fitting rows (set once by start_fitting)


def start_fitting(tokenizer, opts: TokenizeOptions) -> None:
    FITTING.update(tokenizer=tokenizer, opts=opts)


def fit_row(item: tuple) -> tuple:
    """(where, fitted_records(...) or None, (reason, detail, counts) of a drop or None): a
    worker's answer for one checked row."""
    where, messages, tools = item
    try:
        return where, fitted_records(messages, tools, FITTING["tokenizer"], FITTING["opts"]), None
    except Dropped as drop:
        return where, None, (drop.reason, str(drop), drop.counts)


def fitted_rows(checked, tokenizer, opts: TokenizeOptions, num_proc: int):
    """fit_row over the checked rows, in order: in this process, or over num_proc worker
    processes (forkserver, each with its own tokenizer), rows handed out a few at a time."""
    if num_proc == 1:
        start_fitting(tokenizer, opts)
        yield from map(fit_row, checked)
        return
    with multiprocessing.get_context("forkserver").Pool(num_proc, start_fitting, (tokenizer, opts)) as pool:
        yield from pool.imap(fit_row, checked, chunksize=8)


def prepare(inputs: list[Path], opts: TokenizeOptions, tokenizer=None, split: str | None = None, dedupe: bool = False,
            progress: bool = False, num_proc: int = 1) -> tuple[list[list[dict]], dict]:
    """The records of each kept row as written, and the report of what was read, dropped and
    kept. With a tokenizer, rows over opts.max_length are dropped or fitted by their turns
    (fitted_records), over `num_proc` processes."""
    from tqdm import tqdm

    sources = [input_rows(path, split) for path in inputs]
    counts = [count for count, _ in sources]
    bar = tqdm(total=None if None in counts else sum(counts), unit=" rows", desc="prepare-data",
               disable=not progress)
    kept, lengths, seen, stage_counts = [], [], set(), Counter()
    dropped, examples = Counter(), {reason: [] for reason in DROP_REASONS}
    read = 0

    def drop(where: str, reason: str, detail: str, counts: Counter | None = None) -> None:
        dropped[reason] += 1
        stage_counts.update(counts or Counter())
        if len(examples[reason]) < EXAMPLES_PER_REASON:
            examples[reason].append(f"{where}: {detail}")

    def checked():
        """The rows' conversations, checked and deduplicated here (cheap); drops noted."""
        nonlocal read
        for _, rows in sources:
            for where, row in rows:
                read += 1
                bar.update()
                try:
                    messages, tools = conversation(row, opts)
                    if dedupe:
                        key = json.dumps([messages, tools], sort_keys=True)
                        if key in seen:
                            raise Dropped("duplicate", "same messages and tools as an earlier row")
                        seen.add(key)
                except Dropped as dropping:
                    drop(where, dropping.reason, str(dropping))
                    continue
                yield where, messages, tools

    if tokenizer is None:
        kept = [[parquet_record(messages, tools)] for _, messages, tools in checked()]
    else:
        for where, fitted, dropping in fitted_rows(checked(), tokenizer, opts, num_proc):
            if dropping is not None:
                drop(where, *dropping)
                continue
            records, row_lengths, row_counts = fitted
            lengths += row_lengths
            stage_counts.update(row_counts)
            kept.append(records)
    bar.close()
    report = {
        "inputs": [str(p) for p in inputs],
        "rows_read": read,
        "rows_kept": len(kept),
        "dropped": {reason: dropped[reason] for reason in DROP_REASONS},
        "dropped_examples": {reason: ex for reason, ex in examples.items() if ex},
    }
    if tokenizer is not None:
        from hpsft.inspect_data import percentile

        ordered = sorted(n for n, _ in lengths)
        report["tokenizer"] = str(tokenizer.name_or_path)
        report["max_length"] = None if opts.max_length == sys.maxsize else opts.max_length
        report["truncation"] = {"error": "drop"}.get(opts.truncation, opts.truncation)
        report["token_lengths"] = {f"p{q}": percentile(ordered, q) for q in (50, 90, 99)} if ordered else {}
        report["token_lengths"].update(max=ordered[-1] if ordered else 0, total=sum(ordered),
                                       supervised=sum(s for _, s in lengths))
        report["counts"] = dict(sorted(stage_counts.items()))
    return kept, report


def split_rows(n: int, val_fraction: float, seed: int) -> set[int]:
    """The indices of the validation rows: a seeded sample, at least one when asked for any."""
    if val_fraction == 0:
        return set()
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise UserInputError(f"--val-fraction {val_fraction} of {n} kept rows leaves no training rows")
    return set(random.Random(seed).sample(range(n), n_val))


def write(records: list[dict], path: Path) -> None:
    try:
        chat_corpora.write_parquet(records, path)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise UserInputError(f"the rows cannot share one parquet schema ({err}): a message key holds values of "
                             "different types in different rows; make them one type") from None


def report_text(report: dict) -> str:
    drops = ", ".join(f"{reason} {n}" for reason, n in report["dropped"].items() if n) or "none"
    lines = [f"rows: {report['rows_read']} read, {report['rows_kept']} kept, dropped: {drops}"]
    for reason, examples in report["dropped_examples"].items():
        lines += [f"  {reason}: {example}" for example in examples]
    if "token_lengths" in report:
        lengths = report["token_lengths"]
        lines.append(f"tokens per sequence of the kept rows ({report['tokenizer']}): "
                     + ", ".join(f"{k}={v}" for k, v in lengths.items()))
        if report["counts"]:
            lines.append(f"counts (--truncation {report['truncation']}): "
                         + ", ".join(f"{k}={v}" for k, v in report["counts"].items()))
    lines += [f"{path} ({n} rows)" for path, n in report["written"].items()]
    lines += [f"{path} ({held['sequences']} sequences, {held['tokens']} tokens, {held['supervised_tokens']} supervised)"
              for path, held in report.get("stores", {}).items()]
    return "\n".join(lines)


def prepare_files(args) -> dict:
    if args.max_length is not None and args.tokenizer is None:
        raise UserInputError("--max-length needs --tokenizer (a model folder) to count tokens")
    if args.max_length is not None and args.max_length < 1:
        raise UserInputError(f"--max-length must be positive, got {args.max_length}")
    if args.store and args.tokenizer is None:
        raise UserInputError("--store tokenizes the written rows: give --tokenizer (the model folder the store is "
                             "for)")
    if args.truncation != "drop" and args.max_length is None:
        raise UserInputError(f"--truncation {args.truncation} fits rows to --max-length: give --max-length "
                             "(and --tokenizer)")
    if args.sharegpt or args.sharegpt_only:
        raise UserInputError("--sharegpt and --sharegpt-only take packaged ShareGPT conversations: they go without "
                             "input files")
    val_fraction = args.val_fraction or 0.0
    if not 0 <= val_fraction < 1:
        raise UserInputError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    opts = TokenizeOptions(messages_key=args.messages_key, prompt_key=args.prompt_key,
                           response_key=args.response_key, tools_key=args.tools_key,
                           chat_template=chat_template_text(args.chat_template),
                           max_length=args.max_length or sys.maxsize,
                           # drop: prepare() drops an over-long row itself, the sequences are never cut.
                           truncation={"drop": "error"}.get(args.truncation, args.truncation), bad_rows="skip")
    tokenizer = None
    if args.tokenizer is not None:
        from hpsft.models.loading import load_tokenizer

        tokenizer = load_tokenizer(str(args.tokenizer))
        if opts.chat_template is None and tokenizer.chat_template is None:
            raise UserInputError(f"the tokenizer of {args.tokenizer} has no chat template: give one with "
                                 "--chat-template <Jinja text or .jinja file>")
    num_proc = args.num_proc or default_num_proc()
    kept, report = prepare(args.inputs, opts, tokenizer, args.split, args.dedupe, progress=sys.stderr.isatty(),
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


def write_store(path: Path, tokenizer, opts: TokenizeOptions, num_proc: int, shard_mb: float) -> dict:
    """The token store of a written parquet file, beside it (<name>.store/), through the data
    stage the trainer runs (hpsft/data/preparation.py): a training job names it in
    data.train_files and tokenizes nothing. The rows already fit --max-length, so the store's
    options refuse a row over it rather than cut it."""
    from hpsft.data.preparation import DEFAULT_SHARD_MB, LocalRunner, prepare as prepare_store

    store_opts = dataclasses.replace(opts, truncation="error", bad_rows="error")
    store_dir = path.with_suffix(".store")
    store_dir.mkdir(exist_ok=True)
    _, manifest = prepare_store(str(path), tokenizer, store_opts, store_dir.parent, LocalRunner(num_proc),
                                shard_mb or DEFAULT_SHARD_MB, path.name, report=True, bar=sys.stderr.isatty(),
                                store_dir=store_dir)
    return {key: manifest[key] for key in ("rows", "sequences", "tokens", "supervised_tokens")}


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hpsft prepare-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", type=Path,
                        help="data files or datasets folders (none: the packaged corpora)")
    parser.add_argument("--out", required=True, type=Path, help="output folder (train.parquet, val.parquet, "
                        "report.json)")
    parser.add_argument("--messages-key", default="messages", help="column of the conversations (default messages)")
    parser.add_argument("--prompt-key", default="prompt", help="single-turn rows: the prompt column (default prompt)")
    parser.add_argument("--response-key", default="response", help="single-turn rows: the reply column "
                        "(default response)")
    parser.add_argument("--tools-key", default="tools", help="column of per-row tool schemas (default tools)")
    parser.add_argument("--split", default=None, help="the split of a DatasetDict folder (default: train, or "
                        "its only split)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a model folder: count tokens through its chat template (and --max-length)")
    parser.add_argument("--max-length", type=int, default=None, help="fit rows to this many tokens (--truncation)")
    parser.add_argument("--truncation", choices=("drop", "turns", "split"), default="drop",
                        help="a row over --max-length: drop it (default), keep its leading whole turns, or split it "
                             "into rows at turn boundaries (history as context)")
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
        given += ["--truncation"] if args.truncation != "drop" else []
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
