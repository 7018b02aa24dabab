"""Every limit the data stage, the packer, the trainer and the export enforce, tested exactly at
the limit, one under and one over (issue 38, "Edges"): an off-by-one (`<` for `<=`, a floor of
a float product, a seek one byte late) passes every test that stays away from the limit.

Expected values come from outside the code under test: token ids from the tokenizer's own
`apply_chat_template`, byte offsets from the file's newlines, step counts and schedule values
from their formulas. Each test's docstring names the bug planted in it and what it did; the
whole file costs ~8 CPU s (docs/testing.md, "Edges").
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hpsft.config.schema import DataConfig, OptimConfig
from hpsft.data import token_store
from hpsft.data.balance import split_by_cost
from hpsft.data.microbatch import first_fit_decreasing, min_micro_batches, plan_micro_batches
from hpsft.data.row_sequences import row_sequences
from hpsft.data.sampler import StepBatchSampler
from hpsft.data.sequence_split import padded_length, real_tokens, slice_bounds
from hpsft.data.shards import jsonl_shards, parquet_shards
from hpsft.data.sources import SourcedDataset
from hpsft.data.token_store import ShardWriter, TokenStore
from hpsft.engine.optimizer import lr_scheduler
from hpsft.models.hf_export import write_safetensors_shards
from hpsft.trainer.checkpoint import CheckpointManager
from hpsft.trainer.nonfinite import SkippedSteps
from hpsft.utils.errors import UserInputError
from tests.conftest import write_parquet
from tests.test_chat_data import options
from tests.test_row_sequences import LONG

SHORT = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four, of course."}]


def template_ids(tokenizer, messages) -> list[int]:
    """The conversation's tokens as the tokenizer's own chat template writes them."""
    out = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ---- data.max_length and data.truncation ------------------------------------------------


@pytest.mark.parametrize("truncation", ["error", "left", "right", "turns", "split"])
def test_a_sequence_of_exactly_max_length_is_kept_whole_under_every_policy(tokenizer, truncation):
    """A conversation of L tokens with data.max_length = L, L + 1: one sequence, the template's
    tokens, nothing counted as cut; at L - 1: refused (error), the last or first L - 1 tokens
    (left, right; mask cut alike), or dropped (turns, split: a one-turn conversation has no
    shorter cut). Planted: `len(ids) >= opts.max_length` in fitted_to_max_length -> at L the
    error policy refused the row (left/right cut one token)."""
    ids = template_ids(tokenizer, SHORT)
    n = len(ids)
    for max_length in (n, n + 1):
        out = row_sequences({"messages": SHORT}, tokenizer, options(max_length=max_length, truncation=truncation))
        assert [s[0] for s in out.sequences] == [ids] and out.dropped is None, max_length
        assert not out.counts.get("cut_rows") and not out.counts.get("over_max_length_rows")
    whole_mask = row_sequences({"messages": SHORT}, tokenizer, options(max_length=n)).sequences[0][1]
    under = options(max_length=n - 1, truncation=truncation)
    if truncation == "error":
        with pytest.raises(Exception, match=f"sequence has {n} tokens > data.max_length={n - 1}"):
            row_sequences({"messages": SHORT}, tokenizer, under)
        return
    out = row_sequences({"messages": SHORT}, tokenizer, under)
    if truncation in ("left", "right"):
        keep = slice(1, None) if truncation == "left" else slice(0, n - 1)
        assert out.sequences == [(ids[keep], whole_mask[keep])]
        assert out.counts["cut_rows"] == 1
    else:
        assert out.sequences == [] and out.dropped is not None
        assert out.counts["dropped_over_max_length"] == 1


@pytest.mark.parametrize("truncation", ["turns", "split"])
def test_turns_that_fill_max_length_exactly_are_one_sequence(tokenizer, truncation):
    """A six-turn conversation over the limit, data.max_length = the tokens of the system
    prompt and its first 3 turns as the template writes them (n3): the first sequence is exactly
    those 3 turns (n3 tokens); at n3 - 1 only 2 turns fit; at n3 + 1 still 3 (turn 4 is longer
    than one token). Planted: `cost(first, last + 1) < opts.max_length` in whole_conversation ->
    at n3 the first sequence held 2 turns."""
    first_turns = {k: template_ids(tokenizer, LONG[:1 + 2 * k]) for k in (2, 3)}  # system + k user/assistant pairs
    n3 = len(first_turns[3])
    for max_length, turns in ((n3 - 1, 2), (n3, 3), (n3 + 1, 3)):
        out = row_sequences({"messages": LONG}, tokenizer, options(max_length=max_length, truncation=truncation))
        assert out.sequences[0][0] == first_turns[turns], (max_length, turns)
        assert all(len(ids) <= max_length for ids, _ in out.sequences)


def test_a_custom_dataset_item_of_exactly_max_length_is_accepted():
    """data.custom_cls items are checked as read: 1..data.max_length tokens. At max_length
    accepted, max_length + 1 and 0 refused naming the key. Planted: `< self.max_length` in
    SourcedDataset.checked -> the item of exactly max_length was refused."""
    def item(n):
        return {"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool)}

    dataset = SourcedDataset([[item(8), item(9), item(0)]], ["custom"], max_length=8, described_by="a test list")
    assert dataset[0]["input_ids"].numel() == 8
    for i in (1, 2):
        with pytest.raises(UserInputError, match="data.max_length=8"):
            dataset[i]


# ---- token budgets: data.max_tokens_per_micro_batch ---------------------------------------


def test_sequences_filling_the_token_budget_exactly_share_one_micro_batch():
    """Lengths summing to exactly the budget B: one micro-batch; at B - 1 two; at B + 1 one. A
    sequence of exactly B tokens fits, one of B + 1 is refused naming the key; the planned bins
    never exceed B and hold every sequence once. Planted: `load + lengths[i] < max_tokens` in
    first_fit_decreasing -> 2 micro-batches at B."""
    lengths = [5, 3, 4]  # 12 tokens
    for budget, bins in ((11, 2), (12, 1), (13, 1)):
        assert min_micro_batches(lengths, None, budget) == bins, budget
        planned = plan_micro_batches(lengths, bins, None, budget)
        assert sorted(i for b in planned for i in b) == [0, 1, 2]
        assert all(sum(lengths[i] for i in b) <= budget for b in planned)
    assert first_fit_decreasing([12], 12) == [[0]]
    with pytest.raises(UserInputError, match="data.max_tokens_per_micro_batch=12"):
        first_fit_decreasing([13], 12)


def test_a_token_budget_of_exactly_max_length_is_accepted():
    """data.max_tokens_per_micro_batch = data.max_length is valid (a longest sequence fits
    alone), one under is refused at load naming both keys, one over valid. Planted: `<=` in
    DataConfig's check -> the budget equal to max_length refused."""
    for budget in (64, 65):
        DataConfig(train_files=["x.parquet"], max_length=64, max_tokens_per_micro_batch=budget)
    with pytest.raises(ValueError, match="data.max_tokens_per_micro_batch=63 < data.max_length=64"):
        DataConfig(train_files=["x.parquet"], max_length=64, max_tokens_per_micro_batch=63)


