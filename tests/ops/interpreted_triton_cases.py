"""The Triton kernel against the fp64 reference, on CPU under the Triton interpreter.

Not collected directly (no test_ prefix): test_triton_interpreter.py runs this module in a
subprocess with TRITON_INTERPRET=1, which must be set before the kernel is decorated.
"""

import os

import pytest
import torch

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
