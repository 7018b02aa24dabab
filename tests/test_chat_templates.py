"""Chat templates beyond ChatML, tool calls and unusual turn orders, on the packaged tokenizer.

The templates in tests/data/chat_templates render like Llama 3.1, Mistral [INST], Gemma,
Phi-3 and Qwen2.5. Each is applied to the packaged SmolLM2 tokenizer given that model's
bos/eos and turn-marker special tokens (as the model's own tokenizer has them), and the
supervised tokens, decoded, must be exactly the assistant turns as written out below.
"""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hpsft.data.chat_messages import BadRow
from hpsft.data.chat_tokenize import tokenize_conversation
from hpsft.data.preparation import prepared_store
from hpsft.data.rows import DataError
from tests.conftest import write_jsonl, write_parquet
from tests.test_chat_data import options, spans

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

# Each model's special tokens: bos/eos and the turn markers its vocabulary holds as single tokens.
SPECIAL_TOKENS = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
               "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    "gemma": {"bos_token": "<bos>", "eos_token": "<eos>",
              "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]},
    "phi3": {"bos_token": "<s>", "eos_token": "<|endoftext|>",
             "additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]},
    "qwen2.5": {"eos_token": "<|im_end|>", "additional_special_tokens": ["<tool_call>", "</tool_call>"]},
}

MULTI_TURN = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? Two lines, please."},
    {"role": "assistant", "content": "Rome.\nIt has been the capital since 1871."},
]

# What each template writes at the end of an assistant turn (Mistral: its eos token).
END_OF_TURN = {"llama3": "<|eot_id|>", "mistral": "</s>", "gemma": "<end_of_turn>", "phi3": "<|end|>",
               "qwen2.5": "<|im_end|>"}

WEATHER_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]

TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temperature\": 18, \"sky\": \"sunny\"}"},
    {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."},
]


@pytest.fixture(scope="module")
def model_tokenizers(model_path):
    """name -> (the packaged tokenizer with that model's special tokens, the template text)."""
    out = {}
    for name, special in SPECIAL_TOKENS.items():
        tok = AutoTokenizer.from_pretrained(model_path)
        tok.add_special_tokens(special)
        out[name] = (tok, (TEMPLATES / f"{name}.jinja").read_text())
    return out


def supervised_turns(tokenizer, messages, **kw):
    """The decoded text of each run of supervised tokens."""
    ids, mask = tokenize_conversation(tokenizer, messages, **kw)
    return [tokenizer.decode(ids[a:b]) for a, b in spans(mask)]


@pytest.mark.parametrize("name", sorted(SPECIAL_TOKENS))
def test_each_template_supervises_exactly_the_assistant_turns(model_tokenizers, name):
    tok, template = model_tokenizers[name]
    ids, mask = tokenize_conversation(tok, MULTI_TURN, chat_template=template)
    assert tok.decode(ids) == tok.apply_chat_template(MULTI_TURN, chat_template=template, tokenize=False)
    eot = END_OF_TURN[name]
    assert [tok.decode(ids[a:b]) for a, b in spans(mask)] == [
        "Paris." + eot,
        "Rome.\nIt has been the capital since 1871." + eot,
    ]


def test_phi3_closing_eos_is_not_supervised(model_tokenizers):
    tok, template = model_tokenizers["phi3"]
    ids, mask = tokenize_conversation(tok, MULTI_TURN, chat_template=template)
    assert tok.decode(ids).endswith("since 1871.<|end|>\n<|endoftext|>")
    assert tok.decode(ids[-1:]) == "<|endoftext|>" and mask[-1] == 0


def test_qwen_tool_call_is_supervised_and_tool_result_is_not(model_tokenizers):
    tok, template = model_tokenizers["qwen2.5"]
    ids, mask = tokenize_conversation(tok, TOOL_CONVERSATION, tools=WEATHER_TOOLS, chat_template=template)
    assert [tok.decode(ids[a:b]) for a, b in spans(mask)] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 18 degrees and sunny in Paris.<|im_end|>",
    ]
    text = tok.decode(ids)
    # The tool schema and the tool result are in the context, unsupervised.
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city"' in text
    assert '<tool_response>\n{"temperature": 18, "sky": "sunny"}\n</tool_response>' in text


