"""hpsft prepare-data's rows (hpsft/commands/prepare_data.py): read from files or a datasets
folder by the data stage's readers (data/shards.py), checked and fitted to --max-length by its
turn policies, range by range on its worker pool (data/preparation.py: run_jobs; this process
only plans the ranges and gathers what they kept), deduplicated, reported, and written as
parquet (and token stores)."""

import dataclasses
import hashlib
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from hpsft.assets import chat_corpora
from hpsft.data.chat_messages import BadRow, normalize_messages, normalize_tools
from hpsft.data.inspection import percentile
from hpsft.data.preparation import DEFAULT_SHARD_MB, ROWS_PER_CALL, WORKER_STATE, LocalRunner, prepare, run_jobs
from hpsft.data.row_sequences import RowConversations, rows_conversations
from hpsft.data.layouts import HOUSE_LAYOUT, row_messages
from hpsft.data.rows import TokenizeOptions, UnreadableRow
from hpsft.data.shards import Shard, compression, expand_entry, file_shards, shard_rows
from hpsft.utils.errors import UserInputError

DROP_REASONS = ("malformed", "empty", "duplicate", "over_max_length")
EXAMPLES_PER_REASON = 5  # where and why, for the first few dropped rows of each reason
RANGE_BYTES = 1 << 20  # input per job: enough jobs for every process on a few MiB
WINDOW_ROWS = 64  # rows in a block of a file read whole by several jobs (RowRange)


class Dropped(Exception):
    def __init__(self, reason: str, detail: str, counts: Counter | None = None):
        super().__init__(detail)
        self.reason = reason
        self.counts = counts or Counter()  # the data stage's counts of a row dropped for its length


