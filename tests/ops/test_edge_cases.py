"""Edge cases of the varlen cross-entropy on every CPU backend."""

import pytest
import torch

from hpsft.ops import varlen_cross_entropy, varlen_linear_cross_entropy
from test_varlen_ce import CPU_BACKENDS, REDUCTIONS, assert_close, reference, run_linear
from varlen_ce_reference import make_batch


def test_the_batch_has_the_edge_cases_the_suite_relies_on():
    batch = make_batch()
    lengths = (batch.offsets[1:] - batch.offsets[:-1]).tolist()
    assert 0 in lengths and 1 in lengths
    assert batch.loss_mask[batch.offsets[4] : batch.offsets[5]].sum() == 0 and lengths[4] > 0
    assert (batch.aligned_labels() == batch.weight.shape[0] - 1).any()  # label V-1 is used


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nothing_supervised_gives_zero_loss_and_gradients(backend, reduction):
    batch = make_batch(fully_masked=range(6))
    out, grads = run_linear(batch, backend, reduction, {"z_loss_weight": 0.1}, True, use_labels=False)
    assert out.n_tokens.item() == 0
    assert torch.all(out.loss == 0) and torch.all(out.z_loss == 0)
    for grad in grads:
        assert torch.all(grad == 0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_vocabulary_not_a_multiple_of_the_chunk(backend):
    # 2053 = 2048 + 5: the C++ kernel's last vocabulary chunk is a ragged one.
    batch = make_batch(lengths=(6, 3), hidden_size=8, vocab_size=2053, fully_masked=())
    out, grads = run_linear(batch, backend, "sum", {"label_smoothing": 0.1, "softcap": 3.0}, True, use_labels=False)
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", {"label_smoothing": 0.1, "softcap": 3.0}, True)
    assert_close(out.loss, ref_loss)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_large_common_logit_offset_is_stable(backend, dtype):
    # +1e4 on every logit would overflow a naive exp; the loss must not change. In fp32 the
    # logits themselves round to ~1e-3 at 1e4, which bounds the achievable agreement.
    batch = make_batch(dtype=dtype)
    batch.bias = batch.bias + 1e4
    options = {"label_smoothing": 0.1, "z_loss_weight": 1e-9}
    out, grads = run_linear(batch, backend, "sum", options, True, use_labels=False)
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", options, True)
    assert torch.isfinite(out.loss)
    rtol = 1e-9 if dtype == torch.float64 else 2e-3
    assert_close(out.loss, ref_loss, rtol=rtol)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected, rtol=rtol)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_int32_offsets(backend):
    batch = make_batch()
    out, grads = run_linear(batch, backend, "mean", {}, False, use_labels=False, offsets=batch.offsets.int())
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "mean", {}, False)
    assert_close(out.loss, ref_loss)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_contiguous_inputs(backend):
    batch = make_batch()
    total, hidden_size = batch.hidden.shape
    # Every input is a strided view of a larger tensor.
    hidden = torch.zeros(hidden_size, total * 2).t()[::2]
    hidden.copy_(batch.hidden)
    weight = torch.zeros(batch.weight.shape[0], hidden_size * 3)[:, ::3]
    weight.copy_(batch.weight)
    ids = torch.zeros(total, 2, dtype=torch.long)[:, 1]
    ids.copy_(batch.input_ids)
    mask = torch.zeros(total, 2, dtype=torch.long)[:, 0]
    mask.copy_(batch.loss_mask)
    assert not (hidden.is_contiguous() or weight.is_contiguous() or ids.is_contiguous() or mask.is_contiguous())
    hidden.requires_grad_()
    weight.requires_grad_()
    out = varlen_linear_cross_entropy(hidden, weight, input_ids=ids, offsets=batch.offsets, loss_mask=mask, backend=backend, chunk_rows=4)
    grads = torch.autograd.grad(out.loss * 1.7, (hidden, weight))
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", {}, False)
    assert_close(out.loss, ref_loss)
    for actual, expected in zip(grads, ref_grads[:2]):
        assert_close(actual, expected)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nested_jagged_hidden_uses_its_offsets(backend):
    batch = make_batch(lengths=(5, 1, 7, 9), fully_masked=(2,))
    rows = batch.hidden.split((batch.offsets[1:] - batch.offsets[:-1]).tolist())
    nested = torch.nested.nested_tensor(list(rows), layout=torch.jagged)
    out = varlen_linear_cross_entropy(nested, batch.weight, input_ids=batch.input_ids, loss_mask=batch.loss_mask, backend=backend)
    flat = varlen_linear_cross_entropy(
        batch.hidden, batch.weight, input_ids=batch.input_ids, offsets=batch.offsets, loss_mask=batch.loss_mask, backend=backend
    )
    assert_close(out.loss, flat.loss)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_inputs_compute_in_fp32(backend):
    batch = make_batch()
    hidden = batch.hidden.bfloat16().requires_grad_()
    weight = batch.weight.bfloat16().requires_grad_()
    out = varlen_linear_cross_entropy(hidden, weight, input_ids=batch.input_ids, offsets=batch.offsets, loss_mask=batch.loss_mask, backend=backend)
    grad_h, grad_w = torch.autograd.grad(out.loss * 1.7, (hidden, weight))  # the reference uses 1.7
    assert out.loss.dtype == torch.float32 and grad_h.dtype == torch.bfloat16 and grad_w.dtype == torch.bfloat16
    batch.hidden, batch.weight = hidden.detach().float(), weight.detach().float()
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", {}, False)
    assert_close(out.loss, ref_loss)
    assert_close(grad_h.float(), ref_grads[0], rtol=1e-2)  # bf16 rounding of the returned gradient


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_logits_api_with_nothing_supervised(backend):
    batch = make_batch(fully_masked=range(6))
    logits = torch.randn(len(batch.input_ids), 37, requires_grad=True)
    out = varlen_cross_entropy(logits, input_ids=batch.input_ids, loss_mask=batch.loss_mask, offsets=batch.offsets, reduction="mean", backend=backend)
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert out.loss.item() == 0 and torch.all(grad == 0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backward_twice_through_a_retained_graph(backend):
    # The first backward consumes the gradients finished in forward; the second recomputes them.
    batch = make_batch()
    hidden = batch.hidden.clone().requires_grad_()
    weight = batch.weight.clone().requires_grad_()
    out = varlen_linear_cross_entropy(hidden, weight, input_ids=batch.input_ids, offsets=batch.offsets, loss_mask=batch.loss_mask, backend=backend)
    first = torch.autograd.grad(out.loss * 1.7, (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(out.loss * 1.7, (hidden, weight))
    _, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", {}, False)
    for grads in (first, second):
        for actual, expected in zip(grads, ref_grads[:2]):
            assert_close(actual, expected)
