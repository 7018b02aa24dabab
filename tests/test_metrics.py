"""Honest metrics through the real CLI: val/loss is the plain NLL (checked against the
exported model's own Hugging Face loss), and the other terms of the objective are logged
under their own names, the MoE router loss included."""

from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpsft.data.chat_tokenize import tokenize_conversation
from tests.conftest import assert_ok, base_overrides, read_metrics, rel_diff, run_cli, write_parquet

Z_LOSS_WEIGHT, LABEL_SMOOTHING = 1e-3, 0.1
RTOL = 1e-5  # hpsft's fp32 sums against the fp64 reference


def independent_terms(model_dir: Path, files: list[str]) -> dict:
    """Token means over the conversations in `files` under the model in `model_dir` (row_counts:
    each conversation alone through the model's own forward, its logits in fp64; docs/ops.md):
    nll; z_loss = w * lse^2; objective = F.cross_entropy with label smoothing + w * lse^2."""
    counts = row_counts(str(model_dir), [row for path in files for row in pq.read_table(path).to_pylist()])
    return {name: total(counts, name) / total(counts, "loss_tokens") for name in ("nll", "z_loss", "objective")}


def test_each_loss_term_equals_its_formula_and_val_loss_is_the_plain_nll(tmp_path, model_path, chat_rows):
    """Step 1 trains on all 8 conversations at the untrained weights: its train/loss,
    train/z_loss and train/objective equal the NLL, the z-loss and the smoothed cross-entropy
    + z-loss of the model's own logits (independent_terms); val/loss is the plain NLL of the
    untrained (step 0) and the exported trained model. Planted: z_loss_weight and
    label_smoothing swapped where PackedCausalLM hands them to the loss op: failed on
    train/z_loss (100 x the formula's)."""
    train = write_parquet([{"messages": c} for c in chat_rows[:8]], tmp_path / "train.parquet")
    val = write_parquet([{"messages": c} for c in chat_rows[16:24]], tmp_path / "val.parquet")
    out_dir = tmp_path / "run"
    result = run_cli("hpsft.train", base_overrides(model_path, train, val, out_dir, **{
        "trainer.total_steps": 1, "data.train_batch_size": 8, "loss.z_loss_weight": Z_LOSS_WEIGHT,
        "loss.label_smoothing": LABEL_SMOOTHING, "trainer.val_before_train": "true"}))
    assert result.returncode == 0, result.stderr[-3000:]
    before, step = read_metrics(out_dir)
    untrained = independent_terms(Path(model_path), [train])
    for name, expected in untrained.items():
        metric = "train/loss" if name == "nll" else f"train/{name}"
        assert abs(step[metric] - expected) <= RTOL * expected, (metric, step[metric], expected)
    # trainer.val_before_train: step 0 holds the untrained model's val/loss.
    assert before["step"] == 0 and set(before) == {"step", "val/loss"}
    expected = independent_terms(Path(model_path), [val])["nll"]
    assert abs(before["val/loss"] - expected) <= RTOL * expected, (before["val/loss"], expected)
    expected = independent_terms(out_dir / "hf", [val])["nll"]
    assert abs(step["val/loss"] - expected) <= RTOL * expected, (step["val/loss"], expected)


def test_moe_router_loss_is_trained_and_logged_separately(tmp_path, model_path, tiny_data):
    """A tiny Qwen2-MoE (random weights, the packaged tokenizer) through the CLI: the start-up
    check passes and the router loss is part of the objective, logged on its own."""
    model_dir = tmp_path / "qwen2-moe"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = transformers.Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    train, val = tiny_data
    out_dir = tmp_path / "run"
    result = run_cli("hpsft.train", base_overrides(str(model_dir), train, val, out_dir, **{"trainer.total_steps": 1}))
    assert result.returncode == 0, result.stderr[-3000:]
    last = read_metrics(out_dir)[-1]
    # Load-balancing loss: num_experts x sum_e(fraction_e x mean probability_e), top_k (= 2) when balanced.
    assert 1.0 < last["train/router_aux_loss"] < 4.0
    expected = last["train/loss"] + 0.02 * last["train/router_aux_loss"]
    assert abs(last["train/objective"] - expected) <= 1e-5 * expected


AGGREGATE_PEAK = 1e12  # trainer.peak_flops_per_device, per rank


def row_counts(model_dir: str, rows: list) -> list[dict]:
    """Each conversation alone through the model's own forward, its logits in fp64: length
    (tokens), loss tokens, and over its loss mask the sums of the NLL, the z-loss (w * lse^2),
    the objective (cross-entropy with label smoothing + z-loss), and the tokens predicted right
    (argmax == target)."""
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    counts = []
    with torch.no_grad():
        for row in rows:
            ids, mask = (torch.tensor(x) for x in tokenize_conversation(tokenizer, row["messages"]))
            supervised = mask[1:].bool()  # position t predicts token t + 1
            logits = lm(input_ids=ids[None], use_cache=False).logits[0, :-1][supervised].double()
            targets = ids[1:][supervised]
            z_loss = float((Z_LOSS_WEIGHT * logits.logsumexp(-1) ** 2).sum())
            smoothed = float(F.cross_entropy(logits, targets, label_smoothing=LABEL_SMOOTHING, reduction="sum"))
            counts.append({"length": ids.numel(), "loss_tokens": int(supervised.sum()),
                           "nll": float(F.cross_entropy(logits, targets, reduction="sum")),
                           "z_loss": z_loss, "objective": smoothed + z_loss,
                           "correct": int((logits.argmax(-1) == targets).sum())})
    return counts


def total(counts: list[dict], key: str) -> float:
    return sum(c[key] for c in counts)


