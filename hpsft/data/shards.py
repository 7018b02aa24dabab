"""The inputs of one data source cut into shards: the units the data stage tokenizes in
parallel, caches and resumes one by one.

An entry of data.train_files / data.val_files names a file, a folder (every .parquet,
.jsonl and .json file under it, recursively, in path order; hidden files and token stores
skipped) or a glob
(`data/part-*.parquet`, `data/**/*.jsonl`). Each file is cut into shards of about
`shard_bytes` bytes of input, read without holding the file in memory:
- parquet: ranges of rows (rows per shard from the file's bytes per row), read by row group;
- JSONL (and .json files with one row a line): byte ranges that start and end at line
  boundaries, read line by line; the plan counts the lines before each range, so rows are
  still named by their line in the file;
- a .json file holding one JSON array is one shard, parsed whole (convert a big one to JSONL).
Every process computes the same plan from the files alone (no communication).
"""

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hpsft.data.rows import DataError, UnreadableRow, drop_nulls

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
SCAN_BLOCK = 16 << 20  # bytes read at a time when a JSONL file's lines are counted
JSON_PROBE = 4096  # bytes read to tell a JSON array file from JSONL


@dataclass(frozen=True)
class Shard:
    path: str
    kind: str  # parquet | jsonl | json_array
    start: int  # parquet: first row; jsonl: first byte; json_array: 0
    stop: int  # parquet: row after the last; jsonl: byte after the last; json_array: the file's size
    first_row: int  # the row number (parquet row, JSONL line) of the shard's first row
    input_bytes: int  # bytes of input it covers (for parquet, its share of the file): what progress counts


def expand_entry(entry: str) -> list[Path]:
    """The data files an entry of data.train_files names, in a fixed order."""
    path = Path(entry)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(data_files_under(path))
        if not files:
            raise DataError(f"data folder {path} holds no .parquet, .jsonl or .json file")
        return files
    if glob.has_magic(entry):
        files = sorted(Path(p) for p in glob.glob(entry, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"data files {entry!r}: the pattern matches no file")
        unsupported = [str(p) for p in files if p.suffix.lower() not in DATA_SUFFIXES]
        if unsupported:
            raise DataError(f"data files {entry!r} match {unsupported[:3]}: unsupported format (use .parquet, "
                            ".jsonl or .json)")
        return files
    raise DataError(f"data file {path} does not exist")


def data_files_under(folder: Path):
    """The data files under `folder`, skipping hidden files and folders and token stores (a
    data.cache_dir inside the data folder holds JSON sidecars that are no data)."""
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(name.startswith("shard-") and name.endswith(".arrow") for name in names):
            continue
        dirs[:] = [d for d in dirs if not (Path(root) / d / "store.json").is_file()]
        yield from (Path(root) / name for name in names
                    if not name.startswith(".") and Path(name).suffix.lower() in DATA_SUFFIXES)


def is_json_array(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(JSON_PROBE).lstrip().startswith(b"[")


def parquet_shards(path: Path, shard_bytes: int) -> list[Shard]:
    try:
        rows = pq.read_metadata(path).num_rows
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path} is not a readable parquet file ({err}): rewrite it, or convert it to "
                        ".jsonl") from None
    size = path.stat().st_size
    per_shard = max(1, rows * shard_bytes // max(size, 1))
    return [Shard(str(path), "parquet", start, min(start + per_shard, rows), start,
                  size * (min(start + per_shard, rows) - start) // rows)
            for start in range(0, rows, per_shard)]


def jsonl_shards(path: Path, shard_bytes: int) -> list[Shard]:
    """Byte ranges of about shard_bytes, each ending after a newline (or at the end of the
    file): the smallest line boundary at or past start + shard_bytes, so that lines filling
    shard_bytes exactly make a shard of their own (as parquet's rows do). With the number of
    lines before each: every byte is read once."""
    size = path.stat().st_size
    shards, start, lines_before = [], 0, 0
    with open(path, "rb") as f:
        while start < size:
            stop = size
            if start + shard_bytes < size:
                f.seek(start + shard_bytes - 1)
                f.readline()  # on to the end of the line holding the shard's last byte
                stop = f.tell()
            shards.append(Shard(str(path), "jsonl", start, stop, lines_before, stop - start))
            f.seek(start)
            for offset in range(start, stop, SCAN_BLOCK):
                lines_before += f.read(min(SCAN_BLOCK, stop - offset)).count(b"\n")
            start = stop
    return shards


def file_shards(path: Path, shard_bytes: int) -> list[Shard]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return parquet_shards(path, shard_bytes)
    if suffix not in (".jsonl", ".json"):
        raise DataError(f"data file {path}: unsupported format {suffix!r} (use .parquet, .jsonl or .json)")
    if path.stat().st_size == 0:
        return []
    if suffix == ".json" and is_json_array(path):
        return [Shard(str(path), "json_array", 0, path.stat().st_size, 0, path.stat().st_size)]
    return jsonl_shards(path, shard_bytes)


def plan_shards(files: list[Path], shard_bytes: int) -> list[Shard]:
    """Every file's shards, in order; paths resolved (a Ray task may run in another folder)."""
    return [shard for path in files for shard in file_shards(path.resolve(), shard_bytes)]


def shard_rows(shard: Shard):
    """(row number in its file, row) for every row of the shard; a JSONL line that is not
    JSON comes as an UnreadableRow (the caller names it or counts it)."""
    path = Path(shard.path)
    try:
        if shard.kind == "parquet":
            yield from parquet_rows(path, shard)
        elif shard.kind == "json_array":
            yield from json_array_rows(path)
        else:
            yield from jsonl_rows(path, shard)
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason}: {err.object[err.start:err.start + 4]!r}); "
                        "re-encode the file as UTF-8") from None


def parquet_rows(path: Path, shard: Shard):
    """Parquet stores a column of dicts as one struct type holding every key seen in the column,
    so a key a row lacks comes back as None: such Nones are dropped (docs/data.md)."""
    try:
        file = pq.ParquetFile(path)
        meta = file.metadata
        groups, first = [], 0  # the row groups overlapping the shard, and the row the first begins at
        group_start = 0
        for g in range(meta.num_row_groups):
            group_rows = meta.row_group(g).num_rows
            if group_start < shard.stop and group_start + group_rows > shard.start:
                if not groups:
                    first = group_start
                groups.append(g)
            group_start += group_rows
        row = first
        for batch in file.iter_batches(batch_size=256, row_groups=groups):
            for record in batch.to_pylist():
                if shard.start <= row < shard.stop:
                    yield row, drop_nulls(record)
                row += 1
                if row >= shard.stop:
                    return
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path} is not a readable parquet file ({err}): rewrite it, or convert it to "
                        ".jsonl") from None


def jsonl_rows(path: Path, shard: Shard):
    with open(path, "rb") as f:
        f.seek(shard.start)
        line_no, position = shard.first_row, shard.start
        while position < shard.stop:
            line = f.readline()
            if not line:
                break
            position += len(line)
            if line.strip():
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as err:
                    yield line_no, UnreadableRow(f"not valid JSON ({err.msg})")
            line_no += 1


def json_array_rows(path: Path):
    with open(path, encoding="utf-8") as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {err.lineno}: not valid JSON ({err.msg}); a .json file holds one "
                            "JSON array of rows, or one row a line") from None
    yield from enumerate(rows)
