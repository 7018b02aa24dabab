"""SFT dataset: parquet, JSONL or JSON-array rows -> tokenized, truncated, cached examples.

A row is either multi-turn (`messages`, optional `tools`) or single-turn
(`prompt`/`response`); the keys are configurable. Tokenization runs once per set of
inputs and is cached on disk (flat int32 tokens + offsets), keyed by the files' contents,
the tokenizer, the template and the options that change the result.
"""

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hpsft.data import chat_messages, chat_tokenize
from hpsft.data.chat_messages import BadRow
from hpsft.data.chat_tokenize import tokenize_conversation
from hpsft.errors import UserInputError
from hpsft.files import load_plain_data, umask_mode
from hpsft.progress import progress_bar


class DataError(UserInputError):
    """Bad input data: the message names the file and the row."""


@dataclass(frozen=True)
class TokenizeOptions:
    messages_key: str
    prompt_key: str
    response_key: str
    tools_key: str
    chat_template: str | None
    max_length: int
    truncation: str  # error | left | right
    bad_rows: str  # error | skip

    @classmethod
    def from_data_config(cls, cfg) -> "TokenizeOptions":
        fields = {name: getattr(cfg, name) for name in cls.__dataclass_fields__}
        return cls(**{**fields, "chat_template": chat_template_text(cfg.chat_template)})


def chat_template_text(value: str | None) -> str | None:
    """data.chat_template is Jinja text, or the path of a file holding it (a value with no
    Jinja tag in it): read only from the path the config names."""
    if value is None or "{%" in value or "{{" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise UserInputError(f"data.chat_template={value!r} is neither a Jinja template (no '{{%' or '{{{{' in it) "
                             "nor an existing template file")
    return path.read_text(encoding="utf-8")


def drop_nulls(value):
    """`value` without the None-valued keys of its dicts, at any depth."""
    if isinstance(value, dict):
        return {key: drop_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [drop_nulls(item) for item in value]
    return value


class UnreadableRow(NamedTuple):
    """A JSONL line that is not JSON, yielded in its row's place by read_rows(path, unreadable="yield")."""
    reason: str


def read_rows(path: Path, unreadable: str = "error"):
    """Yield the rows of a parquet, JSONL or JSON file (an array of rows, or one a line).
    A JSONL line that is not JSON stops with an error, or with unreadable="yield" comes as an
    UnreadableRow (for hpsft prepare-data, which counts and drops it).

    Parquet stores a column of dicts as one struct type holding every key seen in the column,
    so a key a row lacks comes back as None (`tool_calls` on a user message, the argument names
    of other rows' tool calls, other tools' parameters): such Nones are dropped, giving back the
    rows as written. A null you mean to keep (in tool arguments or schemas) must be stored in a
    JSON string.
    """
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{path} is not a readable parquet file ({err}): rewrite it, or convert it to "
                            ".jsonl") from None
        for batch in table.to_batches():
            yield from (drop_nulls(row) for row in batch.to_pylist())
    elif suffix in (".jsonl", ".json"):
        try:
            yield from json_rows(path, unreadable)
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 text ({err.reason}: {err.object[err.start:err.start + 4]!r}); "
                            "re-encode the file as UTF-8") from None
    else:
        raise DataError(f"data file {path}: unsupported format {suffix!r} (use .parquet, .jsonl or .json)")


def json_rows(path: Path, unreadable: str = "error"):
    """One JSON row a line (JSONL), or one JSON array of rows (what a .json file often holds)."""
    with open(path, encoding="utf-8") as f:
        first = f.read(4096).lstrip()
        f.seek(0)
        if first.startswith("["):
            try:
                rows = json.load(f)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {err.lineno}: not valid JSON ({err.msg}); a .json file holds one "
                                "JSON array of rows, or one row a line") from None
            yield from rows
            return
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                if unreadable == "yield":
                    yield UnreadableRow(f"not valid JSON ({err.msg})")
                    continue
                raise DataError(f"{path} row {i}: not valid JSON ({err.msg})") from None


def row_to_messages(row: dict, opts: TokenizeOptions):
    if not isinstance(row, dict):
        raise BadRow(f"row must be an object, got {type(row).__name__}")
    if row.get(opts.messages_key) is not None:
        return row[opts.messages_key], row.get(opts.tools_key)
    if opts.prompt_key in row and opts.response_key in row:
        prompt, response = row[opts.prompt_key], row[opts.response_key]
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], None
    raise BadRow(
        f"row has neither '{opts.messages_key}' nor '{opts.prompt_key}'/'{opts.response_key}' "
        f"(keys: {sorted(row)})"
    )


