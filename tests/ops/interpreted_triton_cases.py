"""The Triton kernel against the fp64 reference, on CPU under the Triton interpreter.

Not collected directly (no test_ prefix): test_triton_interpreter.py runs this module in a
subprocess with TRITON_INTERPRET=1, which must be set before the kernel is decorated.
"""

import os

import pytest
import torch

from hpsft.ops import varlen_linear_cross_entropy
from test_bf16_gemms import fp32_view
from test_varlen_ce import OPTIONS, REDUCTIONS, assert_close, reference, run_linear
from test_masked_vocabulary import masked_batch
from varlen_ce_reference import make_batch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_interpreter.py (needs TRITON_INTERPRET=1)", allow_module_level=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", OPTIONS)
def test_triton_matches_reference(reduction, option):
    batch = make_batch()
    out, grads = run_linear(batch, "triton", reduction, OPTIONS[option], True, use_labels=False)
    ref_loss, ref_z, ref_logprob, ref_grads = reference(batch, batch.aligned_labels(), reduction, OPTIONS[option], True)
    assert out.backend == "triton"
    assert_close(out.loss, ref_loss)
    assert_close(out.z_loss, ref_z)
    assert_close(out.logprobs, ref_logprob)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected)


def test_triton_several_vocabulary_blocks_and_large_offset():
    # V = 2053 spans three 1024-wide blocks, the last ragged; +1e4 on every logit.
    batch = make_batch(lengths=(6, 3), hidden_size=8, vocab_size=2053, fully_masked=())
    batch.bias = batch.bias + 1e4
    options = {"label_smoothing": 0.1, "softcap": 3e4}
    out, grads = run_linear(batch, "triton", "sum", options, True, use_labels=False)
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", options, True)
    assert_close(out.loss, ref_loss, rtol=2e-3)  # fp32 logits round to ~1e-3 at 1e4
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected, rtol=2e-3)


def test_triton_nothing_supervised():
    batch = make_batch(fully_masked=range(6))
    out, grads = run_linear(batch, "triton", "mean", {"z_loss_weight": 0.1}, True, use_labels=False)
    assert out.loss.item() == 0 and all(torch.all(g == 0) for g in grads)


@pytest.mark.parametrize(
    "options", [{}, {"label_smoothing": 0.1}, {"softcap": 3.0, "label_smoothing": 0.1}], ids=["plain", "smoothing", "softcap+smoothing"]
)
def test_triton_minus_inf_logits(options):
    # The whole first 1024-wide block is masked: its max is -inf.
    batch = masked_batch()
    out, grads = run_linear(batch, "triton", "sum", options, True, use_labels=False)
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", options, True)
    assert_close(out.loss, ref_loss)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual, expected)


@pytest.mark.parametrize("vocab_size", [600, 2053], ids=["one_block", "three_blocks"])
@pytest.mark.parametrize("option", ["plain", "all"])
def test_triton_bf16_gradients_written_over_the_fp32_logits(vocab_size, option):
    """The tensor-core design on bf16 inputs: the kernel rounds d(logits) into the first half
    of each fp32 logit row (row stride 2V) and the GEMMs read them there. Catches a wrong
    16-bit row stride or offset (the GEMMs would read logits or another row's gradient) and a
    tile written before it is read (in the interpreter a whole tile is read at once, so what
    this checks is the layout; the barrier's ordering across threads only a GPU exercises)."""
    options = {"plain": {}, "all": {"label_smoothing": 0.1, "z_loss_weight": 0.003, "softcap": 4.0}}[option]
    batch = make_batch(lengths=(9, 0, 4, 12), hidden_size=64, vocab_size=vocab_size, fully_masked=())
    for name in ("hidden", "weight", "bias"):
        setattr(batch, name, getattr(batch, name).bfloat16())
    hidden, weight, bias = (getattr(batch, k).clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    out = varlen_linear_cross_entropy(
        hidden, weight, bias, input_ids=batch.input_ids, loss_mask=batch.loss_mask, offsets=batch.offsets,
        return_logprobs=True, backend="triton", chunk_rows=5, gemm_dtype=torch.bfloat16, **options,
    )
    grads = torch.autograd.grad(out.loss, (hidden, weight, bias), torch.tensor(1.7))
    reference_batch = fp32_view(batch)
    ref_loss, _, ref_logprob, ref_grads = reference(reference_batch, reference_batch.aligned_labels(), "sum", options, True)
    assert out.backend == "triton"
    assert_close(out.loss, ref_loss, rtol=1e-5)
    assert_close(out.logprobs, ref_logprob, rtol=1e-5)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual.float(), expected.float(), rtol=1e-2)
