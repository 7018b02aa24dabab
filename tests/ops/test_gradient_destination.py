"""grad_scale (gradients made at forward for a promised upstream gradient) and grad_weight_into
(d(weight) summed into a caller's fp32 tensor), against the fp64 reference.

The reference is the gradient of grad_scale x loss, by autograd on the plain fp64 expression.
"""

import pytest
import torch

from hpsft.ops import varlen_linear_cross_entropy
from test_bf16_gemms import bf16_batch, fp32_view
from test_varlen_ce import OPTIONS, assert_close, reference
from varlen_ce_reference import make_batch

GRAD_SCALE = 0.37


def reference_scaled(batch, reduction, options):
    loss, _, _, grads = reference(batch, batch.aligned_labels(), reduction, options, True)
    upstream = 1.7  # reference()'s scalar upstream gradient for reduced losses
    return loss, [g * (GRAD_SCALE / upstream) for g in grads]


def run(batch, reduction="sum", options=None, grad_weight_into=None, upstream=GRAD_SCALE, gemm_dtype=None, backend="cpp"):
    hidden, weight, bias = (getattr(batch, k).clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    out = varlen_linear_cross_entropy(
        hidden, weight, bias, input_ids=batch.input_ids, loss_mask=batch.loss_mask, offsets=batch.offsets,
        reduction=reduction, backend=backend, chunk_rows=4, gemm_dtype=gemm_dtype, grad_scale=GRAD_SCALE,
        grad_weight_into=grad_weight_into, **(options or {}),
    )
    (out.loss * (upstream / GRAD_SCALE) * GRAD_SCALE).backward()  # a caller's own arithmetic for the upstream value
    return out, hidden.grad, weight.grad, bias.grad


@pytest.mark.parametrize("reduction", ["sum", "mean", "seq_mean"])
@pytest.mark.parametrize("option", ["plain", "all"])
def test_gradients_made_for_grad_scale_equal_the_reference(reduction, option):
    """Catches grad_scale left out of the row scale (gradients 1/0.37 too large) or applied
    twice, and a loss value scaled with the gradients."""
    batch = make_batch()
    out, *grads = run(batch, reduction, OPTIONS[option])
    ref_loss, ref_grads = reference_scaled(batch, reduction, OPTIONS[option])
    assert_close(out.loss, ref_loss)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected)


def test_another_upstream_gradient_is_refused():
    with pytest.raises(RuntimeError, match="grad_scale"):
        run(make_batch(), upstream=2 * GRAD_SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_tensor_core_design"])
def test_weight_gradient_is_added_into_the_given_tensor(dtype):
    """Catches d(weight) written over the tensor instead of added (the engine's buffer holds
    other micro-batches' and the tied embedding's gradients), a missing scale, and a
    gradient also returned for the weight (it would be counted twice)."""
    batch = make_batch() if dtype == torch.float32 else bf16_batch()
    held = torch.randn(batch.weight.shape, generator=torch.Generator().manual_seed(3))
    into = held.clone()
    gemm_dtype = dtype if dtype != torch.float32 else None
    out, grad_hidden, grad_weight, grad_bias = run(batch, "sum", OPTIONS["all"], grad_weight_into=into, gemm_dtype=gemm_dtype)
    assert grad_weight is None
    ref_loss, (ref_hidden, ref_weight, ref_bias) = reference_scaled(fp32_view(batch), "sum", OPTIONS["all"])
    rtol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: d(logits) rounded once (test_bf16_gemms.py)
    assert_close(out.loss, ref_loss, rtol=1e-5)
    assert_close(into - held, ref_weight.float(), rtol=rtol)
    assert_close(grad_hidden.float(), ref_hidden.float(), rtol=rtol)
    assert_close(grad_bias.float(), ref_bias.float(), rtol=rtol)


def test_bad_destinations_are_refused():
    batch = make_batch()
    weight = batch.weight
    cases = [
        ({"grad_weight_into": torch.zeros_like(weight)}, "needs grad_scale"),
        ({"grad_scale": 1.0, "grad_weight_into": torch.zeros_like(weight, dtype=torch.float64)}, "float32"),
        ({"grad_scale": 1.0, "grad_weight_into": torch.zeros(weight.shape[0] + 1, weight.shape[1])}, "shape"),
        ({"grad_scale": 0.0}, "positive"),
        ({"grad_scale": 1.0, "reduction": "none"}, "reduced loss"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            varlen_linear_cross_entropy(batch.hidden, weight, input_ids=batch.input_ids, loss_mask=batch.loss_mask,
                                        offsets=batch.offsets, **kwargs)
