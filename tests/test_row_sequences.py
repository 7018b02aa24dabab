"""A row -> its training sequences (hpsft/data/row_sequences.py): turn-aware truncation
(data.truncation=turns|split) and one sequence per assistant turn for templates that rewrite
history (data.multiturn), on the packaged SmolLM2 tokenizer and real ShareGPT conversations.

Expected texts come from the template itself (`apply_chat_template` on slices of the
conversation) and lengths from the tokenizer on those texts, never from hpsft's planner.
"""

from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hpsft.data.chat_messages import BadRow
from hpsft.data.row_sequences import row_conversations, row_sequences
from tests.conftest import write_jsonl
from tests.test_chat_data import options, spans

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SYSTEM = {"role": "system", "content": "You explain things step by step."}
END = "<|im_end|>"


def answer(i: int, steps: int) -> str:
    return " ".join(f"Step {j} of answer {i} adds one more detail." for j in range(steps))


# A system prompt and six turns of different lengths: 46-298 tokens a turn as rendered.
LONG = [SYSTEM] + [
    message for i, steps in enumerate([4, 9, 3, 22, 2, 12])
    for message in ({"role": "user", "content": f"Question {i}: tell me about part {i}."},
                    {"role": "assistant", "content": answer(i, steps)})
]


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def supervised_runs(tokenizer, ids, mask) -> list[str]:
    return [tokenizer.decode(ids[a:b]) for a, b in spans(mask)]


def rendering(tokenizer, messages, **kw) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def locate(tokenizer, messages: list[dict], text: str) -> tuple[list[dict], int, int]:
    """The leading system messages and the slice messages[a:b] whose rendering is `text`."""
    head = [m for m in messages[:1] if m["role"] == "system"]
    for a in range(len(head), len(messages)):
        for b in range(a + 1, len(messages) + 1):
            if rendering(tokenizer, head + messages[a:b]) == text:
                return head, a, b
    raise AssertionError(f"no slice of the conversation renders as {text[:200]!r}...")


def check_split(tokenizer, messages: list[dict], sequences, max_length: int, dropped_turns: int = 0) -> list:
    """Each sequence is the template's rendering of the system messages and a slice of whole
    turns (from a user message through an assistant turn), within max_length; the supervised
    runs are assistant turns of its slice, those before them unsupervised history; over all
    sequences each assistant turn is supervised once (but `dropped_turns`, in none).
    Returns the (a, b, c) of each sequence: its slice and where its supervised turns begin."""
    expected = Counter(m["content"] + END for m in messages if m["role"] == "assistant")
    found, slices = Counter(), []
    for ids, mask in sequences:
        assert len(ids) <= max_length
        head, a, b = locate(tokenizer, messages, tokenizer.decode(ids))
        assert messages[a]["role"] == "user" and messages[b - 1]["role"] == "assistant"
        runs = supervised_runs(tokenizer, ids, mask)
        turns = [m["content"] + END for m in messages[a:b] if m["role"] == "assistant"]
        assert runs == turns[len(turns) - len(runs):], "supervised runs must be the slice's last assistant turns"
        c = b - 2 * len(runs) + 1 if messages is LONG else None  # LONG alternates user/assistant
        found.update(runs)
        slices.append((a, b, c))
    assert all(found[k] <= 1 for k in found) and set(found) <= set(expected)
    assert sum(expected.values()) - sum(found.values()) == dropped_turns
    return slices


def test_turns_keeps_the_leading_whole_turns_that_fit(tokenizer):
    """Catches a cut inside a turn (left/right truncation in its place) and a kept prefix
    that is not the longest that fits."""
    max_length = 300
    # The longest prefix ending with an assistant turn whose rendering fits, by the tokenizer.
    fits = [b for b in range(3, len(LONG) + 1, 2) if n_tokens(tokenizer, rendering(tokenizer, LONG[:b])) <= max_length]
    b = max(fits)
    assert 3 < b < len(LONG)
    result = row_sequences({"messages": LONG}, tokenizer, options(max_length=max_length, truncation="turns"))
    [(ids, mask)] = result.sequences
    assert tokenizer.decode(ids) == rendering(tokenizer, LONG[:b])
    assert supervised_runs(tokenizer, ids, mask) == [m["content"] + END for m in LONG[:b] if m["role"] == "assistant"]
    dropped = sum(m["role"] == "assistant" for m in LONG[b:])
    counts = dict(result.counts)
    assert counts.pop("lost_supervised_tokens") > 0  # the dropped turns' supervised tokens
    assert counts == {"over_max_length_rows": 1, "turns_rows": 1, "dropped_turns": dropped}