def test_llama3_tool_call_is_supervised_and_tool_result_is_not(model_tokenizers):
    tok, template = model_tokenizers["llama3"]
    turns = supervised_turns(tok, TOOL_CONVERSATION, tools=WEATHER_TOOLS, chat_template=template)
    assert turns == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "It is 18 degrees and sunny in Paris.<|eot_id|>",
    ]
    assert not any("temperature" in t or "ipython" in t for t in turns)


def with_call(arguments, tools):
    """A row of TOOL_CONVERSATION whose tool call has `arguments`, offering `tools`."""
    messages = json.loads(json.dumps(TOOL_CONVERSATION))
    messages[2]["tool_calls"][0]["function"]["arguments"] = arguments
    return {"messages": messages, "tools": tools}


def test_tool_calls_from_parquet_equal_jsonl(tmp_path, model_tokenizers):
    """Parquet stores the rows' dicts as one struct type with every key seen: `tool_calls: None`
    on user messages, another row's argument names and tool parameters as None. The rows must
    still tokenize exactly as written."""
    tok, template = model_tokenizers["qwen2.5"]
    news_tool = {"type": "function", "function": {"name": "get_news", "description": "Headlines",
                 "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}}}}
    rows = [
        with_call({"city": "Paris"}, WEATHER_TOOLS),
        with_call({"city": "Rome", "units": "C"}, WEATHER_TOOLS + [news_tool]),
        {"messages": MULTI_TURN, "tools": None},
    ]
    opts = options(chat_template=template)
    from_jsonl = prepared_store(write_jsonl(rows, tmp_path / "d.jsonl"), tok, opts, tmp_path / "c")
    from_parquet = prepared_store(write_parquet(rows, tmp_path / "d.parquet"), tok, opts, tmp_path / "c")
    assert len(from_parquet) == len(from_jsonl) == len(rows)
    for i in range(len(rows)):
        for key in ("input_ids", "loss_mask"):
            assert from_parquet[i][key].tolist() == from_jsonl[i][key].tolist()
    first = tok.decode(from_parquet[0]["input_ids"])
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in first
    assert '"properties": {"city": {"type": "string"}}, "required": ["city"]' in first


@pytest.mark.parametrize("name, system_and_header", [
    ("chatml", "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>assistant\n"),
    ("llama3", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
               "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("qwen2.5", "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                "<|im_start|>assistant\n"),
])
def test_assistant_first_conversation_leaves_injected_system_prompt_out(tokenizer, model_tokenizers, name,
                                                                        system_and_header):
    tok, template = (tokenizer, None) if name == "chatml" else model_tokenizers[name]
    conversation = [
        {"role": "assistant", "content": "Hello! Ask me about the weather."},
        {"role": "user", "content": "Is it cold?"},
        {"role": "assistant", "content": "A little."},
    ]
    ids, mask = tokenize_conversation(tok, conversation, chat_template=template)
    runs = spans(mask)
    # The text before the first supervised token is the template's injected system turn and header.
    assert tok.decode(ids[: runs[0][0]]) == system_and_header
    eot = "<|eot_id|>" if name == "llama3" else "<|im_end|>"
    assert [tok.decode(ids[a:b]) for a, b in runs] == ["Hello! Ask me about the weather." + eot, "A little." + eot]


def test_consecutive_assistants_and_system_only_prefix(tokenizer):
    conversation = [
        {"role": "system", "content": "You greet."},
        {"role": "assistant", "content": "Hi!"},
        {"role": "assistant", "content": "Anything else?"},
        {"role": "user", "content": "One."},
        {"role": "user", "content": "Two."},
        {"role": "assistant", "content": "Noted."},
    ]
    assert supervised_turns(tokenizer, conversation) == ["Hi!<|im_end|>", "Anything else?<|im_end|>", "Noted.<|im_end|>"]


@pytest.mark.parametrize("name", ["mistral", "gemma"])
def test_template_requiring_alternation_refuses_consecutive_roles(model_tokenizers, name):
    tok, template = model_tokenizers[name]
    conversation = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                    {"role": "assistant", "content": "c"}]
    with pytest.raises(BadRow, match="the chat template refused the conversation: Conversation roles must alternate"):
        tokenize_conversation(tok, conversation, chat_template=template)


def test_raising_template_names_the_row_and_can_be_skipped(tmp_path, model_tokenizers):
    tok, template = model_tokenizers["mistral"]
    rows = [{"messages": MULTI_TURN}, {"messages": [{"role": "system", "content": "Be kind."}] + MULTI_TURN},
            {"messages": MULTI_TURN}]
    path = write_jsonl(rows, tmp_path / "chats.jsonl")
    with pytest.raises(DataError) as err:
        prepared_store(path, tok, options(chat_template=template), tmp_path / "c")
    assert str(err.value) == (
        f"{path} row 1: the chat template refused the conversation: Conversation roles must alternate "
        "user/assistant/user/assistant/... (set data.bad_rows=skip to skip such rows)"
    )
    data = prepared_store(path, tok, options(chat_template=template, bad_rows="skip"), tmp_path / "c")
    assert data.skipped_rows == 1 and len(data) == 2


def test_template_expecting_string_arguments_is_refused(tokenizer):
    template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + (m.content or '') }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name + ' ' + c.function.arguments }}{% endfor %}"
                "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(BadRow, match=r"the chat template failed on the conversation: can only concatenate str "
                                     r"\(not \"dict\"\) to str \(tool-call arguments reach it as JSON objects\)"):
        tokenize_conversation(tokenizer, TOOL_CONVERSATION, chat_template=template)


