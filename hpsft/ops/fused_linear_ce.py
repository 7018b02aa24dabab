"""Fused linear + cross-entropy over the supervised rows, chunked over tokens.

Host side shared by every backend: for each chunk of rows it computes the logit block with
one GEMM (bias fused), hands it to the backend's row kernel (softmax, loss and d(logits)
in place, see row_options) and turns the block into d(hidden), d(weight), d(bias) with two
more GEMMs. Only one (rows, V) block exists at a time, so full logits are never
materialised, and the three GEMMs are the same work the unfused path does.

Two GEMM precisions (gemm_dtype_for picks one):
  - compute dtype (fp32; fp64 for fp64 inputs): operands upcast, the CPU design. bf16
    weights are copied to fp32 once per call; on CPU that costs less than the GEMMs gain.
  - the inputs' own bf16/fp16 on CUDA: tensor-core GEMMs that read the weight as it is (no
    fp32 copy) and accumulate and write fp32 (mm/addmm's out_dtype): logit blocks are fp32
    for the row kernel, d(weight) is summed over chunks in one fp32 buffer. d(logits) is
    rounded to the input dtype before its two GEMMs (tensor cores read 16-bit operands);
    that rounding is this design's only extra error (relative 2^-9 per element in bf16).
    d(bias) sums the fp32 block. On CPU the same arithmetic runs with the operands upcast per
    GEMM (products of 16-bit values are exact in fp32), which is how the tests check it.

No host synchronisation in the chunk loop: every size is known from shapes.

For a reduced loss the gradients are finished in the forward pass and backward only scales
them, in place, by the upstream scalar. For reduction "none" the upstream gradient differs
per row and d(weight) sums over rows, so backward recomputes the blocks with the upstream
gradient as the row scale (one extra forward's worth of work, no (N, V) storage); so does a
second backward through a retained graph. Under torch.no_grad() (or when no input requires
grad) only the logit GEMMs and the loss part of the row kernel run.
"""

import functools

import torch

from hpsft.ops.backends import runs_cuda_path
from hpsft.ops.row_options import RowKernel, RowOptions

