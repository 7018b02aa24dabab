"""Render a conversation with a chat template and mark the assistant tokens.

The loss mask covers every assistant turn as the template writes it (its content, its tool
calls, its end-of-turn token), never the generation prompt (`<|im_start|>assistant\\n` in
ChatML), never the separator the template writes after the end-of-turn token (the model
stops generating at end-of-turn), never system, user or tool messages.

Span boundaries come from rendering prefixes of the conversation: the text of
`messages[:i]` with the generation prompt ends where assistant turn i begins, and the text
of `messages[:i+1]` ends where it ends. This needs a template whose renderings of prefixes
are prefixes of each other; a template that rewrites earlier turns (e.g. strips past
reasoning) raises HistoryRewritten rather than mis-masking: row_sequences then trains one
sequence per assistant turn (data.multiturn). Only supervised turns are located: an
assistant turn with weight 0 is context. Two cases need more:
- an assistant turn that opens the conversation has no prefix to render: it begins where
  the template writes the content of a lone assistant message, so a system prompt the
  template injects and the assistant header stay out of the loss;
- some templates (Phi-3) end a rendering without generation prompt with the eos token;
  that closing belongs to no turn and is cut off prefix renderings before comparing. It is
  found on the conversation before the last supervised turn (the rendering the generation
  prompt of that turn extends), not on the whole one: a template may write its last turn
  differently when a generation prompt follows it (GPT-OSS-like ones drop its reasoning).
A template that raises on a conversation (e.g. "roles must alternate"), a tool call or
tool list the template does not write, and a token that runs past the end of a turn (the
tokenizer does not split at the template's end-of-turn marker) make the row a BadRow.
Templates render in transformers' sandboxed Jinja environment: one that reaches for Python
internals (`().__class__`, `cycler.__init__.__globals__`) stops the run, whatever the row.
"""

import bisect
from dataclasses import dataclass
from typing import Callable

import jinja2
from jinja2.sandbox import SecurityError

from hpsft.data.chat_messages import BadRow, is_supervised, normalize_messages, normalize_tools
from hpsft.errors import UserInputError

# Content of the lone assistant message whose rendering locates where an opening assistant turn begins.
PROBE = "hpsft-probe-assistant-content"

PREFIX_MISMATCH = ("the chat template does not render conversation prefixes as prefixes of the full conversation, so "
                   "assistant spans cannot be located; give a template that does (data.chat_template)")


class HistoryRewritten(BadRow):
    """The template writes an earlier turn differently once later messages follow it (e.g. it
    strips past reasoning): the conversation is no single sequence whose turns can be located.
    Raised by rendering the whole conversation; row_sequences may then render each turn alone."""


def template_renderer(tokenizer, tools, chat_template) -> Callable[[list[dict], bool], str]:
    """render(messages, add_generation_prompt) -> the template's text; a template error on the
    conversation is a BadRow, one that concerns the template itself stops the run."""
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
    return render


def prefix_renderer(render, messages) -> Callable[[int, bool], str]:
    """rendered(n, add_generation_prompt): the text of messages[:n], each rendering made once
    (the turn spans and the turn boundaries of row_sequences share them)."""
    cache = {}

    def rendered(n: int, add_generation_prompt: bool) -> str:
        key = (n, add_generation_prompt)
        if key not in cache:
            cache[key] = render(messages[:n], add_generation_prompt)
        return cache[key]
    return rendered


def closing_text(rendered, n: int, eos_token: str | None) -> str:
    """What the template writes after messages[:n] when no generation prompt follows."""
    without, with_prompt = rendered(n, False), rendered(n, True)
    if with_prompt.startswith(without):
        return ""
    if eos_token and without.endswith(eos_token) and with_prompt.startswith(without[: -len(eos_token)]):
        return eos_token
    raise BadRow(
        "the chat template's rendering with the generation prompt does not extend its rendering "
        "without it (beyond a closing eos token), so assistant spans cannot be located; give a "
        "template whose generation prompt only appends (data.chat_template)"
    )


