"""One row -> the sequences it trains.

1. Its conversation (hpsft/data/layouts.py) rendered and masked by the chat template
   (hpsft/data/chat_tokenize.py): one sequence of the whole conversation, or one per
   supervised assistant turn as the template writes it when that turn is generated
   (data.multiturn; `auto` does so when the template rewrites earlier turns).
2. Each sequence fitted to data.max_length (data.truncation): `turns` and `split` rebuild it
   from whole turns, as conversations the template renders again; `left` and `right` cut
   tokens; `error` refuses the row.

`rows_sequences` (many rows: their renderings tokenized in one tokenizer call) and
`row_sequences` (one row) are the one place rows become training sequences: the data stage
(hpsft/data/preparation.py) and hpsft inspect-data call them. hpsft prepare-data, which
writes conversations rather than tokens, calls their first half, `row_conversations`.

A turn is where a conversation may be cut: turns begin at the first message after the
leading system messages and at each user message that follows a non-user message, so a
turn is a user's message(s), the assistant's reply, and any tool calls and results between.
The leading system messages are kept in every sequence: dropping them would change the
assistant's instructions (and SmolLM2's ChatML template would write its own default system
prompt instead). History turns are context only: their assistant turns get weight 0.
"""

from collections import Counter
from dataclasses import dataclass, field

from hpsft.data.chat_messages import (IMAGES_COLUMN, NO_VISION_TOWER, BadRow, is_supervised, normalize_messages,
                                      normalize_tools)
from hpsft.data.chat_tokenize import EncodedConversation, HistoryRewritten, PREFIX_MISMATCH, RenderedConversation, \
    TemplateRenderer, encode_rendered, render_conversation
from hpsft.data.layouts import row_messages
from hpsft.data.rows import TokenizeOptions

TURN_POLICIES = ("turns", "split")  # the truncation policies that cut only between turns


@dataclass
class RowSequences:
    """What a row becomes: its sequences (input_ids, loss_mask as 0/1 lists), or none and the
    reason it was dropped (a policy that drops rather than fails: no turn fits); `counts`: the
    events the data stage sums over all rows (docs/data.md, "Counts")."""

    sequences: list[tuple[list[int], list[int]]] = field(default_factory=list)
    dropped: str | None = None
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class RowConversations:
    """A row's conversations, each rendered whole as one sequence, after data.multiturn and the
    turn policies: under error, left and right they may still be over data.max_length."""

    conversations: list[EncodedConversation]
    dropped: str | None = None
    counts: Counter = field(default_factory=Counter)


class OverMaxLength(BadRow):
    """A sequence over data.max_length under data.truncation=error."""


def row_sequences(row, tokenizer, opts: TokenizeOptions) -> RowSequences:
    """The sequences of one row; a malformed row, or one the policy refuses, raises BadRow."""
    [result] = rows_sequences([row], tokenizer, opts)
    if isinstance(result, BadRow):
        raise result
    return result


def rows_sequences(rows: list, tokenizer, opts: TokenizeOptions) -> list[RowSequences | BadRow]:
    """Each row's sequences, or the BadRow it raised (the caller names its file and row)."""
    return [fitted if isinstance(fitted, BadRow) else fitted_to_max_length(fitted, opts)
            for fitted in rows_conversations(rows, tokenizer, opts)]


def fitted_to_max_length(fitted: RowConversations, opts: TokenizeOptions) -> RowSequences | BadRow:
    """The conversations' tokens; one over data.max_length cut (left, right) or refused (error)."""
    sequences = [(c.input_ids, c.loss_mask) for c in fitted.conversations]
    if any(len(ids) > opts.max_length for ids, _ in sequences):
        if opts.truncation == "error":
            longest = max(len(ids) for ids, _ in sequences)
            return OverMaxLength(f"sequence has {longest} tokens > data.max_length={opts.max_length} (raise "
                                 "data.max_length or set data.truncation=turns|split|left|right)")
        keep = slice(-opts.max_length, None) if opts.truncation == "left" else slice(0, opts.max_length)
        supervised = sum(sum(mask) for _, mask in sequences)
        sequences = [(ids[keep], mask[keep]) for ids, mask in sequences]
        fitted.counts["cut_rows"] += 1
        fitted.counts["lost_supervised_tokens"] += supervised - sum(sum(mask) for _, mask in sequences)
    return RowSequences(sequences, fitted.dropped, dict(fitted.counts))


def row_conversations(row, tokenizer, opts: TokenizeOptions) -> RowConversations:
    """The conversations one row trains, each rendered as one sequence (see the module's doc);
    a malformed row raises BadRow."""
    [result] = rows_conversations([row], tokenizer, opts)
    if isinstance(result, BadRow):
        raise result
    return result


