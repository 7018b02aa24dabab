"""Fused linear + cross-entropy over the supervised rows, chunked over tokens.

Host side shared by every backend: for each chunk of supervised rows it gathers their hidden
states, computes the logit block with one GEMM (bias fused), hands it to the backend's row
kernel (softmax, loss and d(logits) in place, see row_options) and turns the block into
d(hidden) rows, d(weight), d(bias) with two more GEMMs. Only one (rows, V) block exists at a
time, so full logits are never materialised, and the three GEMMs are the same work the
unfused path does. How many rows a chunk has: chunk_rows.py.

Two GEMM precisions (gemm_dtype_for picks one):
  - compute dtype (fp32; fp64 for fp64 inputs): operands upcast, the CPU design. bf16
    weights are copied to fp32 once per call; on CPU that costs less than the GEMMs gain.
    d(weight) is summed in the compute dtype and rounded to the weight's once at the end.
  - the inputs' own bf16/fp16 on CUDA: tensor-core GEMMs that read the weight as it is (no
    fp32 copy) and accumulate in fp32. The logit block is fp32 for the row kernel, which
    writes d(logits) rounded to 16 bits over the first half of each row's own storage (one
    block, no second buffer); d(hidden) rows and d(weight) come out of their GEMMs in the
    inputs' dtype: d(weight) summed chunk by chunk in one 16-bit (V, H) accumulator (the
    gradient handed back; one rounding per chunk, as Liger-Kernel does), or, when the engine
    lends its fp32 gradient of the weight (grad_weight_into), summed in fp32 straight into it.
    d(bias) sums the 16-bit d(logits) in fp32. On CPU the same arithmetic runs with the
    operands upcast wherever the output is fp32 (products of 16-bit values are exact in fp32),
    which is how the tests check it.

No host synchronisation in the chunk loop: every size is known from shapes.

For a reduced loss the gradients are finished in the forward pass, in their final dtypes,
and backward multiplies them in place by the upstream gradient. With grad_scale (the
upstream gradient the caller will send, e.g. 1 / the step's tokens) they are computed
already multiplied by it (it is part of every row's scale): backward then touches nothing
and checks on the device, without waiting for it, that the upstream gradient was that;
d(weight) summed into the engine's buffer needs this (it cannot be scaled afterwards). For
reduction "none" the upstream gradient differs per row and d(weight) sums over rows, so
backward recomputes the blocks with the upstream gradient as the row scale (one extra
forward's worth of work, no (N, V) storage); so does a second backward through a retained
graph. Under torch.no_grad() (or when no input requires grad) only the logit GEMMs and the
loss part of the row kernel run.
"""

import functools

import torch

from hpsft.ops import chunk_rows as chunking
from hpsft.ops.backends import runs_cuda_path
from hpsft.ops.row_options import RowKernel, RowOptions

LOW_PRECISION = (torch.bfloat16, torch.float16)
# |upstream gradient / grad_scale - 1| allowed: the caller's fp32 arithmetic for the same
# number (e.g. (loss / tokens) * dp's backward) may round it differently by an ulp or two.
GRAD_SCALE_RTOL = 1e-6


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


