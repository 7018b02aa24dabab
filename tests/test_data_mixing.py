"""Weighted multi-dataset mixing and custom dataset classes (docs/data.md): the sampled
ratio, the resumable position, per-dataset losses, and a user's class trained on."""

import math

import pytest
import torch

from tests.conftest import REPO, base_overrides, read_metrics, run_cli, write_jsonl
from tests.test_spmd_training import assert_ok

EXAMPLE = REPO / "examples" / "custom_dataset.py"
BROKEN = REPO / "tests" / "data" / "malformed" / "broken_dataset.py"


def test_weights_3_to_1_give_a_binomial_ratio_and_each_source_is_drawn_without_replacement():
    """400 draws from two sources of 200 weighted 3:1: the first source's count is
    Binomial(400, 3/4) (mean 300, sigma sqrt(400 * 3/4 * 1/4) = 8.66), within 4 sigma; each
    source goes through its samples before repeating one."""
    from hpsft.data.sampler import mixture_order

    order = mixture_order([200, 200], [3.0, 1.0], seed=42, epoch=0, shuffle=True)
    assert order.numel() == 400
    first = order[order < 200]
    sigma = math.sqrt(400 * 0.75 * 0.25)
    assert abs(first.numel() - 300) <= 4 * sigma, first.numel()
    assert first[:200].unique().numel() == 200  # a whole pass over source 0 before any repeat
    second = order[order >= 200]
    assert second.unique().numel() == second.numel()  # fewer than 200 draws: none repeated
    # Fixed by (seed, epoch): the same again, another epoch another order.
    assert torch.equal(order, mixture_order([200, 200], [3.0, 1.0], seed=42, epoch=0, shuffle=True))
    assert not torch.equal(order, mixture_order([200, 200], [3.0, 1.0], seed=42, epoch=1, shuffle=True))


def test_the_example_class_passes_the_check_and_a_broken_one_is_refused_by_name():
    from hpsft.data.custom_dataset import load_custom_class
    from hpsft.utils.errors import UserInputError

    assert load_custom_class(str(EXAMPLE), "TextDataset").__name__ == "TextDataset"
    with pytest.raises(UserInputError, match=f"class NoGetItem in {BROKEN} has no __getitem__ method"):
        load_custom_class(str(BROKEN), "NoGetItem")
    with pytest.raises(UserInputError, match="defines no class 'Missing'"):
        load_custom_class(str(EXAMPLE), "Missing")


LOSS_RTOL = 1e-5  # hpsft's fp32 sums against the reference's


