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
from tests.conftest import base_overrides, read_metrics, run_cli, write_parquet

Z_LOSS_WEIGHT, LABEL_SMOOTHING = 1e-3, 0.1
RTOL = 1e-5  # hpsft's fp32 sums against the fp64 reference


def independent_terms(model_dir: Path, files: list[str]) -> dict:
    """Token means over the conversations in `files` under the model in `model_dir`, each
    conversation alone through the model's own forward, from its logits in fp64 (docs/ops.md):
    nll; z_loss = w * lse^2; objective = F.cross_entropy with label smoothing + w * lse^2."""
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sums, n_tokens = {"nll": 0.0, "z_loss": 0.0, "objective": 0.0}, 0
    with torch.no_grad():
        for path in files:
            for row in pq.read_table(path).to_pylist():
                ids, mask = (torch.tensor(x) for x in tokenize_conversation(tokenizer, row["messages"]))
                supervised = mask[1:].bool()  # position t predicts token t + 1
                logits = lm(input_ids=ids[None], use_cache=False).logits[0, :-1][supervised].double()
                targets = ids[1:][supervised]
                z_loss = Z_LOSS_WEIGHT * logits.logsumexp(-1) ** 2
                sums["nll"] += float(F.cross_entropy(logits, targets, reduction="sum"))
                sums["z_loss"] += float(z_loss.sum())
                smoothed = F.cross_entropy(logits, targets, label_smoothing=LABEL_SMOOTHING, reduction="sum")
                sums["objective"] += float(smoothed + z_loss.sum())
                n_tokens += int(supervised.sum())
    return {name: value / n_tokens for name, value in sums.items()}


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
