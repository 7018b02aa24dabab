"""The inputs of one data source cut into shards: the units the data stage tokenizes in
parallel, caches and resumes one by one.

An entry of data.train_files / data.val_files names a file, a folder (every data file
under it, recursively, in path order; hidden files and token stores skipped; a folder written
by Hugging Face `datasets`' save_to_disk: its .arrow files) or a glob
(`data/part-*.parquet`, `data/**/*.jsonl`). Data files: .parquet, .jsonl, .json (an array of
rows, or one a line), and .jsonl/.json compressed by gzip (.gz) or zstd (.zst). Each file is
cut into shards of about `shard_bytes` bytes of input, read without holding the file in memory:
- parquet: ranges of rows (rows per shard from the file's bytes per row), read by row group;
- JSONL (and .json files with one row a line): byte ranges that start and end at line
  boundaries, read line by line; the plan counts the lines before each range, so rows are
  still named by their line in the file;
- a .json file holding one JSON array is one shard, parsed whole (convert a big one to JSONL);
- a compressed file is one shard (a compressed stream cannot be entered mid-way), read as a
  stream (pyarrow's gzip and zstd codecs: no other package);
- a datasets .arrow file (an Arrow IPC stream) is one shard, read batch by batch.
Every process computes the same plan from the files alone (no communication).
"""

import glob
import io
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hpsft.data.rows import DataError, UnreadableRow, drop_nulls

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")  # and .jsonl/.json compressed (COMPRESSIONS)
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
FORMATS = ".parquet, .jsonl, .json, .jsonl.gz/.json.gz, .jsonl.zst/.json.zst or a datasets save_to_disk folder"
SCAN_BLOCK = 16 << 20  # bytes read at a time when a JSONL file's lines are counted
JSON_PROBE = 4096  # bytes read to tell a JSON array file from JSONL


@dataclass(frozen=True)
class Shard:
    path: str
    kind: str  # parquet | jsonl | json_array | arrow
    start: int  # parquet: first row; jsonl: first byte; json_array, arrow: 0
    stop: int  # parquet: row after the last; jsonl: byte after the last; json_array, arrow: the file's size
    first_row: int  # the row number (parquet row, JSONL line) of the shard's first row
    input_bytes: int  # bytes of input it covers (for parquet, its share of the file): what progress counts