def test_split_supervises_every_assistant_turn_once_with_the_history_that_fits(tokenizer):
    """Catches history turns left supervised (a turn trained twice), a cut inside a turn, a
    sequence over max_length, and history left out that would have fitted."""
    max_length = 400
    result = row_sequences({"messages": LONG}, tokenizer, options(max_length=max_length, truncation="split"))
    slices = check_split(tokenizer, LONG, result.sequences, max_length)
    assert len(slices) >= 3 and any(a < c for a, _, c in slices), "the test needs a sequence with history"
    for a, b, _ in slices:
        if a > 1:  # one more turn of history (a user message and its answer) would not fit
            assert n_tokens(tokenizer, rendering(tokenizer, LONG[:1] + LONG[a - 2:b])) > max_length
    assert result.counts == {"over_max_length_rows": 1, "split_rows": 1, "split_sequences": len(slices)}


def test_a_turn_that_fits_in_no_sequence_is_dropped_and_counted(tokenizer):
    # max_length 200: turn 3 (298 tokens) fits in no sequence; a row whose first turn does not
    # fit keeps nothing under turns: it is dropped.
    result = row_sequences({"messages": LONG}, tokenizer, options(max_length=200, truncation="split"))
    check_split(tokenizer, LONG, result.sequences, 200, dropped_turns=1)
    assert result.counts["dropped_turns"] == 1 and result.dropped is None
    huge = [LONG[0], LONG[7], LONG[8], LONG[1], LONG[2]]
    for policy in ("turns", "split"):
        result = row_sequences({"messages": huge}, tokenizer, options(max_length=200, truncation=policy))
        if policy == "turns":
            assert result.sequences == [] and result.dropped.startswith("no assistant turn fits in data.max_length=200")
            counts = dict(result.counts)
            assert counts.pop("lost_supervised_tokens") > 0  # the whole row's supervised tokens
            assert counts == {"over_max_length_rows": 1, "dropped_turns": 2, "dropped_over_max_length": 1}
        else:
            check_split(tokenizer, huge, result.sequences, 200, dropped_turns=1)


@pytest.fixture(scope="module")
def sharegpt():
    from hpsft.assets.chat_corpora import sharegpt_conversations

    return sharegpt_conversations(120)


@pytest.mark.parametrize("policy", ["turns", "split"])
def test_turn_policies_on_real_sharegpt_rows(tokenizer, sharegpt, policy):
    """On real conversations (most without a system message: the template writes its own
    default one into every sequence), each sequence is a rendering of whole turns within
    max_length; split supervises every turn once but those that fit nowhere."""
    max_length = 512
    totals = Counter()
    for messages in sharegpt:
        result = row_sequences({"messages": messages}, tokenizer, options(max_length=max_length, truncation=policy))
        totals.update(result.counts)
        over = n_tokens(tokenizer, rendering(tokenizer, messages)) > max_length
        assert result.counts.get("over_max_length_rows", 0) == over
        if not over:
            [(ids, _)] = result.sequences
            assert tokenizer.decode(ids) == rendering(tokenizer, messages)
        elif policy == "split":
            check_split(tokenizer, messages, result.sequences, max_length, result.counts.get("dropped_turns", 0))
        elif result.sequences:
            [(ids, mask)] = result.sequences
            head, a, b = locate(tokenizer, messages, tokenizer.decode(ids))
            assert a == len(head) and len(ids) <= max_length  # the leading turns
            assert supervised_runs(tokenizer, ids, mask) == [m["content"] + END for m in messages[a:b]
                                                             if m["role"] == "assistant"]
    # The corpus has rows of every kind: fitting, fitted by the policy, dropped.
    assert totals["over_max_length_rows"] > 30 and totals[f"{policy}_rows"] > 20 and totals["dropped_over_max_length"]
    assert totals["over_max_length_rows"] == totals[f"{policy}_rows"] + totals["dropped_over_max_length"]