class Encoder:
    """Renders and tokenizes conversations of one row: its tools, the template."""

    def __init__(self, tokenizer, tools, chat_template):
        self.tokenizer, self.tools = tokenizer, tools
        self.render = TemplateRenderer(tokenizer, tools, chat_template)

    def rendered(self, conversation: list[dict]) -> RenderedConversation:
        return render_conversation(self.render, conversation, self.tokenizer.eos_token, self.tools)

    def encoded(self, rendered: list[RenderedConversation]) -> list[EncodedConversation]:
        """Tokenized in one call; the first conversation no mask fits raises its BadRow."""
        out = encode_rendered(self.tokenizer, rendered)
        for encoded in out:
            if isinstance(encoded, BadRow):
                raise encoded
        return out

    def __call__(self, conversation: list[dict]) -> EncodedConversation:
        return self.encoded([self.rendered(conversation)])[0]


def rows_conversations(rows: list, tokenizer, opts: TokenizeOptions) -> list[RowConversations | BadRow]:
    """The conversations each row trains, or the BadRow it raised. Each row is rendered whole
    first, and all those renderings are tokenized in one call; a row whose template rewrites
    its history (data.multiturn=auto) then goes per turn."""
    pending = []  # per row: (messages, encoder, its whole rendering or None) or its BadRow
    for row in rows:
        try:
            if isinstance(row, dict) and row.get(IMAGES_COLUMN):  # image rows reach here as house rows, without it
                raise BadRow(f"the row has an {IMAGES_COLUMN} column, {NO_VISION_TOWER}")
            messages, tools = row_messages(row, opts)
            messages, tools = normalize_messages(messages), normalize_tools(tools)
            encoder = Encoder(tokenizer, tools, opts.chat_template)
            pending.append((messages, encoder, whole_rendering(encoder, messages, opts)))
        except BadRow as err:
            pending.append(err)
    wholes = [p[2] for p in pending if not isinstance(p, BadRow) and p[2] is not None]
    encoded = iter(encode_rendered(tokenizer, wholes))
    out = []
    for p in pending:
        if isinstance(p, BadRow):
            out.append(p)
            continue
        messages, encoder, rendered = p
        try:
            whole = None if rendered is None else next(encoded)
            if isinstance(whole, BadRow):
                raise whole
            out.append(per_turn_conversations(encoder, messages, opts) if whole is None
                       else fitted_whole(encoder, messages, whole, opts))
        except BadRow as err:
            out.append(err)
    return out


def whole_rendering(encoder: Encoder, messages: list[dict], opts: TokenizeOptions) -> RenderedConversation | None:
    """The conversation rendered as one sequence; None when it is to be trained per turn."""
    if opts.multiturn == "per_turn":
        return None
    try:
        return encoder.rendered(messages)
    except HistoryRewritten:
        if opts.multiturn == "whole":
            raise
        return None


def fitted_whole(encoder: Encoder, messages: list[dict], whole: EncodedConversation, opts) -> RowConversations:
    """whole_conversation, or per turn when fitting it shows the template rewrites history."""
    try:
        return whole_conversation(encoder, messages, whole, opts)
    except HistoryRewritten:
        if opts.multiturn == "whole":
            raise
        return per_turn_conversations(encoder, messages, opts)


def turn_starts(messages: list[dict]) -> list[int]:
    """The index of the first message of each turn."""
    head = next(i for i, msg in enumerate(messages) if msg["role"] != "system")
    return [i for i in range(head, len(messages))
            if i == head or (messages[i]["role"] == "user" and messages[i - 1]["role"] != "user")]


def sub_conversation(messages: list[dict], starts: list[int], first: int, trained: int, last: int) -> list[dict]:
    """The leading system messages, turns first..trained-1 as context (their assistant turns
    get weight 0), then turns trained..last as they are."""
    end = starts[last + 1] if last + 1 < len(starts) else len(messages)
    history = [dict(msg, weight=0) if msg["role"] == "assistant" else msg
               for msg in messages[starts[first]:starts[trained]]]
    return messages[:starts[0]] + history + messages[starts[trained]:end]


def as_context_before(messages: list[dict], k: int) -> list[dict]:
    """messages[:k + 1], every assistant turn but the last made context (weight 0)."""
    return [dict(msg, weight=0) if msg["role"] == "assistant" and i < k else msg
            for i, msg in enumerate(messages[:k + 1])]


