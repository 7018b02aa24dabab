"""A raw row -> the house's conversation (OpenAI-style messages and tools): the one place
every reader (the data stage, hpsft prepare-data, inspect-data, samples) turns a row of a
data file into messages.

The layouts users bring, each with its own default column names:

    messages           {"messages": [{"role", "content"}, ...]}                     OpenAI
    sharegpt           {"conversations": [{"from", "value"}, ...], "system"?, "tools"?}
                       roles as LLaMA-Factory writes them: human/user, gpt/assistant,
                       system, function_call (an assistant's tool calls, the value a JSON
                       object {"name", "arguments"} or a list of them), observation/tool
                       (the tool's result)
    alpaca             {"instruction", "input"?, "output", "system"?, "history"?}
                       input is appended to the instruction after a newline; history is a
                       list of [prompt, response] pairs before it
    prompt_response    {"prompt", "response"}
    prompt_completion  {"prompt", "completion"}

data.layout=auto (the default; prepare-data --layout) takes the first of these whose
columns the row has. The column keys map other names, as LLaMA-Factory's dataset_info
`columns` do: data.messages_key, data.role_key, data.content_key (the turns' keys),
data.prompt_key, data.query_key, data.response_key, data.system_key, data.history_key,
data.tools_key (prepare-data: --messages-key, --role-key, ...). A key left unset (None)
reads the layout's own column; one that is set reads that column in every layout. The turns
of a chat column are read with role/content, or from/value (ShareGPT) when they have those
and no role.
"""

import json
from dataclasses import dataclass

from hpsft.data.chat_messages import BadRow

COLUMN_KEYS = ("messages_key", "role_key", "content_key", "prompt_key", "query_key", "response_key", "system_key",
               "history_key", "tools_key")
FLAGS = {key: "--" + key.replace("_", "-") for key in COLUMN_KEYS}

# ShareGPT speakers (LLaMA-Factory's tags and ShareGPT's own) -> house roles; function_call
# becomes an assistant message with tool_calls.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "observation": "tool", "function_call": "assistant"}

# The layout prepare-data writes and the data stage reads back (train.parquet, stores).
HOUSE_LAYOUT = dict(layout="messages", messages_key="messages", tools_key="tools", role_key=None, content_key=None,
                    system_key=None)


@dataclass(frozen=True)
class Layout:
    name: str
    chat: bool  # a column of turns (else one prompt and its response, and optional history)
    columns: dict  # column key -> the column it reads when the key is not set
    required: tuple  # the column keys whose columns a row of this layout must have


LAYOUTS = (
    Layout("messages", True, {"messages_key": "messages", "tools_key": "tools"}, ("messages_key",)),
    Layout("sharegpt", True, {"messages_key": "conversations", "system_key": "system", "tools_key": "tools"},
           ("messages_key",)),
    Layout("alpaca", False, {"prompt_key": "instruction", "query_key": "input", "response_key": "output",
                             "system_key": "system", "history_key": "history", "tools_key": "tools"},
           ("prompt_key", "response_key")),
    Layout("prompt_response", False, {"prompt_key": "prompt", "response_key": "response", "tools_key": "tools"},
           ("prompt_key", "response_key")),
    Layout("prompt_completion", False, {"prompt_key": "prompt", "response_key": "completion", "tools_key": "tools"},
           ("prompt_key", "response_key")),
)
BY_NAME = {layout.name: layout for layout in LAYOUTS}
LAYOUT_NAMES = ("auto", *BY_NAME)


def column(layout: Layout, key: str, opts) -> str | None:
    """The column `key` names in rows of `layout`: the option when set, else the layout's own."""
    return getattr(opts, key, None) or layout.columns.get(key)


def has_columns(row: dict, layout: Layout, opts) -> bool:
    return all(row.get(column(layout, key, opts)) is not None for key in layout.required)


def row_layout(row: dict, opts) -> Layout:
    """The layout of the row: opts.layout, or the first whose columns the row has."""
    name = getattr(opts, "layout", "auto")
    if name != "auto":
        layout = BY_NAME[name]
        if not has_columns(row, layout, opts):
            wanted = [f"{column(layout, key, opts)!r} (data.{key}, {FLAGS[key]})" for key in layout.required]
            raise BadRow(f"row has no {' and '.join(wanted)} for data.layout={name} (keys: {sorted(row)}); name "
                         "the columns with those keys, or set data.layout (--layout) to the row's layout")
        return layout
    for layout in LAYOUTS:
        if has_columns(row, layout, opts):
            return layout
    raise BadRow(
        f"row matches no known layout (keys: {sorted(row)}): rows hold 'messages' or 'conversations' (chat turns), "
        "'instruction'/'output' (Alpaca), 'prompt'/'response' or 'prompt'/'completion'; name your columns with "
        "data.messages_key, or data.prompt_key and data.response_key (prepare-data: --messages-key, --prompt-key, "
        f"--response-key), or set data.layout (--layout: {', '.join(LAYOUT_NAMES[1:])})"
    )