# Two turns with reasoning: the Qwen3-like template writes the first turn's reasoning only
# while it is the newest turn; GPT-OSS-like writes its analysis channel only then.
REASONING = [
    {"role": "user", "content": "Is 91 prime?"},
    {"role": "assistant", "reasoning_content": "91 = 7 * 13, so it has divisors.", "content": "No: 91 is 7 times 13."},
    {"role": "user", "content": "And 97?"},
    {"role": "assistant", "reasoning_content": "No prime up to 9 divides 97.", "content": "Yes, 97 is prime."},
]


@pytest.fixture(scope="module")
def qwen3(model_path):
    """The packaged tokenizer with Qwen3's reasoning markers as single tokens, and the template."""
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tok, (TEMPLATES / "qwen3.jinja").read_text()


def test_per_turn_sequences_train_each_turn_with_its_reasoning(qwen3):
    """Catches supervising history turns, dropping the reasoning of the trained turn, and a
    history not written as the template writes it when the turn is generated."""
    tok, template = qwen3
    result = row_sequences({"messages": REASONING}, tok, options(chat_template=template))
    assert len(result.sequences) == 2
    for k, (ids, mask) in zip((1, 3), result.sequences):
        turn = REASONING[k]
        assert supervised_runs(tok, ids, mask) == [
            f"<think>\n{turn['reasoning_content']}\n</think>\n\n{turn['content']}{END}"]
        assert tok.decode(ids) == rendering(tok, REASONING[:k + 1], chat_template=template)
    history = tok.decode(result.sequences[1][0])
    assert REASONING[1]["reasoning_content"] not in history and REASONING[1]["content"] in history
    first, second = (len(ids) for ids, _ in result.sequences)
    assert result.counts == {"per_turn_rows": 1, "per_turn_sequences": 2, "per_turn_extra_tokens": first}
    # One sequence of the whole conversation cannot be located: refused, as before.
    with pytest.raises(BadRow, match="does not render conversation prefixes as prefixes"):
        row_sequences({"messages": REASONING}, tok, options(chat_template=template, multiturn="whole"))
    # Reasoning given inside the content (<think>...</think>) is the same conversation.
    inline = [dict(m, content=f"<think>\n{m.pop('reasoning_content')}\n</think>\n\n{m['content']}")
              if m["role"] == "assistant" else m for m in (dict(m) for m in REASONING)]
    assert row_sequences({"messages": inline}, tok, options(chat_template=template)).sequences == result.sequences


def test_per_turn_drops_the_analysis_channel_of_past_turns_gpt_oss_like(model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.add_special_tokens({"eos_token": "<|return|>",
                            "additional_special_tokens": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]})
    template = (TEMPLATES / "gpt_oss.jinja").read_text()
    messages = [{"role": "system", "content": "Answer in one line."}] + [
        {"role": m["role"], "content": m["content"], **({"thinking": m["reasoning_content"]} if "reasoning_content" in m
                                                         else {})} for m in REASONING]
    result = row_sequences({"messages": messages}, tok, options(chat_template=template))
    assert len(result.sequences) == 2
    for k, (ids, mask) in zip((2, 4), result.sequences):
        assert supervised_runs(tok, ids, mask) == [
            f"<|channel|>analysis<|message|>{messages[k]['thinking']}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{messages[k]['content']}<|return|>"]
        assert tok.decode(ids) == rendering(tok, messages[:k + 1], chat_template=template)
    history = tok.decode(result.sequences[1][0])
    assert messages[2]["thinking"] not in history
    assert f"<|channel|>final<|message|>{messages[2]['content']}<|end|>" in history
    # A single turn renders as one sequence: nothing to expand.
    single = row_sequences({"messages": messages[:3]}, tok, options(chat_template=template))
    assert single.sequences == result.sequences[:1] and single.counts == {}