@dataclass(frozen=True)
class RowRange:
    """A job of kept_rows: the rows of `shard` (a range of one input file, data/shards.py) that
    a worker reads, checks and fits. A shard read whole (a JSON array, a compressed file, a
    datasets .arrow file) is shared by `windows` jobs, each reading it all and keeping the
    blocks of WINDOW_ROWS rows that fall to its `window` in turn."""

    file: int  # the input file's place in the inputs' order
    shard: Shard
    window: int = 0
    windows: int = 1
    dedupe: bool = False  # also the key of each checked row's conversation

    def holds(self, n: int) -> bool:
        return (n // WINDOW_ROWS) % self.windows == self.window


def row_ranges(inputs: list[Path], split: str | None, num_proc: int, dedupe: bool) -> list[RowRange]:
    """The jobs reading every row of the inputs' files once: ranges of about RANGE_BYTES of input
    (JSONL byte ranges, parquet row ranges); a file read whole split over up to 2 jobs per process."""
    files = [path for entry in inputs for path in expand_entry(str(entry), split)]
    jobs = []
    for i, path in enumerate(files):
        for shard in file_shards(path, RANGE_BYTES):
            whole = shard.kind in ("json_array", "arrow") or compression(path) is not None
            windows = min(2 * num_proc, -(-shard.input_bytes // RANGE_BYTES)) if whole else 1
            jobs += [RowRange(i, shard, w, windows, dedupe) for w in range(windows)]
    return jobs


def known_rows(jobs: list[RowRange]) -> int | None:
    """The rows the jobs read, known before reading when every file is parquet (its footer)."""
    if any(job.shard.kind != "parquet" for job in jobs):
        return None
    return sum(job.shard.stop - job.shard.start for job in jobs)


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


def fitted_records(messages, tools, fitted: RowConversations | BadRow,
                   opts: TokenizeOptions) -> tuple[list[dict], list[tuple[int, int]], Counter]:
    """The records a kept row is written as, the (tokens, supervised tokens) of the sequences
    they train, and the data stage's counts, from the row's conversations as the data stage
    fits them (`fitted`, row_sequences.rows_conversations of the checked messages). A row within
    opts.max_length is written as it is; one over it is dropped (opts.truncation=error) or
    written as the conversations its turn policy keeps (turns, split), history turns as context
    (weight 0)."""
    if isinstance(fitted, BadRow):
        raise Dropped("malformed", str(fitted))
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


def range_outcomes(job: RowRange) -> list[tuple]:
    """A worker's job (run_jobs, with the worker's tokenizer and options: WORKER_STATE): the
    rows of `job` read, checked and, with a tokenizer, fitted ROWS_PER_CALL at a time in one
    tokenizer call, as the data stage does. Per row, in order: (row number, the key of its
    conversation with job.dedupe (else None), (records, lengths, counts) of a kept row or None,
    (reason, detail, counts) of a dropped one or None)."""
    tokenizer, opts = WORKER_STATE["tokenizer"], WORKER_STATE["opts"]
    outcomes, checked = [], []  # checked: (index in outcomes, messages, tools) of the rows to fit
    for n, row in shard_rows(job.shard):
        if not job.holds(n):
            continue
        try:
            messages, tools = conversation(row, opts)
        except Dropped as drop:
            outcomes.append((n, None, None, (drop.reason, str(drop), drop.counts)))
            continue
        key = (hashlib.sha256(json.dumps([messages, tools], sort_keys=True).encode()).digest() if job.dedupe
               else None)
        outcomes.append((n, key, ([parquet_record(messages, tools)], [], Counter()), None))
        checked.append((len(outcomes) - 1, messages, tools))
    if tokenizer is not None:
        house_opts = dataclasses.replace(opts, **HOUSE_LAYOUT)
        for start in range(0, len(checked), ROWS_PER_CALL):
            chunk = checked[start:start + ROWS_PER_CALL]
            fitted = rows_conversations([{"messages": m, "tools": t} for _, m, t in chunk], tokenizer, house_opts)
            for (i, messages, tools), row_fitted in zip(chunk, fitted):
                n, key = outcomes[i][:2]
                try:
                    outcomes[i] = (n, key, fitted_records(messages, tools, row_fitted, house_opts), None)
                except Dropped as drop:
                    outcomes[i] = (n, key, None, (drop.reason, str(drop), drop.counts))
    return outcomes


def kept_rows(inputs: list[Path], opts: TokenizeOptions, tokenizer=None, split: str | None = None, dedupe: bool = False,
              progress: bool = False, num_proc: int = 1) -> tuple[list[list[dict]], dict]:
    """The records of each kept row as written, and the report of what was read, dropped and
    kept. The rows are read, checked and (with a tokenizer) fitted to opts.max_length by their
    turns (fitted_records) in ranges (row_ranges) over `num_proc` processes (run_jobs, the data
    stage's pool); this process plans the ranges, then deduplicates and counts the rows in input
    order."""
    from tqdm import tqdm

    jobs = row_ranges(inputs, split, num_proc, dedupe)
    bar = tqdm(total=known_rows(jobs), unit=" rows", desc="prepare-data", disable=not progress)
    results = []  # (file, row number, file path, outcome) of every row read

    def done(job: RowRange, outcomes: list[tuple]) -> None:
        results.extend((job.file, outcome[0], job.shard.path, outcome) for outcome in outcomes)
        bar.update(len(outcomes))

    run_jobs(range_outcomes, jobs, num_proc, tokenizer, opts, done)
    bar.close()
    kept, lengths, seen, stage_counts = [], [], set(), Counter()
    dropped, examples = Counter(), {reason: [] for reason in DROP_REASONS}
    for _, n, path, (_, key, fitted, dropping) in sorted(results, key=lambda r: r[:2]):
        if key is not None:
            if key in seen:
                fitted, dropping = None, ("duplicate", "same messages and tools as an earlier row", Counter())
            seen.add(key)
        if dropping is not None:
            reason, detail, counts = dropping
            dropped[reason] += 1
            stage_counts.update(counts)
            if len(examples[reason]) < EXAMPLES_PER_REASON:
                examples[reason].append(f"{path} row {n}: {detail}")
            continue
        records, row_lengths, row_counts = fitted
        lengths += row_lengths
        stage_counts.update(row_counts)
        kept.append(records)
    report = {
        "inputs": [str(p) for p in inputs],
        "rows_read": len(results),
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
