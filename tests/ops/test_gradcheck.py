"""torch.autograd.gradcheck in fp64 on tiny shapes: the C++ kernel's analytic gradients."""

import pytest
import torch

from hpsft.ops import varlen_cross_entropy, varlen_linear_cross_entropy
from varlen_ce_reference import make_batch

OPTIONS = {"label_smoothing": 0.1, "z_loss_weight": 0.01, "softcap": 3.0}


@pytest.mark.parametrize("reduction", ["none", "sum", "seq_mean"])
def test_linear_gradcheck(reduction):
    batch = make_batch(lengths=(4, 0, 1, 3, 5), hidden_size=3, vocab_size=7, fully_masked=(3,), dtype=torch.float64)
    inputs = tuple(t.clone().requires_grad_() for t in (batch.hidden, batch.weight, batch.bias))

    def loss(hidden, weight, bias):
        return varlen_linear_cross_entropy(
            hidden, weight, bias, input_ids=batch.input_ids, offsets=batch.offsets, loss_mask=batch.loss_mask,
            reduction=reduction, backend="cpp", chunk_rows=2, **OPTIONS,
        ).loss

    assert torch.autograd.gradcheck(loss, inputs)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_logits_gradcheck(reduction):
    batch = make_batch(lengths=(4, 1, 3), vocab_size=7, fully_masked=(), dtype=torch.float64)
    logits = torch.randn(len(batch.input_ids), 7, dtype=torch.float64, requires_grad=True)

    def loss(logits):
        return varlen_cross_entropy(
            logits, input_ids=batch.input_ids, offsets=batch.offsets, loss_mask=batch.loss_mask,
            reduction=reduction, backend="cpp", **OPTIONS,
        ).loss

    assert torch.autograd.gradcheck(loss, (logits,))
