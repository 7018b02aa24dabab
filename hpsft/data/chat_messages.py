"""The chat row format: OpenAI-style messages and tool schemas, checked and normalised into
what chat templates expect.

- `role`: system, user, assistant or tool.
- `content`: a string, or OpenAI content parts (`[{"type": "text", "text": ...}, ...]`, joined
  into one string). An image part needs a vision-language model (hpsft/data/image_rows.py makes
  each an IMAGE_MARK before these checks); for a text model it is refused, as is a row's
  `images` column. An assistant message that makes tool calls may have none.
- `tool_calls` (assistant only): a list of `{"type": "function", "function": {"name",
  "arguments"}, "id"?}`; `arguments` is a JSON object or a string holding one. Templates
  write it with `| tojson`, which would print a string as a quoted JSON string, so it is
  always passed on as an object. An empty list means no calls.
- `tool_call_id`, `name`: strings.
- `weight` (assistant only, OpenAI's fine-tuning format): 1 (the default) trains the turn,
  0 makes it context only. A conversation cut into sequences (data.truncation=split, per-turn
  sequences) is a conversation whose history turns have weight 0.
- Keys whose value is None are dropped (OpenAI exports write `"tool_calls": null`; parquet
  gives every message every key of its column), so a template's `is defined` tests see
  only what the message has. Other keys reach the template unchanged.
- A row's `tools`: a list of `{"type": "function", "function": {"name", ...}}`, or a JSON
  string holding one.
"""

import json

ROLES = ("system", "user", "assistant", "tool")
IMAGE_MARK = "<image>"  # an image's place in a message's text (image_rows.py expands it into image tokens)
IMAGES_COLUMN = "images"  # ShareGPT/LLaVA rows: the image paths their IMAGE_MARKs stand for
NO_VISION_TOWER = ("but model.path is a text model (its config has no vision_config): give a vision-language "
                   "model, or remove the row's images")


class BadRow(ValueError):
    """A row that cannot be turned into a training example; the message says why."""


def normalize_messages(messages) -> list[dict]:
    """Checked copies of the messages, ready for a chat template."""
    if not isinstance(messages, (list, tuple)):
        raise BadRow(f"messages must be a list of {{role, content}}, got {type(messages).__name__}")
    if not messages:
        raise BadRow("empty conversation")
    normalized = [normalize_message(i, msg) for i, msg in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in normalized):
        raise BadRow("conversation has no assistant turn: nothing to learn")
    if not any(map(is_supervised, normalized)):
        raise BadRow("every assistant turn has weight 0: nothing to learn")
    return normalized


def is_supervised(message: dict) -> bool:
    """An assistant turn the loss covers (weight 1, the default)."""
    return message["role"] == "assistant" and message.get("weight", 1) == 1


def normalize_message(i: int, msg) -> dict:
    if not isinstance(msg, dict):
        raise BadRow(f"message {i} must have 'role' and 'content', got {msg!r:.80}")
    msg = {key: value for key, value in msg.items() if value is not None}
    if msg.get("tool_calls") == []:
        del msg["tool_calls"]
    role = msg.get("role")
    if "tool_calls" in msg:
        if role != "assistant":
            raise BadRow(f"message {i} has tool_calls but role {role!r}: only assistant messages call tools")
        if not isinstance(msg["tool_calls"], (list, tuple)):
            raise BadRow(f"message {i} tool_calls must be a list, got {type(msg['tool_calls']).__name__}")
        msg["tool_calls"] = [normalize_tool_call(f"message {i} tool call {j}", call)
                             for j, call in enumerate(msg["tool_calls"])]
    elif "role" not in msg or "content" not in msg:
        raise BadRow(f"message {i} must have 'role' and 'content', got {msg!r:.80}")
    if role not in ROLES:
        raise BadRow(f"message {i} has unknown role {role!r} (allowed: {list(ROLES)})")
    if isinstance(msg.get("content"), (list, tuple)):
        text, image_parts = flatten_parts(i, msg["content"])
        if image_parts:
            raise BadRow(f"message {i} part {image_parts[0][0]} is an image, {NO_VISION_TOWER}")
        msg["content"] = text
    if "content" in msg and not isinstance(msg["content"], str):
        raise BadRow(f"message {i} content must be a string, got {type(msg['content']).__name__}")
    for key in ("tool_call_id", "name"):
        if key in msg and not isinstance(msg[key], str):
            raise BadRow(f"message {i} {key} must be a string, got {type(msg[key]).__name__}")
    if "weight" in msg:
        if role != "assistant":
            raise BadRow(f"message {i} has a weight but role {role!r}: only assistant turns are trained")
        if msg["weight"] not in (0, 1):
            raise BadRow(f"message {i} weight must be 0 (context only) or 1 (trained), got {msg['weight']!r}")
    return msg


def flatten_parts(i: int, parts) -> tuple[str, list[tuple[int, dict]]]:
    """Message i's content parts as one text, an IMAGE_MARK where each image part is, and those
    image parts with their index."""
    text, image_parts = [], []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("image", "image_url"):
            image_parts.append((j, part))
            text.append(IMAGE_MARK)
        else:
            raise BadRow(f"message {i} part {j} must be {{'type': 'text', 'text'}} or {{'type': 'image', "
                         f"'image': path}}, got {part!r:.80}")
    return "".join(text), image_parts


def normalize_tool_call(where: str, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise BadRow(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}, got {call!r:.80}")
    if call.get("type", "function") != "function":
        raise BadRow(f"{where} has type {call['type']!r}: only 'function' calls are supported")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise BadRow(f"{where} has no function name")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise BadRow(f"{where} ({name}) arguments are not valid JSON ({err.msg})") from None
    if not isinstance(arguments, dict):
        raise BadRow(f"{where} ({name}) arguments must be a JSON object (or a string holding one), "
                     f"got {type(arguments).__name__}")
    normalized = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        normalized["id"] = call["id"]
    return normalized


def normalize_tools(tools) -> list[dict] | None:
    """The row's tool schemas as a list (None when it has none)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise BadRow(f"tools are not valid JSON ({err.msg})") from None
    if not tools:
        return None
    if not isinstance(tools, (list, tuple)) or not all(
        isinstance(tool, dict) and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str) for tool in tools
    ):
        raise BadRow(f"tools must be a list of {{'type': 'function', 'function': {{'name', 'description', "
                     f"'parameters'}}}}, got {tools!r:.80}")
    return list(tools)