def token_mean_nll(counts: list[dict]) -> float:
    return total(counts, "nll") / total(counts, "loss_tokens")


def training_flops(config, lengths: list[int], loss_tokens: int) -> float:
    """Forward + backward FLOPs of the step counted from the model's config (docs/metrics:
    6 per matmul weight per token, the tied LM head on loss tokens only, causal attention
    6 * layers * hidden * len^2 per sequence); the norms' weights count as body weights, as
    hpsft counts every parameter but the embedding and the head."""
    hidden, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config.intermediate_size + 2 * hidden
    body = config.num_hidden_layers * per_layer + hidden
    head = config.vocab_size * hidden
    attention = 6 * config.num_hidden_layers * hidden * sum(n * n for n in lengths)
    return 6.0 * body * sum(lengths) + 6.0 * head * loss_tokens + attention


def test_aggregates_over_uneven_batches_ranks_and_sources_are_token_sums(tmp_path, model_path, chat_rows):
    """Every aggregate a DP=2 run logs is a token sum over all batches, ranks and sources,
    against counts made here, row by row, from the model's own forward (row_counts): two
    training sources (4 + 2 rows, the whole set each step, so every step is the untrained
    model's on the same rows: lr 1e-30 moves no weight), split over 2 ranks and into token-
    budget micro-batches of uneven sizes; two validation files of 7 and 3 rows, 5 a rank in
    chunks of 3 and 2. Checked: val/loss and val/loss/<file>; train/loss, train/loss/<source>,
    the loss-token and token counts; train/token_accuracy (tokens right / loss tokens);
    perf/tokens_per_s (tokens / step time) and perf/mfu (the step's FLOPs counted from the
    config / step time / both ranks' peaks).
    Planted (each alone): val/loss as the mean of the per-chunk means in validate: 20.3543 vs
    19.2767 (5.3e-2); train/loss as the mean of the per-rank means: 18.0760 vs 18.0830 (3.9e-4);
    train/token_accuracy as the mean of the per-rank ratios: off by 7.3e-6 (exact counts agree
    to 1e-12); the per-source sums taken from rank 0 alone (SAME, not SHARE_PER_SOURCE, in
    StepResult): train/loss_tokens/train_a 28 vs 63; the MFU peak of one device (peak_flops
    SAME, not WORK): perf/mfu 0.5 relative off. Padding counted in train/tokens is planted under SP=2, where rows are padded
    (test_sequence_parallel::test_an_sp2_checkpoint_resumes_with_sp1): at DP=2 without SP no
    step here has padding (perf/padding_efficiency is 1.0)."""
    rows = [{"messages": c} for c in chat_rows[:16]]
    files = {name: write_parquet(part, tmp_path / f"{name}.parquet") for name, part in
             {"train_a": rows[:4], "train_b": rows[4:6], "val_a": rows[6:13], "val_b": rows[13:16]}.items()}
    out_dir = tmp_path / "run"
    proc = run_cli("hpsft.train", base_overrides(model_path, None, None, out_dir, **{
        "data.train_files": f"[{files['train_a']}, {files['train_b']}]",
        "data.val_files": f"[{files['val_a']}, {files['val_b']}]",
        "data.train_batch_size": 6, "data.max_tokens_per_micro_batch": 128, "data.max_length": 128,
        "trainer.total_steps": 2, "optim.lr": 1e-30, "loss.token_accuracy": "true",
        "trainer.export_hf": "false", "trainer.peak_flops_per_device": AGGREGATE_PEAK}), nproc=2)
    assert_ok(proc)
    counts = row_counts(model_path, rows)
    sources = {"train_a": counts[:4], "train_b": counts[4:6], "val_a": counts[6:13], "val_b": counts[13:16]}
    assert max(c["length"] for c in counts) <= 128  # nothing truncated
    train, val = sources["train_a"] + sources["train_b"], sources["val_a"] + sources["val_b"]
    metrics = read_metrics(out_dir)
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    last = metrics[-1]
    assert rel_diff(last["val/loss"], token_mean_nll(val)) <= RTOL, (last["val/loss"], token_mean_nll(val))
    for name in ("val_a", "val_b"):
        expected = token_mean_nll(sources[name])
        assert rel_diff(last[f"val/loss/{name}"], expected) <= RTOL, (name, last[f"val/loss/{name}"], expected)
    config = transformers.AutoConfig.from_pretrained(model_path)
    flops = training_flops(config, [c["length"] for c in train], total(train, "loss_tokens"))
    for m in steps:
        assert m["perf/micro_batches_per_rank"] >= 2
        assert m["train/tokens"] == total(train, "length") and m["train/loss_tokens"] == total(train, "loss_tokens")
        assert rel_diff(m["train/loss"], token_mean_nll(train)) <= RTOL, (m["train/loss"], token_mean_nll(train))
        for name in ("train_a", "train_b"):
            assert m[f"train/loss_tokens/{name}"] == total(sources[name], "loss_tokens"), (name, m)
            expected = token_mean_nll(sources[name])
            assert rel_diff(m[f"train/loss/{name}"], expected) <= RTOL, (name, m[f"train/loss/{name}"], expected)
        accuracy = total(train, "correct") / total(train, "loss_tokens")
        assert abs(m["train/token_accuracy"] - accuracy) <= 1e-12, (m["train/token_accuracy"], accuracy)
        step_time = m["perf/step_time_s"]
        assert rel_diff(m["perf/tokens_per_s"] * step_time, total(train, "length")) <= 1e-9
        assert rel_diff(m["perf/mfu"] * step_time * 2 * AGGREGATE_PEAK, flops) <= 1e-9, (m["perf/mfu"], flops)
