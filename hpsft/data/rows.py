"""Rows of the data files: parquet, JSONL or JSON-array files read row by row, and the
options of the data section that turn them into sequences. A row's layout (OpenAI messages,
ShareGPT, Alpaca, prompt/response, prompt/completion) and its column keys: hpsft/data/layouts.py.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from hpsft.utils.errors import UserInputError


class DataError(UserInputError):
    """Bad input data: the message names the file and the row."""


@dataclass(frozen=True)
class TokenizeOptions:
    messages_key: str | None  # None: the row layout's own column (hpsft/data/layouts.py)
    prompt_key: str | None
    response_key: str | None
    tools_key: str
    chat_template: str | None
    max_length: int
    truncation: str  # error | left | right | turns | split
    bad_rows: str  # error | skip
    multiturn: str = "auto"  # auto | whole | per_turn
    layout: str = "auto"  # auto | messages | sharegpt | alpaca | prompt_response | prompt_completion
    role_key: str | None = None
    content_key: str | None = None
    query_key: str | None = None
    system_key: str | None = None
    history_key: str | None = None

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