def test_fixed_micro_batches_at_a_multiple_of_their_size():
    """data.micro_batch_size_per_gpu m with n = 2m, 2m - 1, 2m + 1 sequences: 2, 2, 3
    micro-batches of at most m, each sequence once. Planted: `range(0, n - 1, m)` in
    fixed_size_bins -> at 2m + 1 the last sequence was lost."""
    m = 4
    for n, bins in ((2 * m - 1, 2), (2 * m, 2), (2 * m + 1, 3)):
        planned = plan_micro_batches([1] * n, bins, m, None)
        assert len(planned) == bins and max(map(len, planned)) <= m
        assert sorted(i for b in planned for i in b) == list(range(n)), n


def test_ranks_get_sizes_within_one_at_and_around_a_multiple_of_the_ranks():
    """split_by_cost over 4 parts with n = 8, 7, 9 sequences: sizes 2/2/2/2, 2/2/2/1, 3/2/2/2,
    every position once. Planted: capacity `n // n_parts` without the remainder -> 7 and 9
    lost sequences (a part had no room)."""
    rng = np.random.default_rng(0)
    for n in (7, 8, 9):
        parts = split_by_cost(rng.integers(1, 100, n), 4)
        assert sorted(len(p) for p in parts) == sorted(n // 4 + (r < n % 4) for r in range(4)), n
        assert sorted(i for p in parts for i in p) == list(range(n))


# ---- batch boundaries at the end of an epoch ----------------------------------------------


@pytest.mark.parametrize("parts", [1, 2])
def test_an_epoch_of_exactly_whole_batches_trains_every_sample_once(parts):
    """data.train_batch_size B with n = 3B, 3B - 1, 3B + 1 samples: 3, 2, 3 steps per epoch (the
    last partial batch dropped), every step B samples over all parts; at 3B every sample once;
    a position at the epoch's end (3 steps consumed) yields nothing. Planted: steps_per_epoch
    `-(-len // B)` (a partial last step kept) -> 3B - 1 gave 3 steps."""
    batch = 4
    for n, steps in ((3 * batch - 1, 2), (3 * batch, 3), (3 * batch + 1, 3)):
        dataset = SourcedDataset([[{"input_ids": torch.arange(1 + i % 5), "loss_mask": torch.ones(1 + i % 5, dtype=torch.bool)}
                                   for i in range(n)]], ["s"], max_length=8, described_by="a test list")
        samplers = [StepBatchSampler(dataset, None, batch, p, parts, shuffle=True, seed=3) for p in range(parts)]
        by_step = list(zip(*(list(s) for s in samplers)))
        assert len(by_step) == steps == len(samplers[0]), n
        seen = [i for step in by_step for part in step for i in part]
        assert all(sum(map(len, step)) == batch for step in by_step) and len(set(seen)) == len(seen)
        if n == 3 * batch:
            assert sorted(seen) == list(range(n))
        samplers[0].set_position(0, steps * batch)
        assert len(samplers[0]) == 0 and list(samplers[0]) == []


# ---- rotation: trainer.keep_last_checkpoints ---------------------------------------------


@pytest.mark.parametrize("keep_last", [0, 2, 3, 4])
def test_keep_last_checkpoints_at_under_and_over_the_number_saved(tmp_path, keep_last):
    """Three checkpoints committed (steps 1-3) and a later one left by another run (step 9),
    pruned at step 3 with keep_last 0 (all kept), 2 (step 1 goes), 3, 4 (none goes); the later
    step always stays, a crashed `.partial` always goes. Planted: `[keep_last - 1:]` ->
    keep_last=3 removed step 1."""
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3, 9):
        (manager.root / manager.tag(step)).mkdir(parents=True)
    (manager.root / manager.partial_tag(4)).mkdir()
    manager.prune(keep_last, current_step=3)
    kept = sorted(step for step, _ in manager.committed())
    assert kept == ([1, 2, 3, 9] if keep_last in (0, 3, 4) else [2, 3, 9])
    assert not (manager.root / manager.partial_tag(4)).exists()


