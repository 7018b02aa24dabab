"""The GPU row kernel (Triton) and the tensor-core GEMMs against the CPU tests' fp64 reference.

Runs only where torch sees a CUDA device (scripts/gpu_checks.sh runs it on a lent GPU). There
a kernel that fails to compile or load FAILS the tests, with the dispatcher's reason: a
GPU machine that silently skipped them would pass with no GPU kernel checked. Inputs are the
CPU tests' batches moved to the GPU; the reference is computed on the CPU in fp64 from the
same values. Run on an H200: 71 passed (docs/gpu_results.md).

Tolerances: fp32 inputs 1e-5 relative, as on CPU (matmuls are forced to full fp32, no TF32).
bf16 inputs (by default 16-bit GEMM operands with fp32 accumulation and fp32 logit blocks):
the loss still agrees to 1e-5, since the reference sees the same bf16-rounded values and the
logits are exact products summed in fp32; gradients are returned in bf16 (relative step
2^-8) after one bf16 rounding of d(logits), so they are compared at 1e-2 of the largest
entry (as in test_bf16_gemms on CPU). The +1e4 logit offset keeps the CPU test's 2e-3 in
fp32: the logits themselves round to ~1e-3 at 1e4.
"""

import dataclasses

import pytest
import torch

from hpsft.ops import varlen_cross_entropy, varlen_linear_cross_entropy
from hpsft.ops.backends import select_row_kernel
from hpsft.ops.fused_linear_ce import gemm_dtype_for
from test_masked_vocabulary import masked_batch
from test_varlen_ce import OPTIONS, REDUCTIONS, assert_close, reference, upstream_gradient
from varlen_ce_reference import IGNORE, make_batch, reduce_rows, reference_rows

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU backends need a CUDA device: torch.cuda.is_available() is False (CPU-only torch or no GPU); "
    "scripts/gpu_checks.sh runs these on a GPU machine",
)

GPU_BACKENDS = ["triton"]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    # TF32 GEMMs (10-bit mantissa) would miss 1e-5 by orders of magnitude; "highest" is the
    # default, but a library imported earlier in the session may have changed it.
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.fixture(params=GPU_BACKENDS)
def backend(request):
    try:
        select_row_kernel(request.param, CUDA, torch.float32)
    except RuntimeError as why:  # the dispatcher says why: Triton not importable, ...
        pytest.fail(f"on a machine with a GPU the {request.param} row kernel must load: {why}")
    return request.param


def on_gpu(batch):
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(CUDA) for f in dataclasses.fields(batch)})


def run_linear_on_gpu(batch, backend, reduction, options, with_bias, use_labels=False, denominator=None,
                      chunk_rows=3, offsets=None, dtype=torch.float32):
    """test_varlen_ce.run_linear on CUDA copies of the batch (that one builds its upstream
    gradient on the CPU, which autograd rejects for CUDA outputs). Returns (out, grads) on the CPU."""
    gpu = on_gpu(batch)
    hidden = gpu.hidden.to(dtype).requires_grad_()
    weight = gpu.weight.to(dtype).requires_grad_()
    bias = gpu.bias.to(dtype).requires_grad_() if with_bias else None
    targets = dict(labels=gpu.aligned_labels()) if use_labels else dict(input_ids=gpu.input_ids, loss_mask=gpu.loss_mask)
    out = varlen_linear_cross_entropy(
        hidden, weight, bias, offsets=gpu.offsets if offsets is None else offsets.to(CUDA), reduction=reduction,
        denominator=denominator, return_logprobs=True, backend=backend, chunk_rows=chunk_rows, **targets, **options,
    )
    params = [p for p in (hidden, weight, bias) if p is not None]
    grads = torch.autograd.grad(out.loss, params, upstream_gradient(reduction, len(batch.input_ids)).to(CUDA))
    assert out.loss.is_cuda and all(g.is_cuda for g in grads)
    cpu = dataclasses.replace(out, **{k: v.cpu() for k, v in vars(out).items() if isinstance(v, torch.Tensor)})
    return cpu, [g.cpu() for g in grads]


