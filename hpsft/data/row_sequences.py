"""One row -> the sequences it trains: its conversation rendered and masked by the chat
template (hpsft/data/chat_tokenize.py), then fitted to data.max_length by data.truncation.

`row_sequences` is the one place the data stage turns a row into training sequences: the
data stage (hpsft/data/dataset.py), hpsft inspect-data and prepare-data all go through it.
"""

from dataclasses import dataclass, field

from hpsft.data.chat_messages import BadRow
from hpsft.data.chat_tokenize import tokenize_conversation
from hpsft.data.rows import TokenizeOptions, row_to_messages


@dataclass
class RowSequences:
    """What a row becomes: its sequences (input_ids, loss_mask as 0/1 lists), or none and the
    reason it was dropped (a policy that drops rather than fails, e.g. no turn fits); `counts`:
    events the data stage adds up over all rows for its summary (e.g. {"truncated": 1})."""

    sequences: list[tuple[list[int], list[int]]] = field(default_factory=list)
    dropped: str | None = None
    counts: dict[str, int] = field(default_factory=dict)


def truncate(input_ids: list[int], loss_mask: list[int], opts: TokenizeOptions):
    if len(input_ids) <= opts.max_length:
        return input_ids, loss_mask
    if opts.truncation == "error":
        raise BadRow(
            f"sequence has {len(input_ids)} tokens > data.max_length={opts.max_length} "
            "(raise data.max_length or set data.truncation=left|right)"
        )
    keep = slice(-opts.max_length, None) if opts.truncation == "left" else slice(0, opts.max_length)
    return input_ids[keep], loss_mask[keep]


def row_sequences(row, tokenizer, opts: TokenizeOptions) -> RowSequences:
    """The sequences of one row; a malformed row, or one the policy refuses, raises BadRow."""
    messages, tools = row_to_messages(row, opts)
    ids, mask = tokenize_conversation(tokenizer, messages, tools, opts.chat_template)
    return RowSequences([truncate(ids, mask, opts)])
