"""Under torch.no_grad() (or inference_mode) the op does no gradient work.

Counted, not timed: the matrix products the op dispatches (a TorchDispatchMode sees every ATen
call, out= and in-place ones included), the tensors it creates, and what the row kernel is
asked to compute.
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hpsft.ops.row_kernel_cpp
import hpsft.ops.row_kernel_torch
from hpsft.ops import varlen_cross_entropy, varlen_linear_cross_entropy
from test_varlen_ce import CPU_BACKENDS, assert_close, reference
from varlen_ce_reference import make_batch

KERNEL_FUNCTIONS = {"torch": (hpsft.ops.row_kernel_torch, "torch_rows_forward_"), "cpp": (hpsft.ops.row_kernel_cpp, "cpp_rows_forward_")}
MATMULS = {"mm", "addmm", "addmm_"}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()
        self.allocated_shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls[func.overloadpacket.__name__] += 1
        # Views (weight.to(its own dtype) and weight.t() among them) allocate nothing.
        for tensor in () if func.is_view else out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.allocated_shapes.append(tuple(tensor.shape))
        return out


@pytest.fixture
def compute_grad_flags(monkeypatch):
    """The compute_grad argument of every row-kernel call."""
    flags = []
    for module, name in KERNEL_FUNCTIONS.values():
        kernel = getattr(module, name)

        def spy(*args, kernel=kernel):
            flags.append(args[4])
            return kernel(*args)

        monkeypatch.setattr(module, name, spy)
    return flags


def count_linear(batch, backend, chunk_rows, requires_grad=True):
    hidden = batch.hidden.clone().requires_grad_(requires_grad)
    weight = batch.weight.clone().requires_grad_(requires_grad)
    with CountOps() as ops:
        out = varlen_linear_cross_entropy(
            hidden, weight, input_ids=batch.input_ids, loss_mask=batch.loss_mask, offsets=batch.offsets,
            backend=backend, chunk_rows=chunk_rows,
        )
    return out, ops


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_linear_op_under_no_grad_runs_only_the_logit_gemms(backend, no_grad, compute_grad_flags):
    batch = make_batch()
    rows = int(make_batch().aligned_labels().ne(-100).sum())
    chunks = -(-rows // 4)
    with no_grad():
        out, ops = count_linear(batch, backend, chunk_rows=4)
    assert sum(ops.calls[name] for name in MATMULS) == chunks  # one logit GEMM per chunk, nothing else
    assert tuple(batch.weight.shape) not in ops.allocated_shapes  # no d(weight) buffer
    assert compute_grad_flags == [False] * chunks
    assert not out.loss.requires_grad
    ref_loss, _, _, _ = reference(batch, batch.aligned_labels(), "sum", {}, False)
    assert_close(out.loss, ref_loss)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_linear_op_on_inputs_that_need_no_grad_runs_only_the_logit_gemms(backend, compute_grad_flags):
    batch = make_batch()
    chunks = -(-int(batch.aligned_labels().ne(-100).sum()) // 4)
    _, ops = count_linear(batch, backend, chunk_rows=4, requires_grad=False)
    assert sum(ops.calls[name] for name in MATMULS) == chunks
    assert compute_grad_flags == [False] * chunks


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_linear_op_with_grad_runs_three_gemms_per_chunk(backend, compute_grad_flags):
    # The counterpart of the test above: the same count with gradients on, so that the count
    # is known to see the gradient GEMMs when they run.
    batch = make_batch()
    rows = int(batch.aligned_labels().ne(-100).sum())
    chunks = -(-rows // 4)
    _, ops = count_linear(batch, backend, chunk_rows=4)
    assert sum(ops.calls[name] for name in MATMULS) == 3 * chunks
    assert tuple(batch.weight.shape) in ops.allocated_shapes
    assert compute_grad_flags == [True] * chunks


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_logits_op_under_no_grad_computes_no_gradient(backend, compute_grad_flags):
    batch = make_batch()
    logits = torch.randn(len(batch.input_ids), 37, requires_grad=True)
    kwargs = dict(input_ids=batch.input_ids, loss_mask=batch.loss_mask, offsets=batch.offsets, backend=backend)
    with torch.no_grad():
        quiet = varlen_cross_entropy(logits, **kwargs)
    loud = varlen_cross_entropy(logits, **kwargs)
    assert compute_grad_flags == [False, True]
    assert_close(quiet.loss, loud.loss.detach())