def assert_matches_reference(out, grads, batch, reduction, options, with_bias, denominator=None, rtol=1e-5, grad_rtol=None):
    ref_loss, ref_z, ref_logprob, ref_grads = reference(batch, batch.aligned_labels(), reduction, options, with_bias, denominator)
    assert torch.isfinite(out.loss).all()
    assert_close(out.loss, ref_loss, rtol=rtol)
    assert_close(out.z_loss, ref_z, rtol=rtol)
    assert_close(out.logprobs, ref_logprob, rtol=rtol)
    for actual, expected in zip(grads, ref_grads):
        assert_close(actual.float(), expected, rtol=grad_rtol or rtol)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(backend, reduction, option, with_bias):
    # make_batch has an empty, a one-token and a fully masked sequence, and label V-1
    # (test_edge_cases checks that it does).
    batch = make_batch()
    out, grads = run_linear_on_gpu(batch, backend, reduction, OPTIONS[option], with_bias)
    assert out.backend == backend
    assert out.n_tokens.item() == int((batch.aligned_labels() != IGNORE).sum())
    assert_matches_reference(out, grads, batch, reduction, OPTIONS[option], with_bias)


@pytest.mark.parametrize("reduction", ["mean", "seq_mean"])
def test_explicit_denominator_with_labels(backend, reduction):
    batch = make_batch(seed=3)
    out, grads = run_linear_on_gpu(batch, backend, reduction, {}, True, use_labels=True, denominator=11)
    assert_matches_reference(out, grads, batch, reduction, {}, True, denominator=11)


@pytest.mark.parametrize("chunk_rows", [None, 1, 1000])
def test_chunking_does_not_change_the_result(backend, chunk_rows):
    batch = make_batch(seed=4)
    out, grads = run_linear_on_gpu(batch, backend, "sum", OPTIONS["all"], True, chunk_rows=chunk_rows)
    assert_matches_reference(out, grads, batch, "sum", OPTIONS["all"], True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", ["plain", "all"])
def test_logits_api_matches_reference(backend, reduction, option):
    batch = make_batch(seed=5)
    labels = batch.aligned_labels()
    logits = (batch.hidden @ batch.weight.t() + batch.bias).to(CUDA).requires_grad_()
    gpu = on_gpu(batch)
    out = varlen_cross_entropy(
        logits, input_ids=gpu.input_ids, loss_mask=gpu.loss_mask, offsets=gpu.offsets,
        reduction=reduction, return_logprobs=True, backend=backend, **OPTIONS[option],
    )
    (grad,) = torch.autograd.grad(out.loss, logits, upstream_gradient(reduction, len(labels)).to(CUDA))
    ref_logits = logits.detach().cpu().double().requires_grad_()
    rows, zrows, logprob = reference_rows(lambda s, e: ref_logits[s:e], labels, batch.offsets, **OPTIONS[option])
    ref_loss = reduce_rows(rows, labels, batch.offsets, reduction)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits, upstream_gradient(reduction, len(labels)).double())
    assert out.backend == backend
    assert_close(out.loss.cpu(), ref_loss.detach())
    assert_close(out.z_loss.cpu(), reduce_rows(zrows, labels, batch.offsets, reduction))
    assert_close(out.logprobs.cpu(), logprob)
    assert_close(grad.cpu(), ref_grad)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nothing_supervised_gives_zero_loss_and_gradients(backend, reduction):
    batch = make_batch(fully_masked=range(6))
    out, grads = run_linear_on_gpu(batch, backend, reduction, {"z_loss_weight": 0.1}, True)
    assert out.n_tokens.item() == 0
    assert torch.all(out.loss == 0) and torch.all(out.z_loss == 0)
    for grad in grads:
        assert torch.all(grad == 0)