# ---- trainer.max_skipped_steps ------------------------------------------------------------


def test_the_run_stops_at_exactly_max_skipped_steps_in_a_row():
    """trainer.max_skipped_steps = 3: 2 non-finite steps in a row pass, a finite one resets the
    count, the 3rd in a row stops naming the key and the steps; total counts every skip.
    Planted: `self.in_a_row <= self.limit` in check -> the 3rd skip did not stop."""
    skipped = SkippedSteps(3)
    for step, norm in enumerate([math.nan, math.inf, 1.0, math.nan, math.nan], start=1):
        skipped.record(norm)
        skipped.check(step, None)
    skipped.record(-math.inf)
    with pytest.raises(UserInputError, match=r"steps 4-6 .*trainer.max_skipped_steps=3"):
        skipped.check(6, None)
    assert skipped.total == 5


# ---- LR warmup: optim.warmup_ratio x total_steps -------------------------------------------


def schedule(total_steps: int, **optim) -> list[float]:
    """The learning rate of each optimizer step 1..total_steps (as the engine steps it)."""
    config = OptimConfig(**optim)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = lr_scheduler(optimizer, config, total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("ratio, total, warmup", [(0.29, 100, 29), (0.57, 100, 57), (0.1, 30, 3), (0.25, 7, 1)])
def test_warmup_is_the_ratio_of_the_steps_even_where_the_float_product_falls_short(ratio, total, warmup):
    """optim.warmup_ratio r over T steps warms up for floor(r * T) steps counted exactly
    (decimal r: 0.29 x 100 = 29, although 0.29 * 100 is 28.999999999999996 in floats): the
    learning rate rises linearly to the peak, (k + 1) / (W + 1) x lr at step k < W, the peak at
    step W, then the cosine from the peak, `min_lr_ratio` at the end. Found by this test: the
    schedule took int(0.29 * 100) = 28 warmup steps (fixed: the product rounded to 9 decimals
    first). Planted: `step <= warmup_steps` in lr_lambda -> step W at W/(W+1) of the peak."""
    lrs = schedule(total, lr=1.0, warmup_ratio=ratio, lr_scheduler="cosine", min_lr_ratio=0.1)
    expected = [(k + 1) / (warmup + 1) if k < warmup else
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))
                for k in range(total)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert lrs[warmup] == 1.0


# ---- shard sizes: data.shard_mb and the export's max_shard_mb ------------------------------


