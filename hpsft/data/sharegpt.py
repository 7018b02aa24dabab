"""ShareGPT conversations: turns `{"from": "human"|"gpt"|..., "value": text}` -> OpenAI-style
messages `{"role", "content"}`. Common in published chat data (ShareGPT itself, many
LLaMA-Factory and axolotl datasets)."""

from hpsft.data.chat_messages import BadRow

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
         "system": "system", "tool": "tool", "observation": "tool"}


def is_sharegpt(turns) -> bool:
    """Turns written the ShareGPT way (`from`/`value`, no `role`)."""
    return (isinstance(turns, (list, tuple)) and bool(turns)
            and all(isinstance(t, dict) and "from" in t and "value" in t and "role" not in t for t in turns))


def sharegpt_messages(turns) -> list[dict]:
    """The turns as messages; a speaker with no chat role (e.g. `bing`) makes it a BadRow."""
    messages = []
    for i, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in ROLES:
            raise BadRow(f"ShareGPT turn {i} is from {speaker!r}, which has no chat role (known: {sorted(ROLES)})")
        messages.append({"role": ROLES[speaker], "content": turn.get("value")})
    return messages
