"""How many supervised rows the fused loss computes per chunk: its memory/time trade-off.

Every chunk's GEMMs read the whole weight twice and read and write the whole d(weight)
accumulator once, so fewer rows per chunk cost time; every row costs a (V,) fp32 logit row
of memory. The choice is by memory on both devices:

CPU: one LOGIT_BLOCK_BYTES block (682 rows at V=49152 fp32), at least CPU_MIN_CHUNK_ROWS:
at H=4096, V=128256, 2048 tokens (fp32, 2 threads, fwd+bwd) 261 rows (128 MiB) took 57.8 s,
1024 rows 42.5 s, 2048 rows 39-44 s, materialised logits 46.1 s (docs/performance.md).

CUDA (and meta, the byte accounting's stand-in for it): against the reference the memory
target is set by (issue 24), Liger-Kernel's fused linear cross-entropy given the same
`tokens` rows. Liger holds a 16-bit d(input) (tokens, H), a 16-bit d(weight) (V, H) and one
16-bit logits chunk of liger_chunk_rows rows. hpsft holds the same d(hidden) and, when it
returns d(weight), the same 16-bit accumulator; so its chunk (an fp32 logit row per row, the
16-bit d(logits) written over it, plus the row's gathered hidden state and d(hidden) row)
may take what Liger's chunk takes, less what hpsft keeps per row (positions, labels, losses).
With d(weight) summed into the engine's own fp32 gradient instead (nothing of that size is
the loss's), the whole op is held to a quarter of Liger's extra memory where d(hidden)
leaves room for that, and to Liger's chunk budget otherwise.
"""

LOGIT_BLOCK_BYTES = 128 * 2**20
CPU_MIN_CHUNK_ROWS = 1024
GPU_MAX_CHUNK_ROWS = 4096  # beyond ~4096 rows the GEMMs gain nothing (H200: docs/gpu_results.md)
# Bytes hpsft keeps per supervised row besides the chunk: positions, labels, sequence ids
# (int64), row scale, loss, z-loss, log-prob and two reductions' temporaries (fp32).
BYTES_PER_SUPERVISED_ROW = 3 * 8 + 6 * 4
BYTES_PER_TOKEN = 4  # the (tokens,) fp32 log-probabilities (return_logprobs)
LIGER_BYTES_PER_TOKEN = 4 + 1  # its fp32 loss per row and its target mask
ENGINE_BUFFER_SHARE_OF_LIGER = 0.25


def cpu_chunk_rows(vocab_size: int, itemsize: int) -> int:
    """CPU: rows of a LOGIT_BLOCK_BYTES block of `itemsize` logits, at least CPU_MIN_CHUNK_ROWS."""
    return max(CPU_MIN_CHUNK_ROWS, LOGIT_BLOCK_BYTES // (vocab_size * itemsize))


def liger_chunk_rows(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Rows of Liger's logits chunk: next_power_of_2(ceil(tokens / ceil(V / H))), at most
    `tokens` (liger_kernel/ops/fused_linear_cross_entropy.py): about tokens x H elements."""
    increase = -(-vocab_size // hidden_size)
    rows = -(-tokens // increase)
    return min(1 << (rows - 1).bit_length(), tokens)


def liger_extra_bytes(tokens: int, hidden_size: int, vocab_size: int, itemsize: int) -> int:
    """Liger's extra memory for a fwd+bwd: d(input), d(weight), its chunk, its per-row vectors."""
    chunk = liger_chunk_rows(tokens, hidden_size, vocab_size)
    return itemsize * (tokens * hidden_size + vocab_size * hidden_size + chunk * vocab_size) + LIGER_BYTES_PER_TOKEN * tokens


def cuda_chunk_rows(tokens: int, n_rows: int, hidden_size: int, vocab_size: int, itemsize: int,
                    weight_grad_in_engine: bool) -> int:
    """CUDA: the most rows (a multiple of 8 from 16 rows up, at most GPU_MAX_CHUNK_ROWS, at
    least 1) whose chunk keeps the op within the budget of the module docstring. `tokens`:
    rows of hidden; `n_rows`: the supervised ones; `itemsize`: of the inputs' dtype."""
    per_row = 4 * vocab_size + 2 * hidden_size * itemsize  # fp32 logits (d(logits) over them), gathered row, d(hidden) row
    kept = BYTES_PER_SUPERVISED_ROW * n_rows + BYTES_PER_TOKEN * tokens
    budget = itemsize * vocab_size * liger_chunk_rows(tokens, hidden_size, vocab_size) - kept
    if weight_grad_in_engine:
        quarter = ENGINE_BUFFER_SHARE_OF_LIGER * liger_extra_bytes(tokens, hidden_size, vocab_size, itemsize)
        if quarter - itemsize * tokens * hidden_size - kept >= 16 * per_row:
            budget = quarter - itemsize * tokens * hidden_size - kept
    rows = min(GPU_MAX_CHUNK_ROWS, max(1, int(budget // per_row)))
    return rows // 8 * 8 if rows >= 16 else rows
