"""Prefix renderings cut from one marked rendering of the whole conversation
(hpsft/data/sliced_prefixes.py) against rendering each prefix (chat_tokenize's exact path):
the same ids, masks, counts and refusals, on real ShareGPT conversations and the quirky ones
of the other chat tests, under every template whose shape is proven; and the shapes that must
not be proven are not."""

import pytest

from hpsft.data import chat_tokenize
from hpsft.data.chat_messages import BadRow
from hpsft.data.row_sequences import rows_sequences
from hpsft.data.sliced_prefixes import MARK, marked_template
from tests.test_chat_data import CONVERSATION, options
from tests.test_chat_templates import MULTI_TURN, TOOL_CONVERSATION, model_tokenizers  # noqa: F401 - a fixture

QUIRKY = [
    CONVERSATION, MULTI_TURN, TOOL_CONVERSATION,
    [{"role": "assistant", "content": "Hello! Ask me about the weather."}, {"role": "user", "content": "Is it cold?"},
     {"role": "assistant", "content": "A little."}],
    [{"role": "system", "content": "You greet."}, {"role": "assistant", "content": "Hi!"},
     {"role": "assistant", "content": "Anything else?"}, {"role": "user", "content": "One."},
     {"role": "user", "content": "Two."}, {"role": "assistant", "content": "Noted."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  padded  ", "weight": 0},
     {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Sure."}],
    # A message holding the marker: the slices cannot be found, the exact path renders.
    [{"role": "user", "content": f"a {MARK} b"}, {"role": "assistant", "content": "c"}],
]


@pytest.fixture(scope="module")
def sharegpt_rows():
    from hpsft.assets.chat_corpora import sharegpt_conversations

    return sharegpt_conversations(120)


def outcome(result):
    return (type(result).__name__, str(result)) if isinstance(result, BadRow) else result


@pytest.mark.parametrize("truncation", ["right", "split", "turns"])
@pytest.mark.parametrize("name", ["chatml", "mistral", "phi3"])
def test_sliced_prefixes_give_the_sequences_of_each_prefix_rendered(tokenizer, model_tokenizers, sharegpt_rows,
                                                                     name, truncation, monkeypatch):
    """Catches a slice cut at the wrong marker (e.g. starts[n] for starts[n + 1]: each turn's
    span loses a message), a wrong generation-prompt tail, a closing taken from the wrong
    rendering, or a proof that admits a template whose prefixes render otherwise."""
    tok, template = (tokenizer, None) if name == "chatml" else model_tokenizers[name]
    assert marked_template(tok.get_chat_template(template)) is not None, "the fast path is not taken"
    rows = [{"messages": m} for m in QUIRKY + sharegpt_rows]
    opts = options(chat_template=template, max_length=384, truncation=truncation, bad_rows="skip")
    sliced = [outcome(r) for r in rows_sequences(rows, tok, opts)]
    monkeypatch.setattr(chat_tokenize, "prefix_slicer", lambda *args: None)
    exact = [outcome(r) for r in rows_sequences(rows, tok, opts)]
    assert sliced == exact
    kept = sum(not isinstance(r, tuple) for r in exact)
    assert kept > len(rows) // 2 and (name != "mistral" or kept < len(rows))  # Mistral refuses system prompts


CHATML_TURN = "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
GENERATION_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"


@pytest.mark.parametrize("template", [
    # Reads ahead or behind in the conversation, or keeps state between messages.
    "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}" + CHATML_TURN + "{% endif %}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{{ loop.length }}{% endfor %}",
    "{{ messages | length }}{% for m in messages %}" + CHATML_TURN + "{% endfor %}",
    "{% for m in messages %}{% if loop.index0 > 0 %}{{ messages[loop.index0 - 1].role }}{% endif %}{% endfor %}",
    "{% for m in messages %}{{ messages[-1].content }}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}" + CHATML_TURN + "{% endfor %}",
    "{% for m in messages %}{% set c = m.content %}{{ c }}{% endfor %}",
    # The generation prompt changes the text before it.
    "{{ 'Reply now.\n' if add_generation_prompt else '' }}{% for m in messages %}" + CHATML_TURN + "{% endfor %}",
    "{% for m in messages %}{{ m.content if add_generation_prompt else '' }}{% endfor %}",
    # A function that may hold state or differ between calls; two loops; a nested loop.
    "{{ strftime_now('%d') }}{% for m in messages %}" + CHATML_TURN + "{% endfor %}",
    "{% for m in messages %}{{ m.content }}{% endfor %}{% for m in messages %}{{ m.role }}{% endfor %}",
    "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}{% endfor %}{% endfor %}",
])
def test_shapes_that_are_not_proven(template):
    """Catches a proof that admits what reads other messages, keeps state, or depends on the
    generation prompt before the loop ends (e.g. allowing loop.last)."""
    assert marked_template(template + GENERATION_PROMPT) is None


def test_a_one_loop_chatml_template_is_proven():
    assert marked_template("{% for m in messages %}{% if loop.first and messages[0].role != 'system' %}"
                           "{{ 'default system\n' }}{% endif %}" + CHATML_TURN + "{% endfor %}" + GENERATION_PROMPT)