def row_messages(row, opts) -> tuple[list, object]:
    """The row's messages (house roles; checked later by chat_messages.normalize_messages) and
    its tools column (None without one). A row no layout reads raises BadRow naming its keys."""
    if not isinstance(row, dict):
        raise BadRow(f"row must be an object, got {type(row).__name__}")
    layout = row_layout(row, opts)
    system = optional_column(row, layout, "system_key", opts)
    if layout.chat:
        messages = chat_messages(row[column(layout, "messages_key", opts)], opts)
    else:
        messages = single_turn_messages(row, layout, opts)
    if isinstance(system, str) and system.strip() and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system}, *messages]
    return messages, optional_column(row, layout, "tools_key", opts)


def optional_column(row: dict, layout: Layout, key: str, opts):
    name = column(layout, key, opts)
    return None if name is None else row.get(name)


def chat_messages(turns, opts) -> list:
    """A chat column's turns as messages: role/content turns as they are (or under
    opts.role_key/content_key), from/value turns through the ShareGPT roles."""
    role_key, content_key = getattr(opts, "role_key", None), getattr(opts, "content_key", None)
    if role_key is None and content_key is None and not is_sharegpt(turns):
        return turns  # OpenAI messages: normalize_messages checks them
    return turn_messages(turns, role_key or "from", content_key or "value")


def turn_messages(turns, role_key: str = "from", content_key: str = "value") -> list[dict]:
    """Turns {role_key: speaker, content_key: text} (ShareGPT's from/value) as messages; a
    speaker with no chat role (ShareGPT's `bing`) makes it a BadRow."""
    if not isinstance(turns, (list, tuple)):
        raise BadRow(f"the turns must be a list of {{{role_key!r}, {content_key!r}}}, got {type(turns).__name__}")
    return [turn_message(i, turn, role_key, content_key) for i, turn in enumerate(turns)]


def is_sharegpt(turns) -> bool:
    """Turns written the ShareGPT way (`from`/`value`, no `role`)."""
    return (isinstance(turns, (list, tuple)) and bool(turns)
            and all(isinstance(t, dict) and "from" in t and "value" in t and "role" not in t for t in turns))


def turn_message(i: int, turn, role_key: str, content_key: str) -> dict:
    if not isinstance(turn, dict) or role_key not in turn:
        raise BadRow(f"turn {i} must have {role_key!r} and {content_key!r} (data.role_key, data.content_key), got "
                     f"{turn!r:.80}")
    speaker, value = turn[role_key], turn.get(content_key)
    if speaker not in SHAREGPT_ROLES:
        raise BadRow(f"turn {i} is from {speaker!r}, which has no chat role (known: {sorted(SHAREGPT_ROLES)})")
    if speaker == "function_call":
        return {"role": "assistant", "tool_calls": function_calls(i, value)}
    return {"role": SHAREGPT_ROLES[speaker], "content": value}


def function_calls(i: int, value) -> list[dict]:
    """A function_call turn's value (JSON text of {"name", "arguments"} or a list of them) as tool calls."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as err:
        raise BadRow(f"turn {i} (function_call) is not JSON ({err.msg}): it must hold {{\"name\", \"arguments\"}} "
                     "or a list of them") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(call, dict) and "name" in call for call in calls):
        raise BadRow(f"turn {i} (function_call) must hold {{\"name\", \"arguments\"}} or a list of them, got "
                     f"{value!r:.80}")
    return [{"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
            for call in calls]


def single_turn_messages(row: dict, layout: Layout, opts) -> list[dict]:
    """[history pairs..., the prompt (and its query), the response] as user/assistant messages."""
    prompt = row[column(layout, "prompt_key", opts)]
    query = optional_column(row, layout, "query_key", opts)
    if isinstance(query, str) and query.strip() and isinstance(prompt, str):
        prompt = f"{prompt}\n{query}"
    messages = []
    history = optional_column(row, layout, "history_key", opts) or []
    if not isinstance(history, (list, tuple)) or not all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in history):
        raise BadRow(f"column {column(layout, 'history_key', opts)!r} must be a list of [prompt, response] pairs, "
                     f"got {history!r:.80}")
    for question, answer in history:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": prompt},
                       {"role": "assistant", "content": row[column(layout, "response_key", opts)]}]
