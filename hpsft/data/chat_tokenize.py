"""Render a conversation with a chat template and mark the assistant tokens.

The loss mask covers every assistant turn: its content and its end-of-turn token, never
the generation prompt (`<|im_start|>assistant\\n` in ChatML) and never the separator the
template writes after the end-of-turn token (the model stops generating at end-of-turn).

Span boundaries come from rendering prefixes of the conversation: the text of
`messages[:i]` with the generation prompt ends where assistant turn i begins, and the text
of `messages[:i+1]` ends where it ends. This needs a template whose renderings of prefixes
are prefixes of each other; templates that rewrite earlier turns (e.g. strip past
reasoning) are refused with an error rather than mis-masked.
"""

ROLES = {"system", "user", "assistant", "tool"}


class BadRow(ValueError):
    """A row that cannot be turned into a training example; the message says why."""


def validate_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise BadRow("empty conversation" if isinstance(messages, (list, tuple)) else
                     f"messages must be a list of {{role, content}}, got {type(messages).__name__}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise BadRow(f"message {i} must have 'role' and 'content', got {msg!r:.80}")
        if msg["role"] not in ROLES:
            raise BadRow(f"message {i} has unknown role {msg['role']!r} (allowed: {sorted(ROLES)})")
        if not isinstance(msg["content"], str):
            raise BadRow(f"message {i} content must be a string, got {type(msg['content']).__name__}")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("conversation has no assistant turn: nothing to learn")


def assistant_char_spans(render, messages) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character spans of the assistant turns.

    `render(messages, add_generation_prompt)` returns the template's text.
    """
    full = render(messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        through = render(messages[: i + 1], False)
        if not (full.startswith(through) and through.startswith(before)):
            raise BadRow(
                "the chat template does not render conversation prefixes as prefixes of the "
                "full conversation, so assistant spans cannot be located; give a template "
                "that does (data.chat_template)"
            )
        end = len(before) + len(through[len(before):].rstrip())
        spans.append((len(before), end))
    return full, spans


def tokenize_conversation(tokenizer, messages, tools=None, chat_template=None) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss mask (1 on assistant tokens) of one conversation."""
    validate_messages(messages)
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]

    def render(msgs, add_generation_prompt):
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(
            msgs, tools=tools, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    text, spans = assistant_char_spans(render, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = encoded["input_ids"]
    loss_mask = [0] * len(input_ids)
    span_idx = 0
    for t, (start, _end) in enumerate(encoded["offset_mapping"]):
        while span_idx < len(spans) and start >= spans[span_idx][1]:
            span_idx += 1
        if span_idx < len(spans) and spans[span_idx][0] <= start:
            loss_mask[t] = 1
    return input_ids, loss_mask