def test_per_turn_losses_equal_hugging_face_on_each_rendered_turn(tmp_path, model_path, qwen3):
    """Each per-turn sequence, through hpsft's data stage (prepared_store) and packed forward
    (PackedCausalLM, both sequences in one row), has the loss the model's own forward gives
    on the text the template renders for that turn, with labels on the turn's tokens only
    (fp32; sums of NLL within 1e-5 relative). Catches a supervised history or a mask shifted
    off the turn."""
    from hpsft.data.batch import collate_jagged, packed_row
    from hpsft.data.preparation import prepared_store
    from hpsft.models import PackedCausalLM, load_causal_lm

    tok, template = qwen3
    path = write_jsonl([{"messages": REASONING}], tmp_path / "reasoning.jsonl")
    dataset = prepared_store(path, tok, options(chat_template=template), tmp_path / "cache")
    assert len(dataset) == 2
    torch.manual_seed(0)
    lm = load_causal_lm(model_path)
    lm.resize_token_embeddings(len(tok))  # rows for <think> and </think>
    model = PackedCausalLM(lm).eval()
    with torch.no_grad():
        ours = model(**packed_row(collate_jagged([dataset[i] for i in range(2)])), per_sequence=True)
        for i, k in enumerate((1, 3)):
            text = rendering(tok, REASONING[:k + 1], chat_template=template)
            prompt = rendering(tok, REASONING[:k], chat_template=template, add_generation_prompt=True)
            ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
            start = n_tokens(tok, prompt)
            end = n_tokens(tok, text[: text.rindex(END) + len(END)])  # through the turn's <|im_end|>
            labels = torch.full_like(ids, -100)
            labels[start:end] = ids[start:end]
            reference = lm(input_ids=ids[None], labels=labels[None], use_cache=False).loss.double() * (end - start)
            assert ours["n_tokens"][i].item() == end - start
            assert abs(ours["nll"][i].item() - reference.item()) <= 1e-5 * reference.item()


def test_weight_zero_turns_are_context(tokenizer):
    messages = [dict(m, weight=0) if i == 2 else m for i, m in enumerate(LONG[:5])]
    [(ids, mask)] = row_sequences({"messages": messages}, tokenizer, options()).sequences
    assert tokenizer.decode(ids) == rendering(tokenizer, LONG[:5])
    assert supervised_runs(tokenizer, ids, mask) == [LONG[4]["content"] + END]


def test_row_conversations_are_the_messages_each_sequence_renders(tokenizer):
    """What prepare-data writes: each split sequence as a conversation whose history turns
    have weight 0, which renders and masks as that sequence again."""
    fitted = row_conversations({"messages": LONG}, tokenizer, options(max_length=400, truncation="split"))
    assert len(fitted.conversations) == 3
    for conversation in fitted.conversations:
        again = row_sequences({"messages": conversation.rendered.messages}, tokenizer, options(max_length=400))
        assert again.sequences == [(conversation.input_ids, conversation.loss_mask)]


def test_a_batch_of_rows_gives_each_row_what_it_gives_alone(tokenizer, sharegpt):
    """rows_sequences tokenizes the whole renderings of its rows in one call: a refused row,
    one split, one trained per turn and plain ones in the same batch each get their own
    sequences (or their own error), as row_sequences gives them one at a time. Catches
    renderings and encodings paired with the wrong row."""
    from hpsft.data.row_sequences import rows_sequences

    rows = [{"messages": sharegpt[0]}, {"messages": [{"role": "robot", "content": "x"}]}, {"messages": LONG},
            {"messages": sharegpt[1]}, {"messages": [{"role": "user", "content": "hi"}]}, {"messages": sharegpt[2]}]
    for opts in (options(max_length=400, truncation="split"), options(max_length=400, truncation="split",
                                                                      multiturn="per_turn")):
        batch = rows_sequences(rows, tokenizer, opts)
        for row, result in zip(rows, batch):
            try:
                alone = row_sequences(row, tokenizer, opts)
            except BadRow as err:
                assert isinstance(result, BadRow) and str(result) == str(err)
                continue
            assert result == alone
        assert [isinstance(r, BadRow) for r in batch] == [False, True, False, False, True, False]
