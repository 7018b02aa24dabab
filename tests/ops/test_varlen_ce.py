"""Every backend that runs on this machine against the fp64 reference: loss and gradients."""

import pytest
import torch

from hpsft.ops import varlen_cross_entropy, varlen_linear_cross_entropy
from varlen_ce_reference import IGNORE, make_batch, reduce_rows, reference_rows

CPU_BACKENDS = ["torch", "cpp"]
REDUCTIONS = ["none", "sum", "mean", "seq_mean"]
OPTIONS = {
    "plain": {},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss_weight": 0.01},
    "softcap": {"softcap": 2.5},
    "all": {"label_smoothing": 0.2, "z_loss_weight": 0.003, "softcap": 4.0},
}


def assert_close(actual, expected, rtol=1e-5):
    expected = expected.to(actual.dtype)
    atol = rtol * max(expected.abs().max().item(), 1.0) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def upstream_gradient(reduction, total, seed=1):
    # "none" gets a non-uniform per-row gradient: it must not be treated as a scalar.
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(total, generator=gen) if reduction == "none" else torch.tensor(1.7)


def reference(batch, labels, reduction, options, with_bias, denominator=None):
    h = batch.hidden.double().requires_grad_()
    w = batch.weight.double().requires_grad_()
    b = batch.bias.double().requires_grad_()

    def logits_of_rows(start, stop):
        logits = h[start:stop] @ w.t()
        return logits + b if with_bias else logits

    rows, zrows, logprob = reference_rows(logits_of_rows, labels, batch.offsets, **options)
    loss = reduce_rows(rows, labels, batch.offsets, reduction, denominator)
    z_loss = reduce_rows(zrows, labels, batch.offsets, reduction, denominator)
    grads = torch.autograd.grad(loss, (h, w, b), upstream_gradient(reduction, len(labels)).double(), allow_unused=True)
    return loss.detach(), z_loss, logprob, grads


def run_linear(batch, backend, reduction, options, with_bias, use_labels, denominator=None, chunk_rows=3, offsets=None):
    hidden = batch.hidden.clone().requires_grad_()
    weight = batch.weight.clone().requires_grad_()
    bias = batch.bias.clone().requires_grad_() if with_bias else None
    targets = dict(labels=batch.aligned_labels()) if use_labels else dict(input_ids=batch.input_ids, loss_mask=batch.loss_mask)
    out = varlen_linear_cross_entropy(
        hidden, weight, bias, offsets=batch.offsets if offsets is None else offsets, reduction=reduction,
        denominator=denominator, return_logprobs=True, backend=backend, chunk_rows=chunk_rows, **targets, **options,
    )
    params = [p for p in (hidden, weight, bias) if p is not None]
    grads = torch.autograd.grad(out.loss, params, upstream_gradient(reduction, len(batch.input_ids)))
    return out, grads


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(backend, reduction, option, with_bias):
    batch = make_batch()
    labels = batch.aligned_labels()
    out, grads = run_linear(batch, backend, reduction, OPTIONS[option], with_bias, use_labels=False)
    ref_loss, ref_z, ref_logprob, ref_grads = reference(batch, labels, reduction, OPTIONS[option], with_bias)
    assert out.backend == backend
    assert out.n_tokens.dtype == torch.int64 and out.n_tokens.item() == int((labels != IGNORE).sum())
    assert_close(out.loss, ref_loss)
    assert_close(out.z_loss, ref_z)
    assert_close(out.logprobs, ref_logprob)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "seq_mean"])
def test_explicit_denominator_with_labels(backend, reduction):
    # A global denominator (e.g. all-reduced over ranks) replaces the local count.
    batch = make_batch(seed=3)
    labels = batch.aligned_labels()
    out, grads = run_linear(batch, backend, reduction, {}, True, use_labels=True, denominator=11)
    ref_loss, _, _, ref_grads = reference(batch, labels, reduction, {}, True, denominator=11)
    assert_close(out.loss, ref_loss)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("chunk_rows", [None, 1, 1000])
def test_chunking_does_not_change_the_result(backend, chunk_rows):
    batch = make_batch(seed=4)
    out, grads = run_linear(batch, backend, "sum", OPTIONS["all"], True, use_labels=False, chunk_rows=chunk_rows)
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", OPTIONS["all"], True)
    assert_close(out.loss, ref_loss)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", ["plain", "all"])
def test_logits_api_matches_reference(backend, reduction, option):
    batch = make_batch(seed=5)
    labels = batch.aligned_labels()
    logits = (batch.hidden @ batch.weight.t() + batch.bias).requires_grad_()
    out = varlen_cross_entropy(
        logits, input_ids=batch.input_ids, loss_mask=batch.loss_mask, offsets=batch.offsets,
        reduction=reduction, return_logprobs=True, backend=backend, **OPTIONS[option],
    )
    (grad,) = torch.autograd.grad(out.loss, logits, upstream_gradient(reduction, len(labels)))
    ref_logits = logits.detach().double().requires_grad_()
    rows, zrows, logprob = reference_rows(lambda s, e: ref_logits[s:e], labels, batch.offsets, **OPTIONS[option])
    ref_loss = reduce_rows(rows, labels, batch.offsets, reduction)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits, upstream_gradient(reduction, len(labels)).double())
    assert out.backend == backend
    assert_close(out.loss, ref_loss.detach())
    assert_close(out.z_loss, reduce_rows(zrows, labels, batch.offsets, reduction))
    assert_close(out.logprobs, logprob)
    assert_close(grad, ref_grad)


def test_auto_picks_the_cpp_kernel_on_cpu():
    batch = make_batch()
    out = varlen_linear_cross_entropy(batch.hidden, batch.weight, input_ids=batch.input_ids, offsets=batch.offsets, loss_mask=batch.loss_mask)
    assert out.backend == "cpp"