def turn_start(render, rendered, i: int) -> str:
    """The text before assistant turn i: everything up to its first own character."""
    if i > 0:
        return rendered(i, True)
    probe = render([{"role": "assistant", "content": PROBE}], False)
    if PROBE not in probe:
        raise BadRow("the chat template does not write the content of an assistant message that "
                     "opens the conversation")
    return probe[: probe.index(PROBE)]


@dataclass
class RenderedConversation:
    """A conversation as the template writes it: its text, the [start, end) character spans of
    its supervised turns, the closing after its last message, and its prefixes' renderings."""

    messages: list[dict]
    text: str
    spans: list[tuple[int, int]]
    closing: str
    rendered: Callable[[int, bool], str]


def render_conversation(render, messages: list[dict], eos_token: str | None) -> RenderedConversation:
    """The rendering of normalised `messages` and the spans of their supervised assistant turns."""
    rendered = prefix_renderer(render, messages)
    full = rendered(len(messages), False)
    last = max(i for i, msg in enumerate(messages) if is_supervised(msg))
    closing = closing_text(rendered, last or len(messages), eos_token)
    spans = []
    for i, msg in enumerate(messages):
        if not is_supervised(msg):
            continue
        before = turn_start(render, rendered, i)
        through = rendered(i + 1, False)
        if not (through.endswith(closing) and full.startswith(through[: len(through) - len(closing)])):
            raise HistoryRewritten(PREFIX_MISMATCH)
        through = through[: len(through) - len(closing)]
        if not through.startswith(before):
            raise BadRow(PREFIX_MISMATCH)
        turn = through[len(before):].rstrip()
        for call in msg.get("tool_calls", ()):
            # A template without tool support renders the turn without its calls: training on that
            # would teach the model to answer a tool call with an empty turn.
            if call["function"]["name"] not in turn:
                raise BadRow(f"the chat template does not write the tool call {call['function']['name']!r} of "
                             f"message {i}; give a template that renders tool_calls (data.chat_template)")
        spans.append((len(before), len(before) + len(turn)))
    return RenderedConversation(messages, full, spans, closing, rendered)


@dataclass
class EncodedConversation:
    """A rendered conversation as tokens: ids, 0/1 loss mask, and where each token starts in
    the text (to find the token at a character position)."""

    rendered: RenderedConversation
    input_ids: list[int]
    loss_mask: list[int]
    token_starts: list[int]

    def tokens_before(self, char_pos: int) -> int:
        """The number of tokens that start before character `char_pos` of the text."""
        return bisect.bisect_left(self.token_starts, char_pos)


def masked_tokens(rendered: RenderedConversation, input_ids: list[int], offsets) -> EncodedConversation:
    """The tokenizer's ids and offsets of rendered.text, with the loss mask of its spans."""
    text, spans = rendered.text, rendered.spans
    loss_mask = [0] * len(input_ids)
    span_idx = 0
    for t, (start, end) in enumerate(offsets):
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
    return EncodedConversation(rendered, input_ids, loss_mask, [start for start, _ in offsets])


def encode_conversation(tokenizer, render, messages: list[dict], tools=None) -> EncodedConversation:
    """Normalised `messages` rendered by `render` (template_renderer), tokenized and masked."""
    rendered = render_conversation(render, messages, tokenizer.eos_token)
    for tool in tools or ():
        if tool["function"]["name"] not in rendered.text:
            raise BadRow(f"the chat template does not write the row's tools (no {tool['function']['name']!r} in "
                         "its text); give a template that renders tools (data.chat_template)")
    encoded = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    return masked_tokens(rendered, encoded["input_ids"], encoded["offset_mapping"])


def tokenize_conversation(tokenizer, messages, tools=None, chat_template=None) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss mask (1 on supervised assistant tokens) of one conversation."""
    tools = normalize_tools(tools)
    encoded = encode_conversation(tokenizer, template_renderer(tokenizer, tools, chat_template),
                                  normalize_messages(messages), tools)
    return encoded.input_ids, encoded.loss_mask
