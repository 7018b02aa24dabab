"""Peak extra memory of one fwd+bwd of the fused loss on the GPU, counted on a CPU machine.

The CUDA code path's host logic runs on meta tensors (shapes and dtypes, no data): the same
functions, shapes, dtypes and order of allocations as on a GPU, with the Triton launch the
one thing skipped (it writes in place and allocates nothing). LiveBytes counts the bytes
every call allocates, as CUDA's caching allocator counts them, and keeps the peak. That peak
is what `benchmarks/bench_varlen_ce.py --device cuda` measures: max_memory_allocated()
during a step minus memory_allocated() before it, with the inputs (hidden, weight, the
token tensors) allocated before and the gradients of the step counted.

What runs on the CPU instead, because it reads values: turning input_ids/loss_mask/offsets
into the supervised rows (varlen_targets, which checks them and needs nonzero's data-
dependent size). Its outputs are then allocated on the meta device inside the count, as they
are on the GPU; the temporaries it frees before the loss starts are not counted (a few
bytes per token, gone before the large buffers exist).

Under tensor parallelism (tp_size > 1) one rank of the vocabulary-parallel form is replayed: its
weight is its shard of the vocabulary padded as Megatron pads it (to a multiple of 128 x TP), the
TP group a process group of torch's "fake" backend (a rank and a size, no data: the op's
collectives are skipped on meta tensors anyway, as an in-place all-reduce allocates nothing in
the caching allocator). NCCL's own communication buffers are not the caching allocator's
(NCCL allocates them itself, NCCL_BUFFSIZE per channel and peer), so max_memory_allocated does not
see them either, and neither does this count.

Liger-Kernel's fused linear cross-entropy is accounted from its algorithm as its source
documents it (liger_kernel/ops/fused_linear_cross_entropy.py, the version the GPU run
measured): zeros_like(input) for d(input) and zeros_like(weight) for d(weight), both in the
inputs' dtype, an fp32 loss per row, a target mask, and one logits chunk in the inputs'
dtype of next_power_of_2(ceil(N / ceil(V / H))) rows that every chunk reuses (its kernel
writes d(logits) over it in place; its GEMMs write into preallocated outputs).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpsft.ops import varlen_targets
from hpsft.ops.chunk_rows import liger_chunk_rows
from hpsft.ops.live_bytes import LiveBytes
from hpsft.ops.varlen_cross_entropy import linear_cross_entropy_of_targets
from hpsft.ops.vocab_parallel import vocab_shard

IGNORE_INDEX = -100
MiB = 2**20
MEGATRON_VOCAB_MULTIPLE = 128  # make_vocab_size_divisible_by: V is padded to a multiple of it x TP


@dataclass(frozen=True)
class Accounted:
    peak_bytes: int  # the step's peak of memory allocated on top of its inputs
    at_peak: list  # (shape, dtype, bytes) of each tensor alive at the peak, largest first

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MiB

    def describe(self, top: int = 6) -> str:
        parts = [f"{tuple(shape)} {str(dtype).removeprefix('torch.')} {nbytes / MiB:.1f}" for shape, dtype, nbytes in self.at_peak[:top]]
        rest = sum(nbytes for *_, nbytes in self.at_peak[top:])
        return "; ".join(parts) + (f"; {len(self.at_peak) - top} more {rest / MiB:.1f}" if rest else "")


def packed_supervision(tokens: int, seq_len: int = 512, supervised_fraction: float = 1.0):
    """input_ids, offsets, loss_mask and the aligned labels (IGNORE_INDEX where a row predicts
    nothing) of `tokens` packed into sequences of seq_len, each a prompt then a supervised
    answer (the last supervised_fraction of its tokens). The layout of bench_varlen_ce.py."""
    seq_len = min(seq_len, tokens)
    input_ids = torch.randint(0, 2, (tokens,))  # values do not matter to the count, only which rows are supervised
    offsets = torch.arange(0, tokens + 1, seq_len)
    if offsets[-1] != tokens:
        offsets = torch.cat([offsets, torch.tensor([tokens])])
    position = torch.arange(tokens) % seq_len
    loss_mask = (position >= round((1 - supervised_fraction) * seq_len)).long()
    labels = torch.full((tokens,), IGNORE_INDEX)
    starts = torch.zeros(tokens + 1, dtype=torch.bool)
    starts[offsets] = True
    predicts = loss_mask[1:].bool() & ~starts[1:tokens]
    labels[:-1][predicts] = input_ids[1:][predicts]
    return input_ids, offsets, loss_mask, labels


def _meta_inputs(tokens, hidden_size, vocab_size, dtype):
    hidden = torch.empty(tokens, hidden_size, dtype=dtype, device="meta", requires_grad=True)
    weight = torch.empty(vocab_size, hidden_size, dtype=dtype, device="meta", requires_grad=True)
    return hidden, weight


def shard_rows(vocab_size: int, tp_size: int) -> int:
    """Weight rows a TP rank holds: the vocabulary padded to a multiple of 128 x TP, split evenly."""
    multiple = MEGATRON_VOCAB_MULTIPLE * tp_size
    return -(-vocab_size // multiple) * multiple // tp_size


@contextlib.contextmanager
def fake_tp_group(tp_size: int, tp_rank: int):
    """A process group of tp_size in which this process is tp_rank, of torch's "fake" backend
    (torch.testing._internal.distributed.fake_pg: collectives that move nothing), as the default
    group of this process while the block runs; None for tp_size 1."""
    if tp_size == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("the byte accounting under tensor parallelism needs a process without a process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=tp_rank, world_size=tp_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def account_hpsft(tokens, hidden_size, vocab_size, dtype=torch.bfloat16, *, seq_len=512, supervised_fraction=1.0,
                  weight_grad_in_engine=False, tp_size=1, tp_rank=0, **loss_options) -> Accounted:
    """hpsft's varlen_linear_cross_entropy (reduction sum unless loss_options say otherwise),
    fwd + bwd w.r.t. hidden and weight, as on CUDA. weight_grad_in_engine: d(weight) is summed
    into an fp32 (V, H) gradient the engine holds (allocated before the step, like the
    inputs), with grad_scale=1 (what a reduction-sum loss's backward sends). tp_size > 1: TP
    rank tp_rank of the vocabulary-parallel form (module docstring), its weight shard_rows rows."""
    input_ids, offsets, loss_mask, _ = packed_supervision(tokens, seq_len, supervised_fraction)
    targets = varlen_targets.from_input_ids(input_ids, loss_mask, offsets, tokens, vocab_size)
    rows = vocab_size if tp_size == 1 else shard_rows(vocab_size, tp_size)
    hidden, weight = _meta_inputs(tokens, hidden_size, rows, dtype)
    options = {"reduction": "sum", "denominator": None, "label_smoothing": 0.0, "z_loss_weight": 0.0, "softcap": None,
               "return_logprobs": False, "backend": "auto", "chunk_rows": None, "gemm_dtype": None, **loss_options}
    if weight_grad_in_engine:
        engine_grad = torch.zeros(rows, hidden_size, dtype=torch.float32, device="meta")
        options |= {"grad_scale": 1.0, "grad_weight_into": engine_grad}
    with fake_tp_group(tp_size, tp_rank) as group, LiveBytes() as count:
        options["shard"] = vocab_shard(rows, group, vocab_size=vocab_size)
        on_device = varlen_targets.SupervisedPositions(
            *(t.to("meta") for t in (targets.positions, targets.labels, targets.sequence_ids)), targets.num_sequences)
        out = linear_cross_entropy_of_targets(hidden, weight, None, on_device, **options)
        out.loss.backward()
        del out, on_device  # what the step leaves behind is its gradients
    return Accounted(count.peak, count.at_peak)


def liger_fused_linear_cross_entropy_allocations(hidden, weight, labels):
    """The allocations of Liger's fused linear cross-entropy, fwd + bwd with a scalar
    upstream gradient of 1 (backward then only returns the gradients made in forward), in
    its order. Runs on meta tensors: the kernel's in-place work has no allocation to replay."""
    tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    rows = liger_chunk_rows(tokens, hidden_size, vocab_size)
    grad_input = torch.zeros_like(hidden)
    grad_weight = torch.zeros_like(weight)
    loss_1d = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
    target_mask = labels != IGNORE_INDEX
    logits = torch.empty(rows, vocab_size, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, tokens, rows):
        stop = min(start + rows, tokens)
        chunk = logits[: stop - start]
        torch.mm(hidden[start:stop], weight.t(), out=chunk)
        torch.mm(chunk, weight, out=grad_input[start:stop])
        torch.addmm(grad_weight, chunk.t(), hidden[start:stop], out=grad_weight)
    loss = loss_1d.sum()
    del logits, target_mask, loss_1d
    return loss, grad_input, grad_weight


def account_liger(tokens, hidden_size, vocab_size, dtype=torch.bfloat16, *, seq_len=512,
                  supervised_fraction=1.0) -> Accounted:
    """Liger's fused linear cross-entropy (reduction sum) at the same shape, its gradients
    handed to hidden and weight as autograd would (hidden.grad, weight.grad)."""
    *_, labels = packed_supervision(tokens, seq_len, supervised_fraction)
    hidden, weight = _meta_inputs(tokens, hidden_size, vocab_size, dtype)
    labels = labels.to("meta")  # an input, allocated before the step like hidden and weight
    with LiveBytes() as count:
        with torch.no_grad():
            _, grad_input, grad_weight = liger_fused_linear_cross_entropy_allocations(hidden, weight, labels)
        hidden.grad, weight.grad = grad_input, grad_weight
        del grad_input, grad_weight
    return Accounted(count.peak, count.at_peak)