def test_jsonl_shards_of_exactly_whole_lines_end_at_the_line(tmp_path):
    """Lines of 9 bytes, shard_bytes = 9: one line a shard (the smallest line boundary at or past
    shard_bytes); 8: still one line; 10: two lines; shards tile the file and start at newlines.
    Found by this test: a target falling exactly on a line start read the next line too (18-byte
    shards for shard_bytes=9; fixed: the line holding the shard's last byte ends it). Planted
    back (seek to start + shard_bytes): shard_bytes=9 gave [(0, 18), (18, 36)]."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n' * 4)
    starts = [i + 1 for i, byte in enumerate(path.read_bytes()) if byte == ord("\n")]
    for shard_bytes, lines in ((8, 1), (9, 1), (10, 2), (36, 4), (37, 4)):
        shards = jsonl_shards(path, shard_bytes)
        bounds = [(s.start, s.stop) for s in shards]
        expected = [(9 * i, min(9 * (i + lines), 36)) for i in range(0, 4, lines)]
        assert bounds == expected, shard_bytes
        assert all(stop in starts for _, stop in bounds)
        assert [s.first_row for s in shards] == [start // 9 for start, _ in bounds]


def test_parquet_shards_of_exactly_a_multiple_of_the_rows_bytes(tmp_path, chat_rows):
    """Parquet shards are row ranges of rows x shard_bytes // file bytes: at exactly 3 rows'
    share of the file, 3 rows a shard; a byte less, 2; tiling every row once. Planted:
    `max(1, rows * shard_bytes // size - 1)` -> 2 rows at the exact share."""
    path = Path(write_parquet([{"messages": c} for c in chat_rows[:12]], tmp_path / "t.parquet"))
    size = path.stat().st_size
    for shard_bytes, per in ((-(-size * 3 // 12), 3), (-(-size * 3 // 12) - 1, 2)):
        shards = parquet_shards(path, shard_bytes)
        assert [(s.start, s.stop) for s in shards] == [(a, min(a + per, 12)) for a in range(0, 12, per)], shard_bytes


def test_export_shards_of_exactly_max_shard_mb(tmp_path):
    """Tensors of exactly 1 MiB together: one `model.safetensors`; one byte more: two shards and
    an index naming each tensor's file; a tensor over the limit alone in its shard. Planted:
    `shard_bytes + size >= max_bytes` -> the exact MiB split in two."""
    half = 2**19
    for extra, files in ((0, 1), (1, 2)):
        folder = tmp_path / f"extra{extra}"
        folder.mkdir()
        weights = [("a", torch.zeros(half, dtype=torch.uint8)), ("b", torch.zeros(half + extra, dtype=torch.uint8))]
        write_safetensors_shards(iter(weights), folder, max_shard_mb=1)
        written = sorted(p.name for p in folder.glob("*.safetensors"))
        assert len(written) == files, extra
        if files == 1:
            assert written == ["model.safetensors"]
        else:
            index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
            assert index["a"] != index["b"] and set(index.values()) == set(written)


def test_the_store_reads_sequences_across_a_record_batch_boundary(tmp_path, monkeypatch):
    """The store's writer starts a record batch every FLUSH_TOKENS tokens (set to 8 here):
    sequences reaching exactly 8 tokens close a batch there (3 + 5), one short do not (3 + 4: the
    next one closes it), one over do (3 + 6); every sequence reads back whole, also those
    beside a boundary. Planted: `self.buffered > FLUSH_TOKENS` in ShardWriter.add -> 3 + 5 made
    one batch of 3 sequences."""
    monkeypatch.setattr(token_store, "FLUSH_TOKENS", 8)
    for lengths, per_batch in (([3, 5, 2], [2, 1]), ([3, 4, 2], [3]), ([3, 6, 2], [2, 1])):
        path = tmp_path / f"shard-{'-'.join(map(str, lengths))}.arrow"
        writer = ShardWriter(path)
        sequences = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
        for i, ids in enumerate(sequences):
            writer.add(ids, [1] * len(ids), i)
        expected = writer.close()
        store = TokenStore([(path, expected)], {"skipped_rows": 0})
        assert [o.size - 1 for o in store.offsets] == per_batch, lengths
        assert [store[i]["input_ids"].tolist() for i in range(len(store))] == sequences
        assert store.lengths.tolist() == lengths


# ---- sequence parallelism: a row cut into SP slices ----------------------------------------


def test_sp_slices_of_a_row_at_and_around_a_multiple_of_the_sp_size():
    """Rows of 8, 7, 9 tokens over SP=4: padded to 8, 8, 12; slices tile the padded row; real
    tokens per rank 2/2/2/2, 2/2/2/1, 3/3/3/0, summing to the row. Planted: padded_length
    `length // sp * sp + sp` -> the 8-token row padded to 12."""
    for length, padded, real in ((7, 8, [2, 2, 2, 1]), (8, 8, [2, 2, 2, 2]), (9, 12, [3, 3, 3, 0])):
        assert padded_length(length, 4) == padded
        assert [slice_bounds(length, r, 4) for r in range(4)] == [(r * padded // 4, (r + 1) * padded // 4)
                                                                  for r in range(4)]
        assert [real_tokens(length, r, 4) for r in range(4)] == real and sum(real) == length
