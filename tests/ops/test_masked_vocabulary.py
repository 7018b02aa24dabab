"""-inf logits (a masked vocabulary) on every CPU backend, against the fp64 reference.

The C++ kernel reduces 2048-wide vocabulary chunks: masking the whole first chunk checks the
case where a chunk's max is -inf as well as scattered masked entries.
"""

import pytest
import torch

from hpsft.ops import varlen_cross_entropy
from test_varlen_ce import CPU_BACKENDS, assert_close, reference, run_linear
from varlen_ce_reference import IGNORE, make_batch, reference_rows

VOCAB = 2053 + 2048  # three C++ chunks, the last ragged
MASKED = torch.cat([torch.arange(0, 2048), torch.arange(2050, VOCAB, 7)])  # first chunk, then scattered


def masked_batch():
    """Every row's logits are -inf on MASKED (through the bias); no label is a masked entry."""
    batch = make_batch(lengths=(6, 3, 5), hidden_size=8, vocab_size=VOCAB, fully_masked=())
    allowed = torch.ones(VOCAB, dtype=torch.bool)
    allowed[MASKED] = False
    batch.input_ids = allowed.nonzero().squeeze(1)[batch.input_ids % int(allowed.sum())]
    batch.bias[MASKED] = float("-inf")
    return batch


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "options",
    [{}, {"z_loss_weight": 0.01}, {"label_smoothing": 0.1}, {"softcap": 3.0}, {"softcap": 3.0, "label_smoothing": 0.1}],
    # Smoothing spreads over the finite logits; softcap maps -inf to -softcap, a finite logit.
    ids=["plain", "z_loss", "smoothing", "softcap", "softcap+smoothing"],
)
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_minus_inf_logits_match_the_reference(backend, options, reduction):
    batch = masked_batch()
    out, grads = run_linear(batch, backend, reduction, options, True, use_labels=False)
    ref_loss, _, ref_logprob, ref_grads = reference(batch, batch.aligned_labels(), reduction, options, True)
    assert torch.isfinite(out.loss).all() and all(torch.isfinite(g).all() for g in grads)
    assert_close(out.loss, ref_loss)
    assert_close(out.logprobs, ref_logprob)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected)
    if "softcap" not in options:  # a masked logit has probability 0, hence no gradient
        assert torch.all(grads[2][MASKED].abs() < 1e-30)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_minus_inf_target_gives_inf_loss_and_finite_gradients_like_torch(backend):
    batch = masked_batch()
    labels = batch.aligned_labels()
    first = int((labels != IGNORE).nonzero()[0])
    labels[first] = int(MASKED[5])
    logits = (batch.hidden @ batch.weight.t() + batch.bias).requires_grad_()
    out = varlen_cross_entropy(logits, labels=labels, offsets=batch.offsets, reduction="none", backend=backend)
    (grad,) = torch.autograd.grad(out.loss.sum(), logits)
    ref_logits = logits.detach().double().requires_grad_()
    ref_rows, _, _ = reference_rows(lambda a, b: ref_logits[a:b], labels, batch.offsets)
    (ref_grad,) = torch.autograd.grad(ref_rows.sum(), ref_logits)
    assert torch.isinf(out.loss[first]) and torch.isinf(ref_rows[first])
    finite = torch.arange(len(labels)) != first
    assert_close(out.loss[finite], ref_rows[finite])
    assert torch.isfinite(grad).all()
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_label_smoothing_over_minus_inf_logits_on_given_logits(backend):
    batch = masked_batch()
    labels = batch.aligned_labels()
    logits = (batch.hidden @ batch.weight.t() + batch.bias).requires_grad_()
    out = varlen_cross_entropy(logits, labels=labels, offsets=batch.offsets, reduction="none", label_smoothing=0.1, backend=backend)
    (grad,) = torch.autograd.grad(out.loss.sum(), logits)
    ref_logits = logits.detach().double().requires_grad_()
    ref_rows, _, _ = reference_rows(lambda a, b: ref_logits[a:b], labels, batch.offsets, label_smoothing=0.1)
    (ref_grad,) = torch.autograd.grad(ref_rows.sum(), ref_logits)
    assert torch.isfinite(out.loss).all() and torch.isfinite(grad).all()
    assert_close(out.loss, ref_rows)
    assert_close(grad, ref_grad)
    assert torch.all(grad[:, MASKED].abs() < 1e-30)  # masked entries get no share of the smoothing


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_row_of_only_minus_inf_is_nan_like_torch_and_leaves_other_rows_alone(backend):
    batch = make_batch(lengths=(4, 5), fully_masked=())
    labels = batch.aligned_labels()
    logits = batch.hidden @ batch.weight.t() + batch.bias
    row = int((labels != IGNORE).nonzero()[0])
    logits[row] = float("-inf")
    out = varlen_cross_entropy(logits, labels=labels, offsets=batch.offsets, reduction="none", backend=backend)
    ref_rows, _, _ = reference_rows(lambda a, b: logits[a:b].double(), labels, batch.offsets)
    assert torch.isnan(out.loss[row]) and torch.isnan(ref_rows[row])
    others = torch.arange(len(labels)) != row
    assert_close(out.loss[others], ref_rows[others])
