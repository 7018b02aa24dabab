"""The files users keep their rows in: .jsonl, a .json array, .parquet, a Hugging Face
`save_to_disk` folder (a DatasetDict: its train split), and .jsonl/.json compressed by gzip
or zstd (pyarrow's codecs). Each holds the same real rows (chatterbot-corpus conversations as
OpenAI messages, Alpaca rows from its pairs) and gives, through each reader, the rows as
written: read_rows (inspect-data, samples), hpsft prepare-data (its written parquet) and the
data stage (its token store == the plain JSONL's). A damaged compressed file is named.

Planted once: open_bytes ignoring the compression (a plain open for every file): the four
compressed cases failed ("rows.jsonl.gz: not UTF-8 text (invalid start byte: b'\\x8b\\x08...')");
expand_entry without its save_to_disk branch: the datasets case failed
("rows_dataset/test/dataset_info.json row 0: not valid JSON")."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpsft.commands.prepare_data import main as prepare_data
from hpsft.data.preparation import prepared_store
from hpsft.data.rows import DataError, TokenizeOptions
from hpsft.data.shards import read_rows
from tests.conftest import columns, write_jsonl

KINDS = ["jsonl", "json", "parquet", "datasets", "jsonl.gz", "json.gz", "jsonl.zst", "json.zst"]


def options() -> TokenizeOptions:
    return TokenizeOptions(messages_key=None, prompt_key=None, response_key=None, tools_key="tools",
                           chat_template=None, max_length=1 << 20, truncation="error", bad_rows="error")


def container_rows(chat_rows) -> list[dict]:
    """30 message rows and 10 Alpaca rows (a file may mix layouts: each row's is found)."""
    alpaca = [{"instruction": c[0]["content"], "output": c[1]["content"]} for c in chat_rows[30:40]]
    return [{"messages": c} for c in chat_rows[:30]] + alpaca


def write_container(kind: str, rows: list[dict], folder):
    text = "".join(json.dumps(r) + "\n" for r in rows) if kind.startswith("jsonl") else json.dumps(rows)
    path = folder / f"rows.{kind}"
    if kind in ("jsonl", "json"):
        path.write_text(text)
    elif kind.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    elif kind.endswith(".zst"):
        with pa.OSFile(str(path), "wb") as raw, pa.CompressedOutputStream(raw, "zstd") as out:
            out.write(text.encode())
    elif kind == "parquet":
        pq.write_table(pa.table(columns(rows)), path)
    else:
        import datasets

        path = folder / "rows_dataset"
        datasets.DatasetDict(train=datasets.Dataset.from_dict(columns(rows)),
                             test=datasets.Dataset.from_dict(columns(rows[:3]))).save_to_disk(path)
    return path


def store_rows(path, tokenizer, tmp_path) -> list[tuple[list[int], list[int]]]:
    store = prepared_store(str(path), tokenizer, options(), tmp_path / "tokenized")
    return [(store[i]["input_ids"].tolist(), store[i]["loss_mask"].tolist()) for i in range(len(store))]


@pytest.mark.parametrize("kind", KINDS)
def test_each_container_gives_its_rows_to_every_reader(kind, tmp_path, chat_rows, tokenizer):
    rows = container_rows(chat_rows)
    path = write_container(kind, rows, tmp_path)
    assert list(read_rows(path)) == rows
    out = tmp_path / "out"
    assert prepare_data([str(path), "--out", str(out)]) == 0
    expected = [r["messages"] if "messages" in r else
                [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}]
                for r in rows]
    assert [r["messages"] for r in pq.read_table(out / "train.parquet").to_pylist()] == expected
    plain = write_jsonl(rows, tmp_path / "plain.jsonl")
    assert store_rows(path, tokenizer, tmp_path) == store_rows(plain, tokenizer, tmp_path)


@pytest.mark.parametrize("kind", ["jsonl.gz", "json.zst"])
def test_a_damaged_compressed_file_is_named(kind, tmp_path, chat_rows, tokenizer):
    path = write_container(kind, container_rows(chat_rows), tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match=rf"rows\.{kind}"):
        prepared_store(str(path), tokenizer, options(), tmp_path / "tokenized")
