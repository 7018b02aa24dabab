"""bf16 inputs through both GEMM designs of fused_linear_ce, against the fp64 reference.

gemm_dtype=float32 is the CPU design (operands upcast); gemm_dtype=bfloat16 is the CUDA
tensor-core design (16-bit operands, fp32 accumulation and fp32 logit blocks, d(logits)
rounded to bf16 before its two GEMMs), which on CPU runs the same arithmetic with the
operands upcast per GEMM. The reference sees the same bf16-rounded inputs in fp64.

Tolerances, stated per quantity:
- loss and logprobs, 1e-5 relative for both designs: the logits are exact products summed in
  fp32. A design that rounds the logits to bf16 (what a 16-bit GEMM output gives) misses this
  by two orders of magnitude; the last test shows it on the same batch, so the tolerance can
  tell the designs apart.
- gradients, 1e-2 of the largest entry: they are returned in bf16 (relative step 2^-8);
  the tensor-core design adds one bf16 rounding of d(logits) (2^-9) before fp32 sums.
"""

import pytest
import torch

from hpsft.ops import varlen_linear_cross_entropy
from test_varlen_ce import assert_close, reference, upstream_gradient
from varlen_ce_reference import make_batch

GEMM_DTYPES = [torch.float32, torch.bfloat16]
OPTIONS = {"plain": {}, "all": {"label_smoothing": 0.1, "z_loss_weight": 0.003, "softcap": 4.0}}


def bf16_batch():
    # V = 600 and H = 64: logit sums long enough that bf16 rounding of the logits shows.
    batch = make_batch(lengths=(9, 0, 4, 12), hidden_size=64, vocab_size=600, fully_masked=())
    for name in ("hidden", "weight", "bias"):
        setattr(batch, name, getattr(batch, name).bfloat16())
    return batch


def fp32_view(batch):
    """The same bf16 values in fp32, for the reference (which upcasts them to fp64)."""
    return type(batch)(**{**vars(batch), **{k: getattr(batch, k).float() for k in ("hidden", "weight", "bias")}})


@pytest.mark.parametrize("gemm_dtype", GEMM_DTYPES, ids=["fp32_gemms", "bf16_gemms"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_bf16_inputs_match_the_fp64_reference(gemm_dtype, option, reduction):
    # The GEMM design is the host driver's, the same for every row kernel: the C++ one here.
    batch = bf16_batch()
    hidden, weight, bias = (getattr(batch, k).clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    out = varlen_linear_cross_entropy(
        hidden, weight, bias, input_ids=batch.input_ids, loss_mask=batch.loss_mask, offsets=batch.offsets,
        reduction=reduction, return_logprobs=True, backend="cpp", chunk_rows=5, gemm_dtype=gemm_dtype, **OPTIONS[option],
    )
    grads = torch.autograd.grad(out.loss, (hidden, weight, bias), upstream_gradient(reduction, len(batch.input_ids)))
    assert out.loss.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads)
    reference_batch = fp32_view(batch)
    ref_loss, _, ref_logprob, ref_grads = reference(reference_batch, reference_batch.aligned_labels(), reduction, OPTIONS[option], True)
    assert_close(out.loss, ref_loss, rtol=1e-5)
    assert_close(out.logprobs, ref_logprob, rtol=1e-5)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual.float(), expected.float(), rtol=1e-2)


def test_the_loss_tolerance_rejects_bf16_rounded_logits():
    batch = bf16_batch()
    labels = batch.aligned_labels()
    reference_batch = fp32_view(batch)
    ref_loss, _, _, _ = reference(reference_batch, labels, "sum", {}, True)
    rows = labels != -100
    logits = (batch.hidden @ batch.weight.t() + batch.bias).float()  # a bf16 GEMM: bf16 output
    rounded_loss = torch.nn.functional.cross_entropy(logits[rows], labels[rows], reduction="sum")
    with pytest.raises(AssertionError):
        assert_close(rounded_loss, ref_loss, rtol=1e-5)


def test_an_unsupported_gemm_dtype_is_refused():
    batch = bf16_batch()
    with pytest.raises(ValueError, match="gemm_dtype"):
        varlen_linear_cross_entropy(
            batch.hidden, batch.weight, input_ids=batch.input_ids, loss_mask=batch.loss_mask, offsets=batch.offsets,
            gemm_dtype=torch.float16,
        )
