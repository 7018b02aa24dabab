"""Padding-free packing: packed rows == sequences alone; micro-batch plans; split invariance."""

import random

import pytest
import torch
import torch.nn.functional as F

from hpsft.data.batch import collate_jagged, loss_token_count, packed_row, select, seqlens
from hpsft.data.microbatch import first_fit_decreasing, min_micro_batches, plan_micro_batches
from hpsft.models import PackedCausalLM, UnsupportedModel, load_causal_lm, verify_packed_training


@pytest.fixture(scope="module")
def model(model_path):
    torch.manual_seed(0)
    return PackedCausalLM(load_causal_lm(model_path)).eval()


def random_batch(lengths, vocab=49152, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        mask = torch.rand(n, generator=g) < 0.6
        samples.append({"input_ids": torch.randint(0, vocab, (n,), generator=g), "loss_mask": mask, "index": i})
    return collate_jagged(samples)


@pytest.mark.parametrize("lengths", [[5, 1, 9, 1, 13], [17], [1]])
def test_packed_forward_equals_each_sequence_alone(model, lengths):
    batch = random_batch(lengths)
    row = packed_row(batch)
    with torch.no_grad():
        packed = model.logits(row["input_ids"], row["position_ids"], row["offsets"])
        alone = torch.cat([model.lm(input_ids=batch[i]["input_ids"][None], use_cache=False).logits[0]
                           for i in range(len(lengths))])
    rel = ((packed - alone).abs().max() / alone.abs().max()).item()
    assert rel <= 1e-5, rel


def test_varlen_sdpa_equals_transformers_block_masked_sdpa(model_path):
    """hpsft's per-sequence attention == transformers' sdpa with the mask it derives from
    the position restarts (fp32), on the same packed row."""
    batch = random_batch([7, 1, 12, 3], seed=3)
    row = packed_row(batch)
    with torch.no_grad():
        ours = PackedCausalLM(load_causal_lm(model_path, "hpsft_varlen")).eval().logits(
            row["input_ids"], row["position_ids"], row["offsets"])
        theirs = PackedCausalLM(load_causal_lm(model_path, "sdpa")).eval().logits(
            row["input_ids"], row["position_ids"], row["offsets"])
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5


def test_per_sequence_losses_match_an_independent_reference(model):
    lengths = [6, 1, 11, 4]
    batch = random_batch(lengths, seed=1)
    row = packed_row(batch)
    with torch.no_grad():
        per_sequence = model(**row, per_sequence=True)
        sums, counts = per_sequence["nll"], per_sequence["n_tokens"]
        out = model(**row)
        total, n_tokens = out["loss"], out["n_tokens"]
        for i in range(len(lengths)):
            ids, mask = batch[i]["input_ids"], batch[i]["loss_mask"]
            logits = model.lm(input_ids=ids[None], use_cache=False).logits[0].double()
            targets = mask[1:]  # position t predicts token t+1
            ref = F.cross_entropy(logits[:-1][targets], ids[1:][targets], reduction="sum") if targets.any() else 0.0
            assert counts[i].item() == int(targets.sum())
            assert abs(sums[i].item() - float(ref)) <= 1e-5 * max(1.0, abs(float(ref)))
    assert n_tokens.item() == counts.sum().item() == loss_token_count(batch)
    assert abs(total.item() - sums.sum().item()) <= 1e-5 * total.item()


def test_token_accuracy_counts_argmax_hits_on_loss_tokens(model_path):
    model = PackedCausalLM(load_causal_lm(model_path), token_accuracy=True).eval()
    with torch.no_grad():
        # A sequence continued greedily by the model itself: its 8 generated tokens are hits.
        greedy = torch.tensor([1, 504, 2843])
        for _ in range(8):
            next_token = model.lm(input_ids=greedy[None], use_cache=False).logits[0, -1].argmax()
            greedy = torch.cat([greedy, next_token[None]])
        samples = [{"input_ids": greedy, "loss_mask": torch.arange(11) >= 3, "index": 0},
                   {"input_ids": random_batch([14], seed=4)[0]["input_ids"], "loss_mask": torch.ones(14, dtype=torch.bool),
                    "index": 1}]
        batch = collate_jagged(samples)
        out = model(**packed_row(batch))
        n_tokens, correct = out["n_tokens"], out["correct"]
        expected = 0
        for sample in samples:
            ids, mask = sample["input_ids"], sample["loss_mask"]
            predicted = model.lm(input_ids=ids[None], use_cache=False).logits[0].argmax(-1)
            expected += int((predicted[:-1] == ids[1:])[mask[1:]].sum())
        not_asked = PackedCausalLM(load_causal_lm(model_path)).eval()(**packed_row(batch))["correct"]
    assert expected >= 8 and correct.item() == expected and n_tokens.item() == 8 + 13
    assert not_asked.item() == -1


def test_packed_rows_pass_int32_boundaries_and_the_longest_sequence_to_every_layer(model_path):
    """flash-attn's and torch's varlen kernels take int32 boundaries, and the longest sequence
    as a number: PackedCausalLM computes both once per forward and every layer gets them."""
    from transformers import AttentionInterface

    from hpsft.models.varlen_attention import varlen_attention

    received = []

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        received.append((kwargs["cu_seq_lens_q"], kwargs["max_length_q"]))
        return varlen_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("test_recording_varlen", recording_attention)
    lm = load_causal_lm(model_path, "hpsft_varlen")
    lm.set_attn_implementation("test_recording_varlen")
    row = packed_row(random_batch([4, 1, 9], seed=5))
    with torch.no_grad():
        PackedCausalLM(lm).eval().logits(row["input_ids"], row["position_ids"], row["offsets"])
    assert len(received) == lm.config.num_hidden_layers
    for cu_seq_lens, max_length in received:
        assert cu_seq_lens.dtype == torch.int32 and cu_seq_lens.tolist() == [0, 4, 5, 14]
        assert max_length == 9


def test_a_packed_row_brings_its_longest_sequence_and_the_forward_reads_none_back(model):
    """packed_row gives the longest sequence as a host int (split_row the padded row's, whose
    last sequence takes the padding); given it, hidden_states reads nothing back from the
    device for it (on a GPU a wait per micro-batch: one recorded read-back fewer), and the
    hidden states equal those of the read-back. Planted: max_length ignored in hidden_states
    (the same count either way) fails it."""
    from hpsft.data.batch import empty_batch
    from hpsft.data.sequence_split import split_row
    from tests.syncing_ops import DataDependentOps

    row = packed_row(random_batch([4, 1, 9, 2], seed=7))
    assert row["max_length"] == 9 and isinstance(row["max_length"], int)
    assert packed_row(empty_batch())["max_length"] == 1  # the placeholder row's one token
    # 13 tokens padded to 16 over 4 ranks: the last sequence, 10 tokens, becomes 13
    assert [split_row(packed_row(random_batch([3, 10], seed=7)), r, 4)["max_length"] for r in range(4)] == [13] * 4
    recorded = []
    for max_length in (row["max_length"], None):
        with torch.no_grad(), DataDependentOps() as ops:
            hidden, _ = model.hidden_states(row["input_ids"], row["position_ids"], row["offsets"], max_length)
        recorded.append((hidden, ops.seen))
    (given, seen_given), (read_back, seen_read_back) = recorded
    # transformers' mask preparation reads the position ids back once either way; ours is the one more.
    assert len(seen_read_back) == len(seen_given) + 1, (seen_given, seen_read_back)
    assert torch.equal(given, read_back)


def test_whole_row_kernel_bounds_given_or_derived_from_position_ids_agree():
    from hpsft.models.varlen_attention import kernel_bounds

    row = packed_row(random_batch([3, 7, 1], seed=6))
    query = torch.zeros(1, 2, 11, 8)
    given = kernel_bounds(row["offsets"].to(torch.int32), 7, None, query)
    derived = kernel_bounds(None, None, row["position_ids"], query)
    for cu_seq, longest in (given, derived):
        assert cu_seq.dtype == torch.int32 and cu_seq.tolist() == [0, 3, 10, 11] and longest == 7


def row_wide_causal_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal attention over the whole packed row: ignores the sequence boundaries."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def test_a_model_that_attends_across_sequences_is_refused(model_path):
    from transformers import AttentionInterface

    lm = load_causal_lm(model_path)
    verify_packed_training(lm)  # the real model is fine
    AttentionInterface.register("test_row_wide_causal", row_wide_causal_attention)
    lm.set_attn_implementation("test_row_wide_causal")
    with pytest.raises(UnsupportedModel, match="differs from the model's own eager forward"):
        verify_packed_training(lm)


def test_flash_attention_is_not_verified_on_an_fp32_cpu_model():
    # flash-attn runs on CUDA in 16-bit only: the worker verifies such a model after the engine
    # has moved and cast it; called on the CPU model, the check says so instead of quietly
    # checking another attention (which it used to do).
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    lm = AutoModelForCausalLM.from_config(config)
    lm.config._attn_implementation = "flash_attention_2"  # flash-attn is not installed here
    with pytest.raises(ValueError, match="flash_attention_2 runs on CUDA in fp16/bf16"):
        verify_packed_training(lm)


@pytest.mark.parametrize("seed", range(20))
def test_micro_batch_plans_place_every_sample_once_within_budget(seed):
    rng = random.Random(seed)
    budget = rng.choice([64, 100, 257])
    lengths = [rng.randint(1, budget) for _ in range(rng.randint(0, 40))]
    needed = min_micro_batches(lengths, None, budget)
    for extra in (0, 3):  # as many as this rank needs, or more because another rank needs more
        bins = plan_micro_batches(lengths, needed + extra, None, budget)
        assert len(bins) == needed + extra
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= budget for b in bins)
        assert all(b == sorted(b) for b in bins)  # original order kept inside a micro-batch
    # The count is near the lower bound ceil(total / budget).
    assert needed <= max(1, -(-sum(lengths) // budget)) * 2


def test_fixed_size_plans_and_budget_errors():
    assert plan_micro_batches([3, 4, 5, 6, 7], 4, 2, None) == [[0, 1], [2, 3], [4], []]
    with pytest.raises(ValueError, match="sequence 1 has 90 tokens > data.max_tokens_per_micro_batch=64"):
        first_fit_decreasing([10, 90], 64)


def test_fixed_and_token_budget_splits_give_the_same_loss_and_gradients(model):
    """Normalising by the step's loss-token count makes the split irrelevant (fp32)."""
    batch = random_batch([30, 3, 17, 1, 25, 9, 12], seed=2)
    lengths = seqlens(batch).tolist()
    global_tokens = None

    def step(bins):
        nonlocal global_tokens
        model.zero_grad()
        total = 0.0
        for b in bins:
            loss_sum = model(**packed_row(select(batch, b)))["loss"]
            (loss_sum / global_tokens).backward()
            total += loss_sum.item()
        return total, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    global_tokens = int(sum(model(**packed_row(select(batch, [i])))["n_tokens"] for i in range(len(lengths))))
    loss_a, grads_a = step(plan_micro_batches(lengths, min_micro_batches(lengths, 3, None), 3, None))
    loss_b, grads_b = step(plan_micro_batches(lengths, min_micro_batches(lengths, None, 40), None, 40))
    loss_c, grads_c = step([list(range(len(lengths)))])
    assert abs(loss_a - loss_b) <= 1e-5 * loss_a and abs(loss_a - loss_c) <= 1e-5 * loss_a
    for k in grads_a:
        scale = grads_a[k].abs().max().clamp_min(1e-12)
        assert ((grads_a[k] - grads_b[k]).abs().max() / scale).item() <= 1e-4, k
        assert ((grads_a[k] - grads_c[k]).abs().max() / scale).item() <= 1e-4, k


def test_training_with_the_fused_loss_follows_the_materialised_reference(model_path):
    """3 AdamW steps through the fused varlen op on packed rows == the same steps through
    full logits and F.cross_entropy, one sequence at a time (fp32)."""
    batches = [random_batch([20, 7, 33, 12], seed=10 + s) for s in range(3)]

    def train(loss_of_batch):
        torch.manual_seed(0)
        model = PackedCausalLM(load_causal_lm(model_path)).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = []
        for batch in batches:
            optimizer.zero_grad()
            loss = loss_of_batch(model, batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses, {k: p.detach().clone() for k, p in model.named_parameters()}

    def fused(model, batch):
        out = model(**packed_row(batch))
        return out["loss"] / out["n_tokens"]

    def reference(model, batch):
        total, count = 0.0, 0
        for i in range(batch.batch_size[0]):
            ids, mask = batch[i]["input_ids"], batch[i]["loss_mask"]
            logits = model.lm(input_ids=ids[None], use_cache=False).logits[0]
            targets = mask[1:]
            total = total + F.cross_entropy(logits[:-1][targets], ids[1:][targets], reduction="sum")
            count += int(targets.sum())
        return total / count

    fused_losses, fused_weights = train(fused)
    reference_losses, reference_weights = train(reference)
    for a, b in zip(fused_losses, reference_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (fused_losses, reference_losses)
    for k, w in reference_weights.items():
        assert ((fused_weights[k] - w).norm() / w.norm()).item() <= 1e-5, k
