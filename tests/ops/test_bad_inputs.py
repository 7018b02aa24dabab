"""Malformed inputs fail with a ValueError that names what to fix, before any kernel runs."""

import re

import pytest
import torch

from hpsft.ops import varlen_cross_entropy, varlen_linear_cross_entropy
from varlen_ce_reference import make_batch


def call(batch=None, **overrides):
    batch = batch or make_batch()
    kwargs = dict(
        hidden=batch.hidden, weight=batch.weight, input_ids=batch.input_ids, offsets=batch.offsets,
        loss_mask=batch.loss_mask, backend="cpp",
    )
    kwargs.update(overrides)
    return varlen_linear_cross_entropy(kwargs.pop("hidden"), kwargs.pop("weight"), **kwargs)


BATCH = make_batch()
T, H = BATCH.hidden.shape
V = BATCH.weight.shape[0]
CASES = {
    "hidden size differs": (dict(weight=torch.randn(V, H + 1)), "same H"),
    "hidden not 2-D": (dict(hidden=torch.randn(T, H, 1)), "hidden must be"),
    "bias shape": (dict(bias=torch.randn(V + 1)), "bias must have shape"),
    "input_ids length": (dict(input_ids=BATCH.input_ids[:-1]), "input_ids must have shape"),
    "loss_mask length": (dict(loss_mask=BATCH.loss_mask[1:]), "loss_mask must have shape"),
    "offsets not monotone": (dict(offsets=torch.tensor([0, 9, 5, T])), "non-decreasing"),
    "offsets not ending at T": (dict(offsets=torch.tensor([0, 5, T - 1])), "end at the number of tokens"),
    "offsets not starting at 0": (dict(offsets=torch.tensor([1, 5, T])), "start at 0"),
    "offsets float": (dict(offsets=BATCH.offsets.float()), "int32 or int64"),
    "offsets missing": (dict(offsets=None), "offsets"),
    "input id out of range": (dict(input_ids=torch.full((T,), V)), "must lie in [0, 37)"),
    "negative label": (dict(input_ids=None, loss_mask=None, labels=torch.full((T,), -3)), "must lie in [0, 37)"),
    "label too large": (dict(input_ids=None, loss_mask=None, labels=torch.full((T,), V)), "must lie in [0, 37)"),
    "labels and input_ids": (dict(labels=BATCH.aligned_labels()), "not both"),
    "no targets": (dict(input_ids=None, loss_mask=None), "pass input_ids and loss_mask"),
    "unknown reduction": (dict(reduction="avg"), "reduction must be one of"),
    "denominator with sum": (dict(denominator=4), "denominator only applies"),
    "zero denominator": (dict(reduction="mean", denominator=0), "denominator must be positive"),
    "label smoothing": (dict(label_smoothing=1.5), "label_smoothing must be in"),
    "negative z-loss": (dict(z_loss_weight=-1.0), "z_loss_weight must be"),
    "unknown backend": (dict(backend="cudnn"), "backend must be one of"),
    "chunk rows": (dict(chunk_rows=0), "chunk_rows must be"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_raises_value_error(case):
    overrides, message = CASES[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        call(**overrides)


def test_logits_api_checks_labels_against_its_vocabulary():
    with pytest.raises(ValueError, match="must lie in"):
        varlen_cross_entropy(torch.randn(T, 5), input_ids=BATCH.input_ids, loss_mask=torch.ones(T), offsets=BATCH.offsets)


def test_gpu_backend_on_cpu_tensors_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="backend='triton' cannot run"):
        call(backend="triton")


def test_the_removed_cuda_backend_is_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        call(backend="cuda")


def test_cpp_kernel_rejects_out_of_range_labels_itself():
    # The native entry point checks too, in case it is ever called without the Python checks.
    from hpsft.ops.row_kernel_cpp import cpp_rows_forward_
    from hpsft.ops.row_options import RowOptions

    with pytest.raises(ValueError, match="labels must lie in"):
        cpp_rows_forward_(torch.randn(2, 5), torch.tensor([0, 5]), torch.ones(2), RowOptions(), True)
