"""The options of the data section that turn rows into sequences, and what the readers of
data files (hpsft/data/shards.py) share. A row's layout (OpenAI messages,
ShareGPT, Alpaca, prompt/response, prompt/completion) and its column keys: hpsft/data/layouts.py.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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
    """A JSONL line that is not JSON, yielded in its row's place (shards.entry_rows)."""
    reason: str