@pytest.mark.parametrize("vocab_size", [2053, 4099])
def test_vocabulary_not_a_multiple_of_the_block(backend, vocab_size):
    # Neither is a multiple of Triton's 1024-wide blocks:
    # the last vocabulary block is ragged (2053 = 2*1024 + 5, 4099 = 4*1024 + 3).
    batch = make_batch(lengths=(6, 3, 1, 9), hidden_size=8, vocab_size=vocab_size, fully_masked=())
    options = {"label_smoothing": 0.1, "softcap": 3.0, "z_loss_weight": 0.01}
    out, grads = run_linear_on_gpu(batch, backend, "none", options, True)
    assert_matches_reference(out, grads, batch, "none", options, True)


def test_large_common_logit_offset_is_stable(backend):
    batch = make_batch()
    batch.bias = batch.bias + 1e4
    options = {"label_smoothing": 0.1, "z_loss_weight": 1e-9}
    out, grads = run_linear_on_gpu(batch, backend, "sum", options, True)
    # rtol 2e-3: fp32 logits round to ~1e-3 at 1e4 (same bound as the CPU test).
    assert_matches_reference(out, grads, batch, "sum", options, True, rtol=2e-3)


def test_int32_offsets(backend):
    batch = make_batch()
    out, grads = run_linear_on_gpu(batch, backend, "seq_mean", {}, False, offsets=batch.offsets.int())
    assert_matches_reference(out, grads, batch, "seq_mean", {}, False)


def test_non_contiguous_inputs(backend):
    batch = make_batch()
    total, hidden_size = batch.hidden.shape
    # Every input is a strided view of a larger CUDA tensor.
    hidden = torch.zeros(hidden_size, total * 2, device=CUDA).t()[::2]
    hidden.copy_(batch.hidden)
    weight = torch.zeros(batch.weight.shape[0], hidden_size * 3, device=CUDA)[:, ::3]
    weight.copy_(batch.weight)
    ids = torch.zeros(total, 2, dtype=torch.long, device=CUDA)[:, 1]
    ids.copy_(batch.input_ids)
    mask = torch.zeros(total, 2, dtype=torch.long, device=CUDA)[:, 0]
    mask.copy_(batch.loss_mask)
    assert not (hidden.is_contiguous() or weight.is_contiguous() or ids.is_contiguous() or mask.is_contiguous())
    hidden.requires_grad_()
    weight.requires_grad_()
    out = varlen_linear_cross_entropy(
        hidden, weight, input_ids=ids, offsets=batch.offsets.to(CUDA), loss_mask=mask, backend=backend, chunk_rows=4
    )
    grads = torch.autograd.grad(out.loss * 1.7, (hidden, weight))  # the reference's upstream gradient is 1.7
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", {}, False)
    assert_close(out.loss.cpu(), ref_loss)
    for actual, expected in zip(grads, ref_grads[:2]):
        assert_close(actual.cpu(), expected)


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("chunk_rows", [3, None], ids=["3_rows", "default"])
@pytest.mark.parametrize("vocab_size", [37, 4099], ids=["one_block", "five_blocks"])
def test_bf16_inputs_on_tensor_cores(backend, reduction, chunk_rows, vocab_size):
    """The kernel writes bf16 d(logits) over the first half of each fp32 logit row: with five
    1024-wide blocks a block's writes land on earlier blocks and on its own first half, which
    the barrier must order after every thread's reads (the interpreter cannot show that)."""
    assert gemm_dtype_for(torch.empty(1, 1, device=CUDA, dtype=torch.bfloat16), torch.empty(1, 1, device=CUDA, dtype=torch.bfloat16)) == torch.bfloat16, (
        "this torch has no mm/addmm out_dtype overloads: bf16 GEMMs fall back to fp32 operands"
    )
    batch = make_batch(vocab_size=vocab_size)
    # The reference sees the bf16-rounded values.
    batch.hidden, batch.weight, batch.bias = (t.bfloat16().float() for t in (batch.hidden, batch.weight, batch.bias))
    out, grads = run_linear_on_gpu(batch, backend, reduction, OPTIONS["all"], True, dtype=torch.bfloat16, chunk_rows=chunk_rows)
    assert out.loss.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads)
    assert_matches_reference(out, grads, batch, reduction, OPTIONS["all"], True, grad_rtol=1e-2)


