"""Honest metrics through the real CLI: val/loss is the plain NLL (checked against the
exported model's own Hugging Face loss), and the other terms of the objective are logged
under their own names, the MoE router loss included."""

from pathlib import Path

import pyarrow.parquet as pq
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpsft.data.chat_tokenize import tokenize_conversation
from tests.conftest import base_overrides, read_metrics, run_cli


def independent_nll(model_dir: Path, files: list[str]) -> float:
    """Token-mean NLL of the conversations in `files` under the model in `model_dir`, each
    conversation alone through the model's own forward with masked labels."""
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    nll_sum, n_tokens = 0.0, 0
    with torch.no_grad():
        for path in files:
            for row in pq.read_table(path).to_pylist():
                ids, mask = (torch.tensor(x) for x in tokenize_conversation(tokenizer, row["messages"]))
                labels = torch.where(mask.bool(), ids, -100)
                n = int(mask[1:].sum())
                nll_sum += float(lm(input_ids=ids[None], labels=labels[None], use_cache=False).loss) * n
                n_tokens += n
    return nll_sum / n_tokens


def test_val_loss_is_the_plain_nll_and_other_terms_have_their_own_names(tmp_path, model_path, tiny_data):
    train, val = tiny_data
    out_dir = tmp_path / "run"
    # z-loss and label smoothing on: were they in val/loss or train/loss, the checks below fail.
    result = run_cli("hpsft.train", base_overrides(model_path, train, val, out_dir, **{
        "trainer.total_steps": 1, "loss.z_loss_weight": 1e-3, "loss.label_smoothing": 0.1,
        "trainer.val_before_train": "true"}))
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = read_metrics(out_dir)[0], read_metrics(out_dir)[-1]
    reference = independent_nll(out_dir / "hf", [val])
    assert abs(last["val/loss"] - reference) <= 1e-5 * reference, (last["val/loss"], reference)
    # trainer.val_before_train: step 0 holds the untrained model's val/loss.
    assert first["step"] == 0 and set(first) == {"step", "val/loss"}
    untrained = independent_nll(Path(model_path), [val])
    assert abs(first["val/loss"] - untrained) <= 1e-5 * untrained, (first["val/loss"], untrained)
    assert last["train/z_loss"] > 0
    # Smoothing spreads 10% of the target mass over the vocabulary: the objective is far above the NLL.
    assert last["train/objective"] > last["train/loss"] + 0.1


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