def independent_nll(model_path, examples: list[dict]) -> float:
    """Token-mean NLL of these examples ({input_ids, loss_mask}), each alone through the model's
    own Hugging Face forward with labels masked by loss_mask."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    nll_sum, n_tokens = 0.0, 0
    with torch.no_grad():
        for example in examples:
            ids, mask = example["input_ids"], example["loss_mask"]
            labels = torch.where(mask, ids, -100)
            n = int(mask[1:].sum())  # the first token is predicted by nothing
            nll_sum += float(lm(input_ids=ids[None], labels=labels[None], use_cache=False).loss) * n
            n_tokens += n
    return nll_sum / n_tokens


def test_a_custom_class_mixture_trains_its_rows_and_logs_per_dataset_losses(tmp_path, model_path, tokenizer):
    """A 3:1 mixture of two text files read by the example class (every token supervised, one
    repeated text per file): each step's loss tokens per dataset are exactly what the sampler's
    picks of that class's rows hold; step 1 (untrained weights) logs as train/loss/<name> the
    NLL of that source's text alone, and step 0 (trainer.val_before_train) as val/loss/<name>
    the NLL of that validation file alone, each from the model's own forward. Planted: each
    sequence's NLL credited to the source of the sequence before it in the batch, in the
    worker's source_sums (failed on train/loss/short) and in validate (failed on
    val/loss/val_a); the token-weighted sums over sources checked before matched either way."""
    from hpsft.config.schema import DataConfig
    from hpsft.data.custom_dataset import load_custom_class
    from hpsft.data.sampler import mixture_order

    write = write_jsonl
    text_dataset = load_custom_class(str(EXAMPLE), "TextDataset")
    short = write([{"text": " ".join(["hello"] * 6)}] * 12, tmp_path / "short.jsonl")
    long = write([{"text": " ".join(["world"] * 20)}] * 12, tmp_path / "long.jsonl")
    val_a = write([{"text": "a b c"}] * 3, tmp_path / "val_a.jsonl")
    val_b = write([{"text": "one two three four five six"}] * 2, tmp_path / "val_b.jsonl")
    data_config = DataConfig(max_length=256)

    def examples(path) -> list[dict]:
        dataset = text_dataset([path], tokenizer, data_config)
        return [dataset[i] for i in range(len(dataset))]

    def supervised_tokens(path) -> int:  # of one row: targets are every token but the first
        return len(examples(path)[0]["input_ids"]) - 1

    short_len, long_len = supervised_tokens(short), supervised_tokens(long)
    assert short_len != long_len
    out = tmp_path / "run"
    steps, batch = 3, 8
    proc = run_cli("hpsft.train", base_overrides(
        model_path, None, None, out, **{
            "data.train_files": f"[{{path: {short}, weight: 3, name: short}}, {{path: {long}, weight: 1}}]",
            "data.val_files": f"[{val_a}, {val_b}]", "trainer.val_before_train": "true",
            "data.custom_cls.path": str(EXAMPLE), "data.custom_cls.name": "TextDataset",
            "trainer.total_steps": steps, "trainer.export_hf": "false", "trainer.peak_flops_per_device": "1e12",
        }))
    assert_ok(proc)
    metrics = read_metrics(out)
    train = [m for m in metrics if "train/loss" in m]
    assert len(train) == steps
    order = mixture_order([12, 12], [3.0, 1.0], seed=42, epoch=0, shuffle=True)
    for step, m in enumerate(train):
        picks = order[step * batch:(step + 1) * batch]
        n_short = int((picks < 12).sum())
        expected = {"short": n_short * short_len, "long": (batch - n_short) * long_len}
        assert m["train/loss_tokens"] == sum(expected.values())
        for name, tokens in expected.items():
            assert m.get(f"train/loss_tokens/{name}", 0) == tokens, (step, name, m)
    assert 0 < train[0]["train/loss_tokens/long"] < train[0]["train/loss_tokens"]  # step 1 draws from both
    for name, path in {"short": short, "long": long}.items():
        reference = independent_nll(model_path, examples(path)[:1])  # every row of a file is the same text
        assert abs(train[0][f"train/loss/{name}"] - reference) <= LOSS_RTOL * reference, (name, train[0], reference)
    [untrained] = [m for m in metrics if m["step"] == 0]
    for name, path in {"val_a": val_a, "val_b": val_b}.items():
        reference = independent_nll(model_path, examples(path))
        assert abs(untrained[f"val/loss/{name}"] - reference) <= LOSS_RTOL * reference, (name, untrained, reference)


def test_step_results_combine_over_ranks_by_their_fields_rule():
    """The Ray driver's combination of its workers' results and SPMD's one all-reduce of the
    flattened values (here in one process: the sum over one rank) follow each field's rule:
    shares added up (per source element-wise), memory the largest rank's, the global norm and
    the learning rate taken from one; a TP rank after the first counts no share, only its work."""
    from hpsft.workers.step_result import SHARE, StepResult

    def rank_result(nll, tokens, **extra):
        return StepResult(**{**{name: 1.0 for name in StepResult.names(SHARE)}, "flops": 5.0, "peak_flops": 9.0,
                             "source_nll_sums": nll, "source_loss_tokens": tokens, "rss_anon_bytes": 7,
                             "micro_batches": 2, "grad_norm": 0.5, "lr": 1e-3, **extra})

    total = StepResult.combine([rank_result([1.5, 0.0], [3, 0]), rank_result([2.0, 4.0], [1, 2], rss_anon_bytes=9)])
    assert total.source_nll_sums == [3.5, 4.0] and total.source_loss_tokens == [4, 2]
    assert total.nll_sum == 2.0 and total.flops == 10.0 and total.rss_anon_bytes == 9
    assert total.grad_norm == 0.5 and total.lr == 1e-3 and total.micro_batches == 2
    reduced = rank_result([1.5, 0.0, 2.5], [3, 0, 5], nll_sum=4.0).all_reduced()
    assert reduced.source_nll_sums == [1.5, 0.0, 2.5] and reduced.source_loss_tokens == [3, 0, 5]
    assert reduced.nll_sum == 4.0 and reduced.loss_tokens == 1.0 and reduced.rss_anon_bytes == 7
    second_tp_rank = rank_result([1.5, 2.0], [3, 1]).counted_once(reports=False)
    assert second_tp_rank.loss_tokens == 0 and second_tp_rank.source_loss_tokens == [0.0, 0.0]
    assert second_tp_rank.flops == 5.0 and second_tp_rank.grad_norm == 0.5
