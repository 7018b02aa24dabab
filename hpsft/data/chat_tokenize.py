"""Render a conversation with a chat template and mark the assistant tokens.

The loss mask covers every assistant turn as the template writes it (its content, its tool
calls, its end-of-turn token), never the generation prompt (`<|im_start|>assistant\\n` in
ChatML), never the separator the template writes after the end-of-turn token (the model
stops generating at end-of-turn), never system, user or tool messages.

Span boundaries come from rendering prefixes of the conversation: the text of
`messages[:i]` with the generation prompt ends where assistant turn i begins, and the text
of `messages[:i+1]` ends where it ends (for a template that writes each message on its own in
one loop, these renderings are cut from one rendering of the whole: hpsft/data/sliced_prefixes.py).
This needs a template whose renderings of prefixes are prefixes of each other; a template that rewrites earlier turns (e.g. strips past
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

from dataclasses import dataclass
from typing import Callable

import jinja2
from jinja2.sandbox import SecurityError
from transformers.utils.chat_template_utils import render_jinja_template

from hpsft.data.chat_messages import BadRow, is_supervised, normalize_messages, normalize_tools
from hpsft.data.sliced_prefixes import prefix_slicer
from hpsft.utils.errors import UserInputError

# Content of the lone assistant message whose rendering locates where an opening assistant turn begins.
PROBE = "hpsft-probe-assistant-content"

PREFIX_MISMATCH = ("the chat template does not render conversation prefixes as prefixes of the full conversation, so "
                   "assistant spans cannot be located; give a template that does (data.chat_template)")


class HistoryRewritten(BadRow):
    """The template writes an earlier turn differently once later messages follow it (e.g. it
    strips past reasoning): the conversation is no single sequence whose turns can be located.
    Raised by rendering the whole conversation; row_sequences may then render each turn alone."""


class TemplateRenderer:
    """render(messages, add_generation_prompt) -> the template's text; a template error on the
    conversation is a BadRow, one that concerns the template itself stops the run.

    It renders as tokenizer.apply_chat_template(tokenize=False) does, through the function
    that one calls, with the template and the special tokens looked up once: apply_chat_template
    also copies and re-normalises the messages on every call (40 % of a render), which
    normalize_messages has done once for all of a row's prefix renderings."""

    def __init__(self, tokenizer, tools, chat_template):
        self.tools = tools
        self.template = tokenizer.get_chat_template(chat_template, tools)
        self.special_tokens = tokenizer.special_tokens_map

    def __call__(self, msgs, add_generation_prompt):
        try:
            rendered, _ = render_jinja_template(conversations=[msgs], tools=self.tools, chat_template=self.template,
                                                add_generation_prompt=add_generation_prompt, **self.special_tokens)
            return rendered[0]
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

    def prefixes(self, messages) -> Callable[[int, bool], str]:
        """rendered(n, add_generation_prompt): the text of messages[:n]. Cut from one rendering of
        the whole when the template's shape proves that exact (hpsft/data/sliced_prefixes.py),
        else each rendering made once (the turn spans and the turn boundaries of row_sequences
        share them)."""
        exact = prefix_renderer(self, messages)
        sliced = prefix_slicer(self.template, self.tools, self.special_tokens, messages)
        if sliced is None:
            return exact
        return lambda n, add_generation_prompt: (sliced(n, add_generation_prompt) if 1 <= n <= len(messages)
                                                 else exact(n, add_generation_prompt))


def prefix_renderer(render, messages) -> Callable[[int, bool], str]:
    """rendered(n, add_generation_prompt): the text of messages[:n], each rendering made once."""
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


def render_conversation(render, messages: list[dict], eos_token: str | None, tools=None) -> RenderedConversation:
    """The rendering of normalised `messages` and the spans of their supervised assistant turns."""
    rendered = render.prefixes(messages)
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
    for tool in tools or ():
        if tool["function"]["name"] not in full:
            raise BadRow(f"the chat template does not write the row's tools (no {tool['function']['name']!r} in "
                         "its text); give a template that renders tools (data.chat_template)")
    return RenderedConversation(messages, full, spans, closing, rendered)


@dataclass
class EncodedConversation:
    """A rendered conversation as tokens: ids, 0/1 loss mask, and the tokenizer's encoding of
    the text (which token holds which character)."""

    rendered: RenderedConversation
    input_ids: list[int]
    loss_mask: list[int]
    encoding: object  # tokenizers.Encoding

    def tokens_before(self, char_pos: int) -> int:
        """The number of tokens that start before character `char_pos` of the text."""
        n_chars, encoding = len(self.rendered.text), self.encoding
        token = None
        while char_pos < n_chars and (token := encoding.char_to_token(char_pos)) is None:
            char_pos += 1  # a character no token holds (a normaliser dropped it): no token starts there
        if char_pos >= n_chars:
            return len(self.input_ids)
        # The first token holding the character may start before it (a token merging the last
        # characters before it), and so may the next ones (bytes of one character split over tokens).
        while token < len(self.input_ids) and encoding.token_to_chars(token)[0] < char_pos:
            token += 1
        return token


def masked(rendered: RenderedConversation, input_ids: list[int], encoding) -> EncodedConversation:
    """The loss mask of rendered.text's tokens: a token is supervised when it starts inside a
    span. A token that starts before a turn (content that opens with whitespace merging with
    the generation prompt's newline) stays unsupervised: the prompt is tokenized on its own at
    inference, so the model never emits that token there. One that runs past the end would
    teach the model to emit the start of the next turn: no mask is right, so the row is refused."""
    encoded = EncodedConversation(rendered, input_ids, [0] * len(input_ids), encoding)
    for start, end in rendered.spans:
        first, last = encoded.tokens_before(start), encoded.tokens_before(end)
        if last and encoding.token_to_chars(last - 1)[1] > end:
            token_start, token_end = encoding.token_to_chars(last - 1)
            raise BadRow(
                f"token {rendered.text[token_start:token_end]!r} runs past the end of an assistant turn: the tokenizer "
                "does not split at the chat template's end-of-turn marker (does its vocabulary have the template's "
                "special tokens?)"
            )
        encoded.loss_mask[first:last] = [1] * (last - first)
    return encoded


def encode_rendered(tokenizer, rendered: list[RenderedConversation]) -> list[EncodedConversation | BadRow]:
    """The rendered conversations tokenized in one call of the tokenizer (one call costs less
    than one a text) and masked; a conversation no mask fits is its BadRow."""
    if not rendered:
        return []
    batch = tokenizer([r.text for r in rendered], add_special_tokens=False)
    out = []
    for r, input_ids, encoding in zip(rendered, batch["input_ids"], batch.encodings):
        try:
            out.append(masked(r, input_ids, encoding))
        except BadRow as err:
            out.append(err)
    return out


def encode_conversation(tokenizer, render, messages: list[dict], tools=None) -> EncodedConversation:
    """Normalised `messages` rendered by `render` (a TemplateRenderer), tokenized and masked."""
    [encoded] = encode_rendered(tokenizer, [render_conversation(render, messages, tokenizer.eos_token, tools)])
    if isinstance(encoded, BadRow):
        raise encoded
    return encoded


def tokenize_conversation(tokenizer, messages, tools=None, chat_template=None) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss mask (1 on supervised assistant tokens) of one conversation."""
    tools = normalize_tools(tools)
    encoded = encode_conversation(tokenizer, TemplateRenderer(tokenizer, tools, chat_template),
                                  normalize_messages(messages), tools)
    return encoded.input_ids, encoded.loss_mask