# CPU: one (rows, V) block of 128 MiB (682 rows at V=49152 fp32), small next to materialised
# logits, but at least CPU_MIN_CHUNK_ROWS rows: each chunk's d(weight) GEMM reads and writes
# the whole (V, H) fp32 accumulator, traffic per FLOP that falls as 1 / rows whatever V and H
# are. At H=4096, V=128256, 2048 tokens (fp32, 2 threads, fwd+bwd): 261 rows (128 MiB)
# 57.8 s, 1024 rows 42.5 s, 2048 rows 39-44 s, materialised logits 46.1 s (docs/performance.md).
LOGIT_BLOCK_BYTES = 128 * 2**20
CPU_MIN_CHUNK_ROWS = 1024
# GPU: the blocks (fp32 logits + 16-bit d(logits)) take at most this share of the free memory,
# and at most GPU_MAX_CHUNK_ROWS rows. Each chunk's d(weight) GEMM reads and writes the fp32
# (V, H) accumulator, so fewer rows per chunk cost time: on the lent H200 (H=4096, V=128256,
# bench_varlen_ce.py, docs/gpu_results.md) 4096 rows took 44.4/169 ms at N=8k/32k with 5.1/5.6
# GiB extra, 2048 rows 45.9/177 ms with 3.6/4.2 GiB. The faster cap is kept: 4096 rows at
# V=128256 are 3 GiB of blocks; pass chunk_rows to trade ~4% time for 1.5 GiB.
GPU_BLOCK_SHARE_OF_FREE_MEMORY = 0.25
GPU_MAX_CHUNK_ROWS = 4096
LOW_PRECISION = (torch.bfloat16, torch.float16)


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    # Softmax and gradient accumulation run in fp32 (fp64 when asked, e.g. for gradcheck).
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.cache
def fp32_out_gemms_work(device: torch.device) -> bool:
    """Whether this torch runs the GEMMs of the 16-bit design on `device`: mm/addmm with
    out_dtype=float32 on 16-bit operands, with an fp32 bias and an fp32 accumulator as addend.
    Tried once on 2x2 tensors, because it depends on the version, not only on the overloads
    existing: some versions require the addend in the operands' dtype."""
    if device.type != "cuda":
        return True  # CPU: _gemm upcasts the operands
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    out = torch.zeros(2, 2, dtype=torch.float32, device=device)
    try:
        torch.mm(a, a, out_dtype=torch.float32, out=out)
        torch.addmm(torch.zeros(2, device=device), a, a, out_dtype=torch.float32, out=out)
        torch.addmm(out, a, a, beta=1, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def gemm_dtypes_for(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.dtype, ...]:
    """The GEMM operand dtypes these inputs can use: fp32 (fp64) always, their own 16-bit
    dtype when both have it and the device runs the 16-bit design."""
    compute = compute_dtype_for(hidden.dtype)
    if hidden.dtype == weight.dtype and hidden.dtype in LOW_PRECISION and fp32_out_gemms_work(hidden.device):
        return (compute, hidden.dtype)
    return (compute,)


def gemm_dtype_for(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The operand dtype of the three GEMMs by default: tensor cores on CUDA for 16-bit inputs."""
    return gemm_dtypes_for(hidden, weight)[-1] if runs_cuda_path(hidden.device) else compute_dtype_for(hidden.dtype)


def default_chunk_rows(vocab_size: int, dtype: torch.dtype) -> int:
    """CPU: rows of a LOGIT_BLOCK_BYTES block of `dtype`, at least CPU_MIN_CHUNK_ROWS."""
    return max(CPU_MIN_CHUNK_ROWS, LOGIT_BLOCK_BYTES // (vocab_size * dtype.itemsize))


def gpu_chunk_rows(vocab_size: int, bytes_per_logit: int, device: torch.device) -> int:
    """GPU: as many rows as GPU_BLOCK_SHARE_OF_FREE_MEMORY allows, at most GPU_MAX_CHUNK_ROWS.
    cudaMemGetInfo does not wait for the stream; memory torch caches but does not use counts as
    taken, which errs on the small side."""
    free_bytes, _ = torch.cuda.mem_get_info(device)
    rows = int(free_bytes * GPU_BLOCK_SHARE_OF_FREE_MEMORY) // (vocab_size * bytes_per_logit)
    return max(1, min(GPU_MAX_CHUNK_ROWS, rows))


def _gemm(a, b, out, add=None, beta=1):
    """out = beta * add + a @ b (add may be out itself) with out's dtype for the result, which
    may be wider than the operands': CUDA does that in one GEMM (fp32 accumulation); elsewhere
    the operands are upcast first, which computes the same exact products and fp32 sums."""
    if a.dtype != out.dtype and a.device.type == "cpu":
        a, b = a.to(out.dtype), b.to(out.dtype)
    mixed = {"out_dtype": out.dtype} if a.dtype != out.dtype else {}
    if add is None:
        return torch.mm(a, b, out=out, **mixed)
    return torch.addmm(add, a, b, beta=beta, out=out, **mixed)


def chunked_linear_cross_entropy(
    x, weight, bias, labels, row_scale, options: RowOptions, row_kernel: RowKernel, chunk_rows, need_grads, gemm_dtype
):
    """Per-row (loss, zloss, logprob) and the row_scale-weighted gradients (None where not needed).

    Gradients are in the compute dtype (fp32, or fp64 for fp64 inputs); gemm_dtype is either the
    compute dtype or the inputs' 16-bit dtype (module docstring)."""
    need_x, need_w, need_b = need_grads
    need_any = any(need_grads)
    dtype = compute_dtype_for(x.dtype)
    low_precision = gemm_dtype != dtype
    w = weight.to(gemm_dtype)  # no copy when the weight already has the GEMM dtype
    b = bias.to(dtype) if bias is not None else None
    n_rows, hidden_size = x.shape
    vocab_size = w.shape[0]
    if not chunk_rows:
        bytes_per_logit = dtype.itemsize + (gemm_dtype.itemsize if low_precision and need_any else 0)
        chunk_rows = gpu_chunk_rows(vocab_size, bytes_per_logit, x.device) if x.is_cuda else default_chunk_rows(vocab_size, dtype)
    outputs = [torch.empty(n_rows, dtype=dtype, device=x.device) for _ in range(3)]
    grad_x = torch.empty(n_rows, hidden_size, dtype=dtype, device=x.device) if need_x else None
    # The first chunk's GEMM overwrites d(weight) (beta=0), saving a memset of (V, H); with no
    # rows at all there is no GEMM and the gradient is zero.
    allocate_w = torch.empty if n_rows else torch.zeros
    grad_w = allocate_w(vocab_size, hidden_size, dtype=dtype, device=x.device) if need_w else None
    grad_b = torch.zeros(vocab_size, dtype=dtype, device=x.device) if need_b else None
    block_rows = min(chunk_rows, n_rows)
    block_buffer = torch.empty(block_rows, vocab_size, dtype=dtype, device=x.device)
    # d(logits) in the GEMM dtype for the two gradient GEMMs (tensor cores read 16-bit operands).
    low_buffer = torch.empty(block_rows, vocab_size, dtype=gemm_dtype, device=x.device) if low_precision and (need_x or need_w) else None
    for start in range(0, n_rows, chunk_rows):
        stop = min(start + chunk_rows, n_rows)
        xs = x[start:stop].to(gemm_dtype)
        block = block_buffer[: stop - start]
        _gemm(xs, w.t(), block, add=b)
        for out, value in zip(outputs, row_kernel(block, labels[start:stop], row_scale[start:stop], options, need_any)):
            out[start:stop] = value
        if not need_any:
            continue
        grad_block = low_buffer[: stop - start].copy_(block) if low_buffer is not None else block
        if need_x:
            _gemm(grad_block, w, grad_x[start:stop])
        if need_w:
            _gemm(grad_block.t(), xs, grad_w, add=grad_w, beta=0 if start == 0 else 1)
        if need_b:
            grad_b += block.sum(dim=0)
    return (*outputs, grad_x, grad_w, grad_b)


def _rows_to_tokens(grad_rows, positions, total_tokens):
    # index_copy, not index_add (what index_select's backward uses): positions are unique, and
    # index_add on CPU is orders of magnitude slower in torch 2.13.
    grad = grad_rows.new_zeros(total_tokens, grad_rows.shape[1])
    return grad.index_copy_(0, positions, grad_rows)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(hidden, weight, bias) -> (loss, zloss rows, logprob rows) over the rows `positions` of hidden.

    loss is sum_i row_scale_i * loss_i when reduce, else the per-row losses. grad_enabled:
    torch.is_grad_enabled() at the call; inside forward it is always False, and
    ctx.needs_input_grad says True under torch.no_grad() for inputs that require grad.
    """

    @staticmethod
    def forward(
        ctx, hidden, positions, weight, bias, labels, row_scale, options, row_kernel, reduce, chunk_rows, gemm_dtype, grad_enabled
    ):
        ctx.options, ctx.row_kernel, ctx.chunk_rows, ctx.gemm_dtype = options, row_kernel, chunk_rows, gemm_dtype
        ctx.total_tokens = hidden.shape[0]
        ctx.grad_dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.needs_grad = tuple(grad_enabled and needed for needed in (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:4]))
        x = hidden.index_select(0, positions)
        loss, zloss, logprob, *grads = chunked_linear_cross_entropy(
            x, weight, bias, labels, row_scale, options, row_kernel, chunk_rows, ctx.needs_grad if reduce else (False,) * 3,
            gemm_dtype,
        )
        # Finished gradients for the first backward; not saved tensors, so that backward can
        # scale them in place and hand them over (a copy of d(weight) would double the peak
        # memory for large vocabularies).
        ctx.precomputed_grads = grads if reduce else None
        ctx.save_for_backward(positions, x, weight, bias, labels, row_scale)
        ctx.mark_non_differentiable(zloss, logprob)
        return ((loss * row_scale).sum() if reduce else loss), zloss, logprob

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_zloss, _grad_logprob):
        positions, x, weight, bias, labels, row_scale = ctx.saved_tensors
        if ctx.precomputed_grads is not None:
            grads, ctx.precomputed_grads = ctx.precomputed_grads, None
            grads = [None if g is None else g.mul_(grad_loss) for g in grads]
        else:
            # Reduction "none" (a different upstream gradient per row, while d(weight) sums over
            # rows), or a second backward through a retained graph: recompute the blocks.
            scale = row_scale * grad_loss.to(row_scale.dtype)
            grads = chunked_linear_cross_entropy(
                x, weight, bias, labels, scale, ctx.options, ctx.row_kernel, ctx.chunk_rows, ctx.needs_grad, ctx.gemm_dtype
            )[3:]
        grads = [None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.grad_dtypes)]
        if grads[0] is not None:
            grads[0] = _rows_to_tokens(grads[0], positions, ctx.total_tokens)
        grad_hidden, grad_weight, grad_bias = grads
        return grad_hidden, None, grad_weight, grad_bias, None, None, None, None, None, None, None, None
