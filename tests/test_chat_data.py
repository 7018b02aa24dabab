"""Chat-template tokenization, assistant-only loss masks, truncation, bad rows, caching."""

import json

import pytest
import torch

from hpsft.data.chat_tokenize import tokenize_conversation
from hpsft.data.preparation import prepared_store
from hpsft.data.rows import DataError, TokenizeOptions
from hpsft.utils.errors import UserInputError
from tests.conftest import write_jsonl, write_parquet

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke, with a line break."},
    {"role": "assistant", "content": "Why did the chicken cross the road?\nTo get to the other side. 🐔"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]


def options(**kw):
    base = dict(messages_key="messages", prompt_key="prompt", response_key="response", tools_key="tools",
                chat_template=None, max_length=512, truncation="error", bad_rows="error")
    base.update(kw)
    return TokenizeOptions(**base)


def spans(mask):
    """Contiguous runs of 1s as (start, end)."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_loss_mask_is_exactly_the_assistant_turns(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION)
    # The tokens are the template's rendering, unchanged.
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(ids) == rendered
    # One masked span per assistant turn: its content and its end-of-turn token, nothing else.
    assistant = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    runs = spans(mask)
    assert [tokenizer.decode(ids[a:b]) for a, b in runs] == [c + "<|im_end|>" for c in assistant]
    # Each span is preceded by the generation prompt, which is never trained on.
    prompt_ids = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for a, _ in runs:
        assert ids[a - len(prompt_ids):a] == prompt_ids
        assert not any(mask[a - len(prompt_ids):a])
    # Token by token: unmasked text is exactly the rendering minus the assistant spans.
    unmasked = "".join(tokenizer.decode([t]) for t, m in zip(ids, mask) if not m)
    expected = rendered
    for c in assistant:
        expected = expected.replace(c + "<|im_end|>", "", 1)
    assert unmasked == expected


def test_default_system_prompt_and_single_turn(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])
    assert "You are a helpful AI assistant" in tokenizer.decode(ids)  # SmolLM2's template inserts it
    assert [tokenizer.decode(ids[a:b]) for a, b in spans(mask)] == ["4<|im_end|>"]


def test_parquet_and_jsonl_prompt_response(tmp_path, tokenizer):
    rows = [{"prompt": "What is 2+2?", "response": "4."}, {"prompt": "Capital of France?", "response": "Paris."}]
    for path in (write_jsonl(rows, tmp_path / "d.jsonl"), write_parquet(rows, tmp_path / "d.parquet")):
        ds = prepared_store(path, tokenizer, options(), tmp_path / "cache")
        assert len(ds) == 2
        item = ds[1]
        assert tokenizer.decode(item["input_ids"][item["loss_mask"]]) == "Paris.<|im_end|>"


def test_truncation_policies(tmp_path, tokenizer):
    long = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok " * 50}]}
    path = write_jsonl([long], tmp_path / "long.jsonl")
    with pytest.raises(DataError, match=r"long\.jsonl row 0: sequence has \d+ tokens > data.max_length=64"):
        prepared_store(path, tokenizer, options(max_length=64), tmp_path / "c")
    full = prepared_store(path, tokenizer, options(max_length=4096), tmp_path / "c")[0]
    right = prepared_store(path, tokenizer, options(max_length=64, truncation="right"), tmp_path / "c")[0]
    left = prepared_store(path, tokenizer, options(max_length=64, truncation="left"), tmp_path / "c")[0]
    assert torch.equal(right["input_ids"], full["input_ids"][:64])
    assert torch.equal(left["input_ids"], full["input_ids"][-64:])
    assert torch.equal(left["loss_mask"], full["loss_mask"][-64:])


QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = [{"role": "assistant", "content": "Sunny."}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@pytest.mark.parametrize(
    "row, message",
    [
        ({"text": "hi"}, "row matches no known layout (keys: ['text'])"),
        ({"messages": []}, "empty conversation"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
        ({"messages": [{"role": "user"}]}, "must have 'role' and 'content'"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}, *ANSWER]},
         "message 0 has tool_calls but role 'user'"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": {"function": CALL["function"]}}]},
         "message 1 tool_calls must be a list"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{}"}]}]},
         "message 1 tool call 0 must be {'type': 'function', 'function': {'name', 'arguments'}}"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [dict(CALL, type="code")]}]},
         "message 1 tool call 0 has type 'code': only 'function' calls are supported"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{city"}}]}]},
         "message 1 tool call 0 (f) arguments are not valid JSON"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
         "message 1 tool call 0 (f) arguments must be a JSON object (or a string holding one), got list"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
         "message 1 tool call 0 has no function name"),
        ({"messages": [*QUESTION, {"role": "tool", "tool_call_id": 7, "content": "{}"}, *ANSWER]},
         "message 1 tool_call_id must be a string, got int"),
        ({"messages": [*QUESTION, *ANSWER], "tools": "[{broken"}, "tools are not valid JSON"),
        ({"messages": [dict(QUESTION[0], weight=1), *ANSWER]}, "message 0 has a weight but role 'user'"),
        ({"messages": [*QUESTION, dict(ANSWER[0], weight=0.5)]},
         "message 1 weight must be 0 (context only) or 1 (trained), got 0.5"),
        ({"messages": [*QUESTION, dict(ANSWER[0], weight=0)]}, "every assistant turn has weight 0: nothing to learn"),
        ({"messages": [*QUESTION, *ANSWER], "tools": [{"name": "f"}]}, "tools must be a list of {'type': 'function'"),
        # Images given to a text model (the SmolLM2 here): refused, not trained as text.
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                    {"type": "image", "image": "cat.png"}]}, *ANSWER]},
         "message 0 part 1 is an image, but model.path is a text model (its config has no vision_config)"),
        ({"conversations": [{"from": "human", "value": "<image>What is it?"}, {"from": "gpt", "value": "A cat."}],
          "images": ["cat.png"]}, "the row has an images column, but model.path is a text model"),
        ({"messages": [{"role": "user", "content": ["Hi"]}, *ANSWER]},
         "message 0 part 0 must be {'type': 'text', 'text'} or {'type': 'image', 'image': path}, got 'Hi'"),
    ],
)
def test_bad_row_names_file_and_row(tmp_path, tokenizer, row, message):
    good = {"messages": CONVERSATION}
    path = write_jsonl([good, good, row], tmp_path / "bad.jsonl")
    with pytest.raises(DataError) as err:
        prepared_store(path, tokenizer, options(), tmp_path / "c")
    assert "bad.jsonl row 2:" in str(err.value) and message in str(err.value)
    skipped = prepared_store(path, tokenizer, options(bad_rows="skip"), tmp_path / "c")
    assert skipped.skipped_rows == 1 and len(skipped) == 2


def test_text_content_parts_train_as_the_joined_string(tmp_path, tokenizer):
    """OpenAI content parts on a text model: the text parts joined are the message's content, the
    same tokens and loss mask as the row written with strings. Planted: the parts joined with a
    space -> the input_ids differed."""
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                          {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                                       {"type": "text", "text": "Paris?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]}]}
    strings = {"messages": [{"role": "system", "content": "Be brief."}, *QUESTION, *ANSWER]}
    as_parts = prepared_store(write_jsonl([parts], tmp_path / "parts.jsonl"), tokenizer, options(), tmp_path / "c")[0]
    as_strings = prepared_store(write_jsonl([strings], tmp_path / "s.jsonl"), tokenizer, options(), tmp_path / "c")[0]
    assert torch.equal(as_parts["input_ids"], as_strings["input_ids"])
    assert torch.equal(as_parts["loss_mask"], as_strings["loss_mask"]) and as_parts["loss_mask"].any()


def test_invalid_json_line(tmp_path, tokenizer):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken\.jsonl row 1: not valid JSON"):
        prepared_store(str(path), tokenizer, options(), tmp_path / "c")


def test_cache_is_reused_and_keyed_by_contents(tmp_path, tokenizer):
    path = write_jsonl([{"messages": CONVERSATION}], tmp_path / "d.jsonl")
    cache = tmp_path / "cache"

    def stores():
        return [d for d in cache.iterdir() if (d / "store.json").is_file()]

    first = prepared_store(path, tokenizer, options(), cache)
    assert len(stores()) == 1
    again = prepared_store(path, tokenizer, options(), cache)
    assert torch.equal(first[0]["input_ids"], again[0]["input_ids"]) and len(stores()) == 1
    write_jsonl([{"messages": CONVERSATION[:3]}], tmp_path / "d.jsonl")  # new contents, new entry
    changed = prepared_store(path, tokenizer, options(), cache)
    assert len(stores()) == 2 and changed[0]["input_ids"].numel() < first[0]["input_ids"].numel()


def test_token_merging_generation_prompt_and_content_stays_unsupervised(tokenizer):
    # "assistant\n" + "\n\nHello": the tokenizer merges the prompt's newline with the content's
    # first one; the prompt is tokenized alone at inference, so that token is never a target.
    ids, mask = tokenize_conversation(tokenizer, [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "\n\nHello"}])
    assert [tokenizer.decode(ids[a:b]) for a, b in spans(mask)] == ["\nHello<|im_end|>"]
    assert tokenizer.decode(ids[spans(mask)[0][0] - 1]) == "\n\n"


def test_chat_template_that_does_not_compile(tokenizer):
    with pytest.raises(UserInputError, match="the chat template does not compile: .*line 1"):
        tokenize_conversation(tokenizer, CONVERSATION, chat_template="{% for m in messages %}{{ m.content }}")
