"""hpsft prepare-data's rows (hpsft/commands/prepare_data.py): read from files or a datasets
folder, checked, deduplicated, fitted to --max-length by the data stage's turn policies on its
worker pool (data/preparation.py), reported, and written as parquet (and token stores)."""

import dataclasses
import json
import random
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hpsft.assets import chat_corpora
from hpsft.data.chat_messages import BadRow, normalize_messages, normalize_tools
from hpsft.data.inspection import percentile
from hpsft.data.preparation import DEFAULT_SHARD_MB, WORKER_STATE, LocalRunner, init_worker, prepare, worker_pool
from hpsft.data.row_sequences import row_conversations
from hpsft.data.layouts import HOUSE_LAYOUT, row_messages
from hpsft.data.rows import TokenizeOptions, UnreadableRow
from hpsft.data.shards import compression, data_suffix, entry_rows, expand_entry
from hpsft.utils.errors import UserInputError

DROP_REASONS = ("malformed", "empty", "duplicate", "over_max_length")
EXAMPLES_PER_REASON = 5  # where and why, for the first few dropped rows of each reason


class Dropped(Exception):
    def __init__(self, reason: str, detail: str, counts: Counter | None = None):
        super().__init__(detail)
        self.reason = reason
        self.counts = counts or Counter()  # the data stage's counts of a row dropped for its length


def input_rows(path: Path, split: str | None):
    """(row count or None when unknown before reading, iterator of (where, row)): the files
    (or datasets folder) `path` names, read by the data stage's readers (data/shards.py)."""
    counts = [parquet_rows(f) for f in expand_entry(str(path), split)]
    return (None if None in counts else sum(counts)), entry_rows(path, split)


def parquet_rows(path: Path) -> int | None:
    """The rows of a parquet file from its footer; None for other files (and a broken parquet
    file, which its reader names)."""
    if data_suffix(path) != ".parquet" or compression(path) is not None:
        return None
    try:
        return pq.read_metadata(path).num_rows
    except (pa.ArrowException, OSError):
        return None


def conversation(row, opts: TokenizeOptions) -> tuple[list[dict], list[dict] | None]:
    """The row's checked messages and tools; Dropped says why a row cannot be kept."""
    if isinstance(row, UnreadableRow):
        raise Dropped("malformed", row.reason)
    try:
        messages, tools = row_messages(row, opts)
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
    policy keeps (turns, split), history turns as context (weight 0). `opts` read the house
    layout (HOUSE_LAYOUT): the messages are the row's, already checked."""
    try:
        fitted = row_conversations({"messages": messages, "tools": tools}, tokenizer, opts)
    except BadRow as err:
        raise Dropped("malformed", str(err)) from None
    if fitted.dropped:
        raise Dropped("over_max_length", fitted.dropped, fitted.counts)
    longest = max(len(c.input_ids) for c in fitted.conversations)
    if longest > opts.max_length:  # --truncation drop
        fitted.counts["lost_supervised_tokens"] += sum(sum(c.loss_mask) for c in fitted.conversations)
        raise Dropped("over_max_length", f"{longest} tokens > --max-length {opts.max_length}", fitted.counts)
    lengths = [(len(c.input_ids), sum(c.loss_mask)) for c in fitted.conversations]
    if not fitted.counts["over_max_length_rows"]:
        return [parquet_record(messages, tools)], lengths, fitted.counts
    return [parquet_record(c.rendered.messages, tools) for c in fitted.conversations], lengths, fitted.counts


def fit_row(item: tuple) -> tuple:
    """(where, fitted_records(...) or None, (reason, detail, counts) of a drop or None): a
    worker's answer for one checked row, with the worker's tokenizer and options (the data
    stage's WORKER_STATE)."""
    where, messages, tools = item
    try:
        return where, fitted_records(messages, tools, WORKER_STATE["tokenizer"], WORKER_STATE["opts"]), None
    except Dropped as drop:
        return where, None, (drop.reason, str(drop), drop.counts)


def fitted_rows(checked, tokenizer, opts: TokenizeOptions, num_proc: int):
    """fit_row over the checked rows, in order: in this process, or over num_proc worker
    processes (the data stage's worker_pool), rows handed out a few at a time."""
    if num_proc == 1:
        init_worker(tokenizer, opts)
        yield from map(fit_row, checked)
        return
    with worker_pool(num_proc, tokenizer, opts) as pool:
        yield from pool.imap(fit_row, checked, chunksize=8)


def kept_rows(inputs: list[Path], opts: TokenizeOptions, tokenizer=None, split: str | None = None, dedupe: bool = False,
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
        house_opts = dataclasses.replace(opts, **HOUSE_LAYOUT)
        for where, fitted, dropping in fitted_rows(checked(), tokenizer, house_opts, num_proc):
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
            lines.append(long_rows_text(report))
            lines.append(f"counts (--truncation {report['truncation']}): "
                         + ", ".join(f"{k}={v}" for k, v in report["counts"].items()))
    lines += [f"{path} ({n} rows)" for path, n in report["written"].items()]
    lines += [f"{path} ({held['sequences']} sequences, {held['tokens']} tokens, {held['supervised_tokens']} supervised)"
              for path, held in report.get("stores", {}).items()]
    return "\n".join(lines)


def long_rows_text(report: dict) -> str:
    """What --truncation did to the rows over --max-length, and the supervised tokens it cost."""
    counts, lengths = report["counts"], report["token_lengths"]
    lost = counts.get("lost_supervised_tokens", 0)
    share = lost / max(1, lengths["supervised"] + lost)
    return (f"{counts.get('over_max_length_rows', 0)} rows over --max-length {report['max_length']} (--truncation "
            f"{report['truncation']}): {counts.get('turns_rows', 0)} cut to their leading turns, "
            f"{counts.get('split_rows', 0)} split into {counts.get('split_sequences', 0)} rows, "
            f"{report['dropped']['over_max_length']} dropped; {lost} supervised tokens lost ({share:.1%})")


def write_store(path: Path, tokenizer, opts: TokenizeOptions, num_proc: int, shard_mb: float) -> dict:
    """The token store of a written parquet file, beside it (<name>.store/), through the data
    stage the trainer runs (hpsft/data/preparation.py): a training job names it in
    data.train_files and tokenizes nothing. The rows already fit --max-length, so the store's
    options refuse a row over it rather than cut it."""
    store_opts = dataclasses.replace(opts, **HOUSE_LAYOUT, truncation="error", bad_rows="error")
    store_dir = path.with_suffix(".store")
    store_dir.mkdir(exist_ok=True)
    _, manifest = prepare(str(path), tokenizer, store_opts, store_dir.parent, LocalRunner(num_proc),
                          shard_mb or DEFAULT_SHARD_MB, path.name, report=True, bar=sys.stderr.isatty(),
                          store_dir=store_dir)
    return {key: manifest[key] for key in ("rows", "sequences", "tokens", "supervised_tokens")}