def truncate(input_ids: list[int], loss_mask: list[int], opts: TokenizeOptions):
    if len(input_ids) <= opts.max_length:
        return input_ids, loss_mask
    if opts.truncation == "error":
        raise BadRow(
            f"sequence has {len(input_ids)} tokens > data.max_length={opts.max_length} "
            "(raise data.max_length or set data.truncation=left|right)"
        )
    keep = slice(-opts.max_length, None) if opts.truncation == "left" else slice(0, opts.max_length)
    return input_ids[keep], loss_mask[keep]


def tokenize_files(files: list[Path], tokenizer, opts: TokenizeOptions, progress: bool = False) -> dict:
    tokens, masks, lengths, skipped = [], [], [], 0
    with progress_bar(progress, desc="tokenize", unit="row") as bar:  # no total: rows are counted as read
        for path in files:
            for row_idx, row in enumerate(read_rows(path)):
                bar.update(1)
                try:
                    messages, tools = row_to_messages(row, opts)
                    ids, mask = tokenize_conversation(tokenizer, messages, tools, opts.chat_template)
                    ids, mask = truncate(ids, mask, opts)
                except BadRow as err:
                    if opts.bad_rows == "skip":
                        skipped += 1
                        continue
                    raise DataError(f"{path} row {row_idx}: {err} (set data.bad_rows=skip to skip such rows)") from None
                tokens.extend(ids)
                masks.extend(mask)
                lengths.append(len(ids))
    if not lengths:
        raise DataError(f"no usable rows in {[str(f) for f in files]}")
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return {
        "input_ids": torch.tensor(tokens, dtype=torch.int32),
        "loss_mask": torch.tensor(masks, dtype=torch.bool),
        "offsets": offsets,
        "skipped_rows": skipped,
    }


def cache_key(files: list[Path], tokenizer, opts: TokenizeOptions) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.resolve()).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    h.update(json.dumps(opts.__dict__, sort_keys=True).encode())
    h.update(str(tokenizer.name_or_path).encode())
    h.update(str(len(tokenizer)).encode())
    h.update(str(tokenizer.chat_template).encode())
    # The rules that turn rows into tokens and masks are part of the result: a cache written
    # under other rules must not be reused.
    for module in (chat_messages, chat_tokenize):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:24]


def load_or_tokenize(files: list[str], tokenizer, opts: TokenizeOptions, cache_dir: str | Path,
                     progress: bool = False) -> dict:
    """Tokenized data of `files`, from the cache when present; written atomically. `progress`:
    a progress bar while tokenizing (on a terminal)."""
    files = [Path(f) for f in files]
    for path in files:
        if not path.is_file():
            raise DataError(f"data file {path} does not exist")
    if opts.chat_template is None and tokenizer.chat_template is None:
        raise DataError(f"the tokenizer of {tokenizer.name_or_path} has no chat template: name one with "
                        "data.chat_template=<Jinja text or .jinja file>")
    cache_path = Path(cache_dir) / f"{cache_key(files, tokenizer, opts)}.pt"
    if cache_path.is_file():
        return load_plain_data(cache_path)
    try:  # before tokenizing, which can take long
        cache_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"data.cache_dir={cache_dir}: cannot write the tokenized data there ({err.strerror}); "
                        "choose another data.cache_dir") from None
    data = tokenize_files(files, tokenizer, opts, progress)
    fd, tmp = tempfile.mkstemp(prefix=cache_path.name + ".", dir=cache_path.parent)
    os.fchmod(fd, umask_mode())  # mkstemp's 0600 would ignore the user's umask
    os.close(fd)
    torch.save(data, tmp)
    os.replace(tmp, cache_path)
    return data


class SFTDataset(torch.utils.data.Dataset):
    """Indexable view of tokenized data: item i is {input_ids, loss_mask} (1-D tensors)."""

    def __init__(self, data: dict):
        self.input_ids = data["input_ids"]
        self.loss_mask = data["loss_mask"]
        self.offsets = data["offsets"]
        self.skipped_rows = data["skipped_rows"]

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def seqlen(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def __getitem__(self, i: int) -> dict:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return {
            "input_ids": self.input_ids[start:end].long(),
            "loss_mask": self.loss_mask[start:end],
            "index": i,
        }