def turn_token_bounds(whole: EncodedConversation, starts: list[int]) -> list[int]:
    """bounds[t]: the tokens of the whole rendering before turn t; bounds[-1]: before its closing.
    A turn boundary is where the rendering of the messages before it ends, which must be a
    prefix of the whole rendering (else the template rewrites history)."""
    rendered = whole.rendered
    body = rendered.text[: len(rendered.text) - len(rendered.closing)]
    bounds = []
    for b in starts:
        if b == 0:
            bounds.append(0)
            continue
        try:
            prefix = rendered.rendered(b, False)
        except BadRow:
            # A template that refuses the leading system messages alone: count them with turn 0
            # (a sub-conversation's estimate is then short, and its rendering is measured anyway).
            bounds.append(0)
            continue
        if not (prefix.endswith(rendered.closing) and body.startswith(prefix[: len(prefix) - len(rendered.closing)])):
            raise HistoryRewritten(PREFIX_MISMATCH)
        bounds.append(whole.tokens_before(len(prefix) - len(rendered.closing)))
    return bounds + [whole.tokens_before(len(body))]


@dataclass(frozen=True)
class TurnLayout:
    """Where each turn of a conversation's whole rendering starts: in messages (starts) and in
    tokens (bounds, turn_token_bounds), and the tokens of the rendering's closing."""

    messages: list[dict]
    starts: list[int]
    bounds: list[int]
    closing_tokens: int

    @classmethod
    def of(cls, messages: list[dict], whole: EncodedConversation) -> "TurnLayout":
        starts = turn_starts(messages)
        bounds = turn_token_bounds(whole, starts)
        return cls(messages, starts, bounds, len(whole.input_ids) - bounds[-1])

    @property
    def n_turns(self) -> int:
        return len(self.starts)

    def cost(self, first: int, last: int) -> int:
        """Tokens of the leading system messages and turns first..last, as in the whole rendering."""
        return self.bounds[0] + self.bounds[last + 1] - self.bounds[first] + self.closing_tokens

    def trained(self, t: int) -> int:
        """The supervised assistant turns in turn t."""
        end = self.starts[t + 1] if t + 1 < self.n_turns else len(self.messages)
        return sum(map(is_supervised, self.messages[self.starts[t]:end]))


def fitted_window(encode, turns: TurnLayout, first: int, j: int, max_length: int,
                  history: bool) -> tuple[EncodedConversation | None, int]:
    """From turn j (supervised), as many turns as fit within max_length after turns first..j-1;
    with `history`, then as many turns before j as fit too (context only). Encoded by `encode`
    and, where the estimate from the whole rendering was short (a system prompt the template
    writes again for a conversation that opens later, tokens merging across a cut), shrunk:
    less history, then fewer turns. (the conversation or None when turn j cannot fit, its last turn)."""
    if turns.cost(first, j) > max_length:
        return None, j
    last = j
    while last + 1 < turns.n_turns and turns.cost(first, last + 1) <= max_length:
        last += 1
    while not turns.trained(last):
        last -= 1
    while history and first > 0 and turns.cost(first - 1, last) <= max_length:
        first -= 1
    conversation = encode(sub_conversation(turns.messages, turns.starts, first, j, last))
    while len(conversation.input_ids) > max_length:
        excess = len(conversation.input_ids) - max_length
        if history and first < j:
            while first < j and excess > 0:
                excess -= turns.bounds[first + 1] - turns.bounds[first]
                first += 1
        elif last > j:
            last -= 1
            while not turns.trained(last):
                last -= 1
        else:
            return None, j
        conversation = encode(sub_conversation(turns.messages, turns.starts, first, j, last))
    return conversation, last


def leading_turns(encode, turns: TurnLayout, max_length: int) -> tuple[list[EncodedConversation], int]:
    """data.truncation=turns: one conversation of the leading turns, up to the last supervised
    turn that fits; (it, or none, and the supervised turns left out)."""
    j = next((t for t in range(turns.n_turns) if turns.trained(t)), turns.n_turns)
    conversation, last = (None, j) if j == turns.n_turns else fitted_window(encode, turns, 0, j, max_length, False)
    kept_to = last + 1 if conversation is not None else j
    return [conversation] if conversation is not None else [], sum(map(turns.trained, range(kept_to, turns.n_turns)))