def expand_entry(entry: str, split: str | None = None) -> list[Path]:
    """The data files an entry of data.train_files names, in a fixed order; `split`: the split
    of a datasets DatasetDict folder (default train, or its only split)."""
    path = Path(entry)
    if path.is_file():
        return [path]
    if path.is_dir() and is_dataset_folder(path):
        return dataset_files(path, split)
    if split is not None:
        raise DataError(f"--split {split}: {path} is not a datasets DatasetDict folder; drop --split")
    if path.is_dir():
        files = sorted(data_files_under(path))
        if not files:
            raise DataError(f"data folder {path} holds no data file ({FORMATS})")
        return files
    if glob.has_magic(entry):
        files = sorted(Path(p) for p in glob.glob(entry, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"data files {entry!r}: the pattern matches no file")
        unsupported = [str(p) for p in files if data_suffix(p) not in DATA_SUFFIXES]
        if unsupported:
            raise DataError(f"data files {entry!r} match {unsupported[:3]}: unsupported format (use {FORMATS})")
        return files
    raise DataError(f"data file {path} does not exist")


def data_suffix(path: Path) -> str:
    """.parquet, .jsonl, .json: the format, under a compression suffix (rows.jsonl.gz -> .jsonl)."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        return suffixes[-2] if len(suffixes) > 1 else ""
    return path.suffix.lower()


def compression(path: Path) -> str | None:
    return COMPRESSIONS.get(path.suffix.lower())


def open_bytes(path: Path):
    """The file's bytes, decompressed when its suffix says so."""
    codec = compression(path)
    return open(path, "rb") if codec is None else io.BufferedReader(pa.input_stream(str(path), compression=codec))


def is_dataset_folder(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (a DatasetDict, or one Dataset)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def dataset_files(path: Path, split: str | None) -> list[Path]:
    """The .arrow files of a save_to_disk folder (read with pyarrow: `datasets` is not needed)."""
    if (path / "dataset_dict.json").is_file():
        names = json.loads((path / "dataset_dict.json").read_text())["splits"]
        name = split or ("train" if "train" in names else names[0] if len(names) == 1 else None)
        if name not in names:
            raise DataError(f"{path} holds the splits {names}: choose one with --split (prepare-data) or name "
                            f"its folder ({path / names[0]})")
        return dataset_files(path / name, None)
    if split is not None:
        raise DataError(f"--split {split}: {path} holds one Dataset, not a DatasetDict of splits; drop --split")
    state = json.loads((path / "state.json").read_text())
    return [path / item["filename"] for item in state["_data_files"]]


def data_files_under(folder: Path):
    """The data files under `folder`, skipping hidden files and folders and token stores (a
    data.cache_dir inside the data folder holds JSON sidecars that are no data)."""
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if is_dataset_folder(Path(root)):  # its .json files describe the .arrow ones
            dirs[:] = []
            yield from dataset_files(Path(root), None)
            continue
        if any(name.startswith("shard-") and name.endswith(".arrow") for name in names):
            continue
        dirs[:] = [d for d in dirs if not (Path(root) / d / "store.json").is_file()]
        yield from (Path(root) / name for name in names
                    if not name.startswith(".") and data_suffix(Path(name)) in DATA_SUFFIXES)


def unreadable_compressed(path: Path, err: Exception) -> Exception:
    """The error a compressed file that cannot be decompressed raises (others: their own)."""
    if compression(path) is None:
        return err
    return DataError(f"{path}: not readable as {compression(path)} ({err}): compress it again")


def is_json_array(path: Path) -> bool:
    try:
        with open_bytes(path) as f:
            return f.read(JSON_PROBE).lstrip().startswith(b"[")
    except (pa.ArrowException, OSError) as err:
        raise unreadable_compressed(path, err) from None


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
    suffix, size = data_suffix(path), path.stat().st_size
    if suffix == ".parquet" and compression(path) is None:
        return parquet_shards(path, shard_bytes)
    if suffix == ".arrow" and path.parent.joinpath("state.json").is_file():
        return [Shard(str(path), "arrow", 0, size, 0, size)]
    if suffix not in (".jsonl", ".json"):
        raise DataError(f"data file {path}: unsupported format {''.join(path.suffixes)!r} (use {FORMATS})")
    if size == 0:
        return []
    if suffix == ".json" and is_json_array(path):
        return [Shard(str(path), "json_array", 0, size, 0, size)]
    if compression(path) is not None:
        return [Shard(str(path), "jsonl", 0, size, 0, size)]
    return jsonl_shards(path, shard_bytes)


def entry_rows(entry, split: str | None = None):
    """("<file> row <n>", row) for every row of the files an entry names, in order, one shard a
    file (for the readers outside the data stage: prepare-data, inspect-data, samples). A JSONL
    line that is not JSON comes as an UnreadableRow.

    Parquet (and Arrow) store a column of dicts as one struct type holding every key seen in
    the column, so a key a row lacks comes back as None (`tool_calls` on a user message, the
    argument names of other rows' tool calls, other tools' parameters): such Nones are dropped,
    giving back the rows as written. A null you mean to keep (in tool arguments or schemas)
    must be stored in a JSON string."""
    for path in expand_entry(str(entry), split):
        for shard in file_shards(path, sys.maxsize):
            for n, row in shard_rows(shard):
                yield f"{path} row {n}", row


def read_rows(entry, split: str | None = None):
    """The rows of the files an entry names; a JSONL line that is not JSON stops with an error."""
    for where, row in entry_rows(entry, split):
        if isinstance(row, UnreadableRow):
            raise DataError(f"{where}: {row.reason}")
        yield row


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
        elif shard.kind == "arrow":
            yield from arrow_rows(path)
        else:
            yield from jsonl_rows(path, shard)
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason}: {err.object[err.start:err.start + 4]!r}); "
                        "re-encode the file as UTF-8") from None
    except (pa.ArrowException, OSError) as err:
        raise unreadable_compressed(path, err) from None


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


def arrow_rows(path: Path):
    """A datasets .arrow file's rows; like parquet's, a struct column's missing keys dropped."""
    try:
        with pa.memory_map(str(path)) as source:
            row = 0
            for batch in pa.ipc.open_stream(source):
                for record in batch.to_pylist():
                    yield row, drop_nulls(record)
                    row += 1
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path} is not a readable datasets .arrow file ({err}): save the dataset again") from None


def jsonl_rows(path: Path, shard: Shard):
    """The shard's lines; a compressed file's shard is the whole file, its bytes counted
    decompressed (the shard's stop counts compressed bytes)."""
    stop = shard.stop if compression(path) is None else float("inf")
    with open_bytes(path) as f:
        if shard.start:
            f.seek(shard.start)
        line_no, position = shard.first_row, shard.start
        while position < stop:
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
    with open_bytes(path) as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {err.lineno}: not valid JSON ({err.msg}); a .json file holds one "
                            "JSON array of rows, or one row a line") from None
    yield from enumerate(rows)
