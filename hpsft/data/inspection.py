"""What data trains on, as text: supervised tokens marked, token-length percentiles and a
histogram, what the truncation policy does (hpsft inspect-data; percentile also for
prepare-data's report)."""

import json
import math
import re
from collections import Counter
from pathlib import Path

from hpsft.data.preparation import MANIFEST, is_store, summary_text
from hpsft.data.rows import TokenizeOptions
from hpsft.data.shards import expand_entry

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


def image_token_lines(input_ids: list[int], pad_id: int, images: list[tuple[str, int, str]]) -> list[str]:
    """Where each image's tokens go in a sequence. `images`: per image in row order, its size as
    text, its number of image tokens and how that number comes about (the layout's
    image_notes). Each image takes the next run of that many image tokens: two images whose
    placeholders touch (LLaVA's `<image><image>`) are told apart by their counts."""
    positions = [i for i, token in enumerate(input_ids) if token == pad_id]
    lines, taken = [], 0
    for k, (size, count, how) in enumerate(images):
        run = positions[taken:taken + count]
        taken += count
        if len(run) < count or run[-1] - run[0] != count - 1:
            return lines + [f"  image {k + 1}: {size} takes {count} image tokens, which are not one run: the "
                            "placeholders are not whole images"]
        lines.append(f"  image {k + 1}: {size} -> tokens {run[0]}-{run[-1]} ({count} image tokens = {how})")
    if taken != len(positions):
        lines.append(f"  {len(positions)} image tokens, {taken} of them the images': the placeholders are not "
                     "whole images")
    return lines


def compressed_image_pads(text: str, pad: str) -> str:
    """Runs of the image token written once with their count (a 1,000-token image stays one line)."""
    return re.sub(f"(?:{re.escape(pad)})+", lambda m: f"{pad}x{len(m.group(0)) // len(pad)}", text)


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