def split_turns(encode, turns: TurnLayout, max_length: int) -> tuple[list[EncodedConversation], int]:
    """data.truncation=split: conversations covering every supervised turn that fits with its own
    turn, each with as much history before it as fits (context only); (them, the supervised
    turns left out)."""
    conversations, dropped_turns, j = [], 0, 0
    while j < turns.n_turns:  # j: the first turn with supervised turns that no sequence holds yet
        if not turns.trained(j):
            j += 1
            continue
        conversation, last = fitted_window(encode, turns, j, j, max_length, True)
        if conversation is None:
            dropped_turns += turns.trained(j)
            j += 1
            continue
        conversations.append(conversation)
        j = last + 1
    return conversations, dropped_turns


def whole_conversation(encode, messages: list[dict], whole: EncodedConversation,
                       opts: TokenizeOptions) -> RowConversations:
    """The conversation as one sequence (`whole`); over data.max_length under turns or split,
    whole turns of it rendered again as conversations by `encode` (an Encoder)."""
    if len(whole.input_ids) <= opts.max_length:
        return RowConversations([whole])
    counts = Counter(over_max_length_rows=1)
    if opts.truncation not in TURN_POLICIES:
        return RowConversations([whole], counts=counts)
    policy = leading_turns if opts.truncation == "turns" else split_turns
    conversations, dropped_turns = policy(encode, TurnLayout.of(messages, whole), opts.max_length)
    # History turns are context (weight 0): what is trained in no sequence is what is lost.
    lost = sum(whole.loss_mask) - sum(sum(c.loss_mask) for c in conversations)
    if lost:
        counts["lost_supervised_tokens"] = lost
    return counted(RowConversations(conversations, counts=counts), dropped_turns, opts)


def per_turn_conversations(encoder: Encoder, messages: list[dict], opts: TokenizeOptions) -> RowConversations:
    """One sequence per supervised assistant turn: the history as the template writes it when
    that turn is generated (context only), and the turn (reasoning included); all of them
    tokenized in one call. Over data.max_length: under turns the sequence is dropped, under
    split its oldest history turns are (as few as needed)."""
    targets = [k for k, msg in enumerate(messages) if is_supervised(msg)]
    alone = [as_context_before(messages, k) for k in targets]
    encoded = encoder.encoded([encoder.rendered(conversation) for conversation in alone])
    conversations, lengths, counts, dropped_turns = [], [], Counter(), 0
    for conversation, history in zip(encoded, alone):
        lengths.append(len(conversation.input_ids))
        if len(conversation.input_ids) > opts.max_length:
            counts["over_max_length_rows"] = 1
            if opts.truncation in TURN_POLICIES:
                fitted = shortest_history(encoder, history, opts) if opts.truncation == "split" else None
                if fitted is None:
                    dropped_turns += 1
                    counts["lost_supervised_tokens"] += sum(conversation.loss_mask)
                    continue
                conversation = fitted
        conversations.append(conversation)
    if len(targets) > 1:
        counts.update(per_turn_rows=1, per_turn_sequences=len(targets),
                      per_turn_extra_tokens=sum(lengths) - max(lengths))
    return counted(RowConversations(conversations, counts=counts), dropped_turns, opts)


def shortest_history(encode, conversation: list[dict], opts: TokenizeOptions) -> EncodedConversation | None:
    """`conversation` (its last turn supervised, all before it context) with its oldest history
    turns left out, as few as fit in data.max_length; None when its last turn alone does not
    fit. A history rewritten by the template has no turn boundaries in the full rendering to
    measure, so the cut is found by bisection over rendered candidates."""
    starts = turn_starts(conversation)
    last = len(starts) - 1

    def fitting(first: int) -> EncodedConversation | None:
        candidate = encode(sub_conversation(conversation, starts, first, last, last))
        return candidate if len(candidate.input_ids) <= opts.max_length else None

    best = fitting(last)
    low, high = 1, last  # the whole conversation (first=0) is too long; first=high fits
    while best is not None and low < high:
        middle = (low + high) // 2
        candidate = fitting(middle)
        if candidate is None:
            low = middle + 1
        else:
            high, best = middle, candidate
    return best


def counted(fitted: RowConversations, dropped_turns: int, opts: TokenizeOptions) -> RowConversations:
    """The turn policy's counts; a row none of whose supervised turns fits is dropped."""
    counts = fitted.counts
    if dropped_turns:
        counts["dropped_turns"] += dropped_turns
    if opts.truncation not in TURN_POLICIES or not counts["over_max_length_rows"]:
        return fitted
    if not fitted.conversations:
        counts["dropped_over_max_length"] = 1
        fitted.dropped = (f"no assistant turn fits in data.max_length={opts.max_length} with its own turn's "
                          "messages and the row's system messages")
    else:
        counts[f"{opts.truncation}_rows"] = 1
        if opts.truncation == "split":
            counts["split_sequences"] = len(fitted.conversations)
    return fitted
