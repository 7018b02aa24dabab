"""Look at what a config will train on, before spending compute on it.

    hpsft inspect-data --config configs/sft.yaml [key=value ...] [--rows 3]

For the first `--rows` conversations of data.train_files: each sequence the row trains (the
chat template applied, data.multiturn and data.truncation too), with the tokens the loss is
taken on marked: green on a terminal, between [[ and ]] otherwise (--color). Then, over the
rows (all of them, or the first --stats-rows): token lengths of the sequences (percentiles
and a histogram), how many rows are over data.max_length and what data.truncation does with
them, the counts of the data stage (rows split, expanded per turn, dropped: docs/data.md),
and how many rows are refused and why. Nothing is written.
"""

import argparse
import dataclasses
import json
import math
import sys
from collections import Counter
from pathlib import Path

from hpsft.config import load_config
from hpsft.data.chat_messages import BadRow
from hpsft.data.preparation import MANIFEST, is_store, summary_text
from hpsft.data.row_sequences import OverMaxLength, row_sequences
from hpsft.data.rows import TokenizeOptions, read_rows
from hpsft.data.shards import expand_entry
from hpsft.utils.errors import UserInputError, exits_2_on_user_error
from hpsft.models.loading import check_model_path, load_tokenizer

PLAIN_MARKS = ("[[", "]]")
COLOR_MARKS = ("\033[32m", "\033[0m")


def mask_spans(input_ids: list[int], loss_mask: list[int]) -> list[tuple[bool, list[int]]]:
    """The token ids cut into runs of equal mask value: [(supervised, ids), ...]."""
    spans: list[tuple[bool, list[int]]] = []
    for token, supervised in zip(input_ids, loss_mask):
        if spans and spans[-1][0] == bool(supervised):
            spans[-1][1].append(token)
        else:
            spans.append((bool(supervised), [token]))
    return spans


def marked_text(tokenizer, input_ids: list[int], loss_mask: list[int], marks: tuple[str, str]) -> str:
    """The decoded conversation, each run of supervised tokens between the marks. Runs are
    decoded separately, so a mark never splits a token."""
    return "".join(f"{marks[0]}{tokenizer.decode(ids)}{marks[1]}" if supervised else tokenizer.decode(ids)
                   for supervised, ids in mask_spans(input_ids, loss_mask))


def percentile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1)]


def histogram(lengths: list[int], bins: int = 10, width: int = 40) -> list[str]:
    low, high = min(lengths), max(lengths)
    step = max(1, math.ceil((high - low + 1) / bins))
    counts = Counter((n - low) // step for n in lengths)
    peak = max(counts.values())
    return [f"  {low + b * step:>7}-{low + (b + 1) * step - 1:<7} {counts.get(b, 0):>7} "
            f"{'#' * round(width * counts.get(b, 0) / peak)}" for b in range((high - low) // step + 1)]


EFFECTS = {"error": "stop the run (data.truncation=error)", "left": "be cut from the left",
           "right": "be cut from the right", "turns": "keep their leading whole turns (data.truncation=turns)",
           "split": "be split at turn boundaries (data.truncation=split)"}


def length_report(lengths: list[int], rows: int, refused: Counter, counts: Counter,
                  opts: TokenizeOptions) -> list[str]:
    """`lengths`: of the sequences the `rows` tokenized rows train (under data.truncation=error,
    of those that would stop the run too); `counts`: the data stage's, summed over the rows."""
    lines = [f"rows: {rows + sum(refused.values())} read, {rows} tokenized, {sum(refused.values())} refused"]
    for reason, count in refused.most_common(5):
        lines.append(f"  refused ({count}): {reason}")
    if not rows:
        return lines
    over = counts["over_max_length_rows"]
    effect = EFFECTS[opts.truncation]
    if opts.truncation == "error" and opts.bad_rows == "skip":
        effect = "be skipped (data.bad_rows=skip)"
    lines.append(f"rows over data.max_length={opts.max_length}: {over} ({100 * over / rows:.1f}%), "
                 f"which would {effect}")
    if counts:
        lines.append("counts: " + ", ".join(f"{name}={n}" for name, n in sorted(counts.items())))
    if not lengths:
        return lines
    ordered = sorted(lengths)
    lines.append(f"tokens per sequence ({len(ordered)} sequences): " + ", ".join(
        f"p{q}={percentile(ordered, q)}" for q in (50, 90, 99)) + f", max={ordered[-1]}, total={sum(ordered)}")
    lines.append("histogram of tokens per sequence:")
    return lines + histogram(lengths)


def input_files(sources) -> list[Path]:
    """The data files of the entries (files, folders, globs); a prepared token store has no
    rows to show, only what it holds."""
    files = []
    for source in sources:
        if is_store(source.path):
            manifest = json.loads((Path(source.path) / MANIFEST).read_text())
            print(f"=== {source.path}: a prepared token store: {summary_text(manifest)}")
        else:
            files += expand_entry(source.path)
    return files


@exits_2_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hpsft inspect-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config file (e.g. configs/sft.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.max_length=1024")
    parser.add_argument("--rows", type=int, default=3, help="conversations to show (default 3)")
    parser.add_argument("--stats-rows", type=int, default=None, help="rows the statistics cover (default: all)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="mark supervised tokens in colour (auto: on a terminal) or with [[ ]]")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    opts = TokenizeOptions.from_data_config(config.data)
    tokenizer = load_tokenizer(str(check_model_path(config.model.path, config.model.trust_remote_code)),
                               config.model.trust_remote_code)
    if opts.chat_template is None and tokenizer.chat_template is None:
        raise UserInputError(f"the tokenizer of {config.model.path} has no chat template: name one with "
                             "data.chat_template=<Jinja text or .jinja file>")
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    marks = COLOR_MARKS if color else PLAIN_MARKS
    # Under data.truncation=error a row over data.max_length stops the run: it is shown and
    # measured as it renders, without a limit.
    unlimited = dataclasses.replace(opts, max_length=sys.maxsize)
    lengths, rows, refused, counts, shown = [], 0, Counter(), Counter(), 0
    for path in input_files(config.data.train_sources()):
        for row_idx, row in enumerate(read_rows(path)):
            if args.stats_rows is not None and rows + sum(refused.values()) >= args.stats_rows:
                break
            try:
                result = row_sequences(row, tokenizer, opts)
            except OverMaxLength:
                result = row_sequences(row, tokenizer, unlimited)
                counts["over_max_length_rows"] += 1
            except BadRow as err:
                refused[str(err)] += 1
                continue
            rows += 1
            counts.update(result.counts)
            lengths += [len(ids) for ids, _ in result.sequences]
            if shown < args.rows:
                shown += 1
                if result.dropped:
                    print(f"=== {path} row {row_idx}: dropped, {result.dropped}")
                for i, (ids, mask) in enumerate(result.sequences):
                    which = f"sequence {i + 1} of {len(result.sequences)}, " if len(result.sequences) > 1 else ""
                    print(f"=== {path} row {row_idx}: {which}{len(ids)} tokens, {sum(mask)} supervised")
                    print(marked_text(tokenizer, ids, mask, marks))
    print("\n".join(length_report(lengths, rows, refused, counts, opts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
