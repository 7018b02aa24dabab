"""Render a conversation with a chat template and mark the assistant tokens.

The loss mask covers every assistant turn as the template writes it (its content, its tool
calls, its end-of-turn token), never the generation prompt (`<|im_start|>assistant\\n` in
ChatML), never the separator the template writes after the end-of-turn token (the model
stops generating at end-of-turn), never system, user or tool messages.

Span boundaries come from rendering prefixes of the conversation: the text of
`messages[:i]` with the generation prompt ends where assistant turn i begins, and the text
of `messages[:i+1]` ends where it ends. This needs a template whose renderings of prefixes
are prefixes of each other; templates that rewrite earlier turns (e.g. strip past
reasoning) are refused with an error rather than mis-masked. Two cases need more:
- an assistant turn that opens the conversation has no prefix to render: it begins where
  the template writes the content of a lone assistant message, so a system prompt the
  template injects and the assistant header stay out of the loss;
- some templates (Phi-3) end a rendering without generation prompt with the eos token;
  that closing belongs to no turn and is cut off prefix renderings before comparing.
A template that raises on a conversation (e.g. "roles must alternate"), a tool call or
tool list the template does not write, and a token that runs past the end of a turn (the
tokenizer does not split at the template's end-of-turn marker) make the row a BadRow.
Templates render in transformers' sandboxed Jinja environment: one that reaches for Python
internals (`().__class__`, `cycler.__init__.__globals__`) stops the run, whatever the row.
"""

import jinja2
from jinja2.sandbox import SecurityError

from hpsft.data.chat_messages import BadRow, normalize_messages, normalize_tools
from hpsft.errors import UserInputError

# Content of the lone assistant message whose rendering locates where an opening assistant turn begins.
PROBE = "hpsft-probe-assistant-content"


def closing_text(render, messages, full: str, eos_token: str | None) -> str:
    """What the template writes after the last turn when no generation prompt follows."""
    with_prompt = render(messages, True)
    if with_prompt.startswith(full):
        return ""
    if eos_token and full.endswith(eos_token) and with_prompt.startswith(full[: -len(eos_token)]):
        return eos_token
    raise BadRow(
        "the chat template's rendering with the generation prompt does not extend its rendering "
        "without it (beyond a closing eos token), so assistant spans cannot be located; give a "
        "template whose generation prompt only appends (data.chat_template)"
    )


def turn_start(render, messages, i: int) -> str:
    """The text before assistant turn i: everything up to its first own character."""
    if i > 0:
        return render(messages[:i], True)
    probe = render([{"role": "assistant", "content": PROBE}], False)
    if PROBE not in probe:
        raise BadRow("the chat template does not write the content of an assistant message that "
                     "opens the conversation")
    return probe[: probe.index(PROBE)]


def assistant_char_spans(render, messages, eos_token: str | None) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character spans of the assistant turns.

    `render(messages, add_generation_prompt)` returns the template's text.
    """
    full = render(messages, False)
    closing = closing_text(render, messages, full, eos_token)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = turn_start(render, messages, i)
        through = render(messages[: i + 1], False)
        through = through[: len(through) - len(closing)] if through.endswith(closing) else None
        if through is None or not (full.startswith(through) and through.startswith(before)):
            raise BadRow(
                "the chat template does not render conversation prefixes as prefixes of the "
                "full conversation, so assistant spans cannot be located; give a template "
                "that does (data.chat_template)"
            )
        turn = through[len(before):].rstrip()
        for call in msg.get("tool_calls", ()):
            # A template without tool support renders the turn without its calls: training on that
            # would teach the model to answer a tool call with an empty turn.
            if call["function"]["name"] not in turn:
                raise BadRow(f"the chat template does not write the tool call {call['function']['name']!r} of "
                             f"message {i}; give a template that renders tool_calls (data.chat_template)")
        spans.append((len(before), len(before) + len(turn)))
    return full, spans


def tokenize_conversation(tokenizer, messages, tools=None, chat_template=None) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss mask (1 on assistant tokens) of one conversation."""
    messages = normalize_messages(messages)
    tools = normalize_tools(tools)

    def render(msgs, add_generation_prompt):
        try:
            return tokenizer.apply_chat_template(
                msgs, tools=tools, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateSyntaxError as err:
            raise UserInputError(f"the chat template does not compile: {err} (line {err.lineno})") from None
        except SecurityError as err:  # transformers renders in jinja2's ImmutableSandboxedEnvironment
            raise UserInputError(f"the chat template tried an operation its sandbox forbids ({err}): templates may "
                                 "not reach Python internals or change their inputs; fix or replace it "
                                 "(data.chat_template)") from None
        except jinja2.TemplateError as err:
            raise BadRow(f"the chat template refused the conversation: {err}") from None
        except TypeError as err:
            # A template that joins values of the wrong type, e.g. concatenates tool-call arguments
            # as a string: they are passed as JSON objects, as Hugging Face's templates expect.
            raise BadRow(f"the chat template failed on the conversation: {err} (tool-call arguments "
                         "reach it as JSON objects)") from None

    text, spans = assistant_char_spans(render, messages, tokenizer.eos_token)
    for tool in tools or ():
        if tool["function"]["name"] not in text:
            raise BadRow(f"the chat template does not write the row's tools (no {tool['function']['name']!r} in "
                         "its text); give a template that renders tools (data.chat_template)")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = encoded["input_ids"]
    loss_mask = [0] * len(input_ids)
    span_idx = 0
    for t, (start, end) in enumerate(encoded["offset_mapping"]):
        while span_idx < len(spans) and start >= spans[span_idx][1]:
            span_idx += 1
        if span_idx == len(spans):
            break
        span_start, span_end = spans[span_idx]
        # A token that starts before a turn (content that opens with whitespace merging with the
        # generation prompt's newline) stays unsupervised: the prompt is tokenized on its own at
        # inference, so the model never emits that token there. One that runs past the end would
        # teach the model to emit the start of the next turn: no mask is right, so refuse.
        if start < span_end < end:
            raise BadRow(
                f"token {text[start:end]!r} runs past the end of an assistant turn: the tokenizer does not "
                "split at the chat template's end-of-turn marker (does its vocabulary have the template's "
                "special tokens?)"
            )
        if span_start <= start:
            loss_mask[t] = 1
    return input_ids, loss_mask