def test_bf16_weight_gradient_into_an_fp32_buffer(backend):
    """grad_weight_into on CUDA: fp32-out tensor-core GEMMs add d(weight) into the buffer, and
    grad_scale's gradients equal the reference's for that upstream gradient."""
    batch = make_batch(vocab_size=4099)
    batch.hidden, batch.weight, batch.bias = (t.bfloat16().float() for t in (batch.hidden, batch.weight, batch.bias))
    gpu = on_gpu(batch)
    hidden, weight = (t.to(torch.bfloat16).requires_grad_() for t in (gpu.hidden, gpu.weight))
    held = torch.randn(weight.shape, device=CUDA)
    into = held.clone()
    out = varlen_linear_cross_entropy(hidden, weight, input_ids=gpu.input_ids, loss_mask=gpu.loss_mask, offsets=gpu.offsets,
                                      backend=backend, chunk_rows=5, grad_scale=1.7, grad_weight_into=into)
    (out.loss * 1.7).backward()  # the reference's upstream gradient is 1.7
    torch.cuda.synchronize()  # a wrong upstream gradient would fail here (device-side assertion)
    assert weight.grad is None
    ref_loss, _, _, ref_grads = reference(batch, batch.aligned_labels(), "sum", {}, False)
    assert_close(out.loss.cpu(), ref_loss)
    assert_close(hidden.grad.cpu().float(), ref_grads[0].float(), rtol=1e-2)
    assert_close((into - held).cpu(), ref_grads[1].float(), rtol=1e-2)


def test_no_fp32_weight_copy_and_no_gradient_memory_under_no_grad(backend):
    # bf16 weight of 16 MiB: an fp32 copy (32 MiB), or a d(weight) buffer (32 MiB), would show
    # in the peak; 64 rows of fp32 logits are 8 MiB.
    vocab, hidden_size, rows = 32768, 256, 64
    weight = torch.randn(vocab, hidden_size, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    hidden = torch.randn(rows + 1, hidden_size, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows + 1,), device=CUDA)
    offsets = torch.tensor([0, rows + 1], device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = varlen_linear_cross_entropy(hidden, weight, labels=labels, offsets=offsets, backend=backend)
    torch.cuda.synchronize()
    extra_mib = (torch.cuda.max_memory_allocated() - before) / 2**20
    assert torch.isfinite(out.loss)
    assert extra_mib < 12, f"{extra_mib:.1f} MiB above the inputs: more than the 8 MiB logit block"


def test_auto_picks_triton_on_cuda_tensors():
    batch = on_gpu(make_batch())
    out = varlen_linear_cross_entropy(batch.hidden, batch.weight, input_ids=batch.input_ids, offsets=batch.offsets, loss_mask=batch.loss_mask)
    assert out.backend == "triton"
    assert out.loss.is_cuda


@pytest.mark.parametrize(
    "options", [{}, {"label_smoothing": 0.1}, {"softcap": 3.0, "label_smoothing": 0.1}], ids=["plain", "smoothing", "softcap+smoothing"]
)
def test_minus_inf_logits(backend, options):
    # The masked vocabulary of the CPU test: a whole first block (every kernel's max is -inf
    # there) and scattered entries; labels never masked.
    batch = masked_batch()
    out, grads = run_linear_on_gpu(batch, backend, "sum", options, True)
    assert_matches_reference(out, grads, batch, "sum", options, True)