def test_template_without_tool_support_is_refused(tokenizer):
    # SmolLM2's ChatML template writes only role and content: the call would be trained as an empty turn.
    with_content = [dict(m, content="") if m.get("tool_calls") else m for m in TOOL_CONVERSATION]
    with pytest.raises(BadRow, match="does not write the tool call 'get_weather' of message 2"):
        tokenize_conversation(tokenizer, with_content)
    with pytest.raises(BadRow, match="the chat template refused the conversation: .*has no attribute 'content'"):
        tokenize_conversation(tokenizer, TOOL_CONVERSATION)
    with pytest.raises(BadRow, match="does not write the row's tools"):
        tokenize_conversation(tokenizer, MULTI_TURN, tools=WEATHER_TOOLS)


CHATML_TURN = "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"


@pytest.mark.parametrize("template, reason", [
    # Writes only the last assistant turn, as reasoning templates drop past reasoning.
    ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}" + CHATML_TURN + "{% endif %}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
     "does not render conversation prefixes as prefixes"),
    # The generation prompt changes the text before it, not only appends.
    ("{{ 'Reply now.\n' if add_generation_prompt else '' }}{% for m in messages %}" + CHATML_TURN + "{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
     "rendering with the generation prompt does not extend its rendering without it"),
])
def test_template_that_rewrites_earlier_text_is_refused(tokenizer, template, reason):
    with pytest.raises(BadRow, match=reason):
        tokenize_conversation(tokenizer, MULTI_TURN, chat_template=template)


def test_tokens_across_turn_markers_are_refused(tokenizer, model_tokenizers):
    # Llama 3's markers are not tokens of SmolLM2's vocabulary: "><" is one token spanning the
    # end of "<|eot_id|>" and the start of the next "<|start_header_id|>", so no mask is exact.
    _, template = model_tokenizers["llama3"]
    with pytest.raises(BadRow, match="token '><' runs past the end of an assistant turn"):
        tokenize_conversation(tokenizer, MULTI_TURN, chat_template=template)


@pytest.mark.parametrize("as_file", [False, True])
def test_data_chat_template_setting_is_used(tmp_path, model_tokenizers, as_file):
    """The trainer's path: `data.chat_template` in the config (the text, or a file's path),
    rows read and cached by build_dataset."""
    from hpsft.config.schema import DataConfig
    from hpsft.trainer.sft_trainer import build_dataset

    tok, template = model_tokenizers["gemma"]
    setting = str(TEMPLATES / "gemma.jinja") if as_file else template
    path = write_jsonl([{"messages": MULTI_TURN}], tmp_path / "chats.jsonl")
    config = DataConfig(train_files=[path], val_files=[], chat_template=setting, cache_dir=str(tmp_path / "cache"))
    item = build_dataset(config.train_sources(), tok, config)[0]
    assert tok.decode(item["input_ids"]).startswith("<bos><start_of_turn>user\nWhat is the capital of France?")
    assert tok.decode(item["input_ids"][item["loss_mask"]]) == (
        "Paris.<end_of_turn>Rome.\nIt has been the capital since 1871.<end_of_turn>"
    )


def test_a_chat_template_setting_that_is_neither_text_nor_a_file_is_refused():
    from hpsft.data.rows import chat_template_text
    from hpsft.utils.errors import UserInputError

    with pytest.raises(UserInputError, match="data.chat_template='templates/missing.jinja' is neither a Jinja"):
        chat_template_text("templates/missing.jinja")