def default_chunk_rows(tokens, n_rows, hidden_size, vocab_size, dtype, device, weight_grad_in_engine=False) -> int:
    """chunk_rows.py's choice for this device and these inputs' dtype."""
    if runs_cuda_path(device):
        return chunking.cuda_chunk_rows(tokens, n_rows, hidden_size, vocab_size, dtype.itemsize, weight_grad_in_engine)
    return chunking.cpu_chunk_rows(vocab_size, compute_dtype_for(dtype).itemsize)


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
    hidden, positions, weight, bias, labels, row_scale, options: RowOptions, row_kernel: RowKernel, chunk_rows, need_grads,
    gemm_dtype, grad_weight_into=None, vocab_rows=None, want_hits=False,
):
    """Per-row (loss, zloss, logprob, hits) of the rows `positions` of hidden, and the
    row_scale-weighted gradients (None where not needed): d(hidden) (T, H) in hidden's dtype,
    d(weight) in the weight's dtype (None when summed into grad_weight_into, an fp32 (V, H)
    tensor), d(bias) in the bias's. gemm_dtype is either the compute dtype or the inputs'
    16-bit dtype (module docstring). vocab_rows: the weight's first vocab_rows rows are real,
    the rest padding, never multiplied, their gradients 0 (None: every row). want_hits: the
    row kernel sets hits_out (argmax == label), else hits is None."""
    need_x, need_w, need_b = need_grads
    need_any = any(need_grads)
    dtype = compute_dtype_for(hidden.dtype)
    low_precision = gemm_dtype != dtype
    padded_rows = weight.shape[0]
    vocab_size = padded_rows if vocab_rows is None else vocab_rows
    w = weight[:vocab_size].to(gemm_dtype)  # no copy when the weight already has the GEMM dtype
    b = bias[:vocab_size].to(dtype) if bias is not None else None
    n_rows, (total_tokens, hidden_size) = positions.numel(), hidden.shape
    device = hidden.device
    into_engine = need_w and grad_weight_into is not None
    if not chunk_rows:
        chunk_rows = default_chunk_rows(total_tokens, n_rows, hidden_size, vocab_size, hidden.dtype, device, into_engine)
    outputs = [torch.empty(n_rows, dtype=dtype, device=device) for _ in range(3)]
    hits = torch.empty(n_rows, dtype=torch.bool, device=device) if want_hits else None
    grad_x = torch.zeros_like(hidden) if need_x else None
    # d(weight): the 16-bit design sums it in the weight's dtype (the gradient handed back),
    # the fp32 design in fp32, rounded once at the end. The first chunk's GEMM overwrites it
    # (beta=0), saving a memset of (V, H); with no rows at all there is no GEMM and it is zero.
    weight_grad_dtype = weight.dtype if low_precision else dtype
    allocate_w = torch.empty if n_rows else torch.zeros
    grad_w = grad_w_real = None
    if need_w:
        grad_w = grad_weight_into if into_engine else allocate_w(padded_rows, hidden_size, dtype=weight_grad_dtype, device=device)
        grad_w_real = grad_w[:vocab_size]
        if vocab_size < padded_rows and not into_engine:
            grad_w[vocab_size:].zero_()  # padding rows: no logit, no gradient
    grad_b = torch.zeros(padded_rows, dtype=dtype, device=device) if need_b else None
    block_rows = min(chunk_rows, n_rows)
    block_buffer = torch.empty(block_rows, vocab_size, dtype=dtype, device=device)
    # The chunk's hidden rows, gathered (one buffer for every chunk: a new tensor per chunk
    # would hold two chunks' rows while the next one is gathered).
    rows_buffer = torch.empty(block_rows, hidden_size, dtype=hidden.dtype, device=device)
    # d(hidden) rows of a chunk, before they are put at their positions (tensor cores: 16-bit).
    grad_x_rows = torch.empty(block_rows, hidden_size, dtype=gemm_dtype, device=device) if need_x else None
    for start in range(0, n_rows, chunk_rows):
        stop = min(start + chunk_rows, n_rows)
        rows = positions[start:stop]
        xs = torch.index_select(hidden, 0, rows, out=rows_buffer[: stop - start]).to(gemm_dtype)
        block = block_buffer[: stop - start]
        _gemm(xs, w.t(), block, add=b)
        # The 16-bit design's d(logits): the first half of each fp32 row's own storage.
        grad_out = block.view(gemm_dtype)[:, :vocab_size] if low_precision and need_any else None
        hits_out = {"hits_out": hits[start:stop]} if hits is not None else {}
        losses = row_kernel(block, labels[start:stop], row_scale[start:stop], options, need_any, grad_out, **hits_out)
        for out, value in zip(outputs, losses):
            out[start:stop] = value
        if not need_any:
            continue
        grad_block = block if grad_out is None else grad_out
        if need_x:
            grad_x.index_copy_(0, rows, _gemm(grad_block, w, grad_x_rows[: stop - start]).to(hidden.dtype))
        if need_w:
            _gemm(grad_block.t(), xs, grad_w_real, add=grad_w_real, beta=0 if start == 0 and not into_engine else 1)
        if need_b:
            grad_b[:vocab_size] += grad_block.sum(dim=0, dtype=dtype)
    if into_engine:
        grad_w = None
    elif grad_w is not None:
        grad_w = grad_w.to(weight.dtype)  # the fp32 design with 16-bit weights: its one rounding
    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    return (*outputs, hits, grad_x, grad_w, grad_b)


def check_upstream_gradient(grad_loss: torch.Tensor, grad_scale: float) -> None:
    """Fail when backward's upstream gradient is not the grad_scale the gradients were made
    with; on CUDA an asynchronous device assertion (no wait for the device), on CPU at once."""
    mismatch = (grad_loss.float() / grad_scale - 1).abs() > GRAD_SCALE_RTOL
    torch._assert_async(~mismatch, f"hpsft: the fused loss was given grad_scale={grad_scale!r}, and backward received "
                                   "another upstream gradient: its gradients were made for grad_scale")


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(hidden, weight, bias) -> (loss, zloss rows, logprob rows, hit rows or None) over the rows
    `positions` of hidden.

    loss is sum_i row_scale_i * loss_i when reduce, else the per-row losses. grad_scale: None,
    or the upstream gradient backward will receive (reduce only).
    grad_weight_into: None, or an fp32 (V, H) tensor d(weight) is added into (then no
    gradient is returned for weight). grad_enabled: torch.is_grad_enabled() at the call;
    inside forward it is always False, and ctx.needs_input_grad says True under
    torch.no_grad() for inputs that require grad. vocab_rows, want_hits: as in
    chunked_linear_cross_entropy (row_kernel may be the vocabulary-parallel one, which runs
    collectives: then every rank of its group calls forward and backward alike).
    """

    @staticmethod
    def forward(
        ctx, hidden, positions, weight, bias, labels, row_scale, options, row_kernel, reduce, chunk_rows, gemm_dtype,
        grad_scale, grad_weight_into, grad_enabled, vocab_rows=None, want_hits=False,
    ):
        ctx.options, ctx.row_kernel, ctx.chunk_rows, ctx.gemm_dtype = options, row_kernel, chunk_rows, gemm_dtype
        ctx.vocab_rows = vocab_rows
        ctx.grad_scale = grad_scale
        ctx.needs_grad = tuple(grad_enabled and needed for needed in (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:4]))
        # With grad_scale the gradients are made for grad_scale x loss: it scales every row's d(logits).
        gradient_row_scale = row_scale if grad_scale is None else row_scale * grad_scale
        loss, zloss, logprob, hits, *grads = chunked_linear_cross_entropy(
            hidden, positions, weight, bias, labels, gradient_row_scale, options, row_kernel, chunk_rows,
            ctx.needs_grad if reduce else (False,) * 3, gemm_dtype, grad_weight_into, vocab_rows, want_hits,
        )
        # Finished gradients for the first backward; not saved tensors, so that backward can
        # scale them in place and hand them over (a copy of d(weight) would double the peak
        # memory for large vocabularies).
        ctx.precomputed_grads = grads if reduce else None
        # hidden, not its gathered rows: an input costs nothing to keep; only reduction "none"
        # (and a second backward) reads it again.
        ctx.save_for_backward(hidden, positions, weight, bias, labels, row_scale)
        ctx.mark_non_differentiable(zloss, logprob, *([hits] if hits is not None else []))
        return ((loss * row_scale).sum() if reduce else loss), zloss, logprob, hits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_zloss, _grad_logprob, _grad_hits):
        hidden, positions, weight, bias, labels, row_scale = ctx.saved_tensors
        if ctx.precomputed_grads is not None:
            grads, ctx.precomputed_grads = ctx.precomputed_grads, None
            if ctx.grad_scale is None:
                grads = [None if g is None else g.mul_(grad_loss) for g in grads]
            else:
                check_upstream_gradient(grad_loss, ctx.grad_scale)
        else:
            # Reduction "none" (a different upstream gradient per row, while d(weight) sums over
            # rows), or a second backward through a retained graph: recompute the blocks.
            scale = row_scale * grad_loss.to(row_scale.dtype)
            grads = chunked_linear_cross_entropy(
                hidden, positions, weight, bias, labels, scale, ctx.options, ctx.row_kernel, ctx.chunk_rows, ctx.needs_grad,
                ctx.gemm_dtype, vocab_rows=ctx.vocab_rows,
            )[4:]
        grad_hidden, grad_weight, grad_bias = grads
        return grad_hidden, None, grad_weight, grad_bias, *(None,) * 12
