"""Throughput accounting: model FLOPs of a packed step and a measured matmul peak for MFU."""

import time

import torch


def flop_counts(lm) -> tuple[int, int]:
    """(body, head) parameter counts: the matmul weights every token goes through, and the
    LM head. The input embedding is a lookup, not a matmul (unless tied to the head)."""
    head = lm.get_output_embeddings().weight
    skip = {id(lm.get_input_embeddings().weight), id(head)}
    body = sum(p.numel() for p in lm.parameters() if id(p) not in skip)
    return body, head.numel()


def model_flops(body_params: int, head_params: int, n_layers: int, hidden_size: int,
                lengths: list[int], loss_tokens: int) -> float:
    """Training FLOPs (forward + backward) the SFT step needs for these sequences.

    6 per body weight per token; the LM head only on the positions whose loss is taken
    (the loss needs no logits elsewhere, so a trainer computing them does extra work,
    which shows as a lower MFU); causal attention: per layer, scores and weighted sum cost
    4 * len^2 * hidden forward, halved by the mask, tripled for forward + backward,
    counted per sequence as packing computes it.
    """
    attention = 6 * n_layers * hidden_size * sum(n * n for n in lengths)
    return 6.0 * body_params * sum(lengths) + 6.0 * head_params * loss_tokens + attention


def measure_matmul_peak(rows: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                        device: torch.device, trials: int = 5, seconds_per_trial: float = 0.1) -> float:
    """FLOP/s of a GEMM of the model's MLP shape on this device: the ceiling MFU is read against.

    The best of several short trials: a busy neighbour process lowers some trials, and a
    peak measured low would inflate every MFU reading after it.
    """
    a = torch.randn(rows, hidden_size, dtype=dtype, device=device)
    b = torch.randn(hidden_size, intermediate_size, dtype=dtype, device=device)
    torch.matmul(a, b)  # warm-up (thread pools, kernels)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = 0.0
    for _ in range(trials):
        sync()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds_per_trial:
            torch.matmul(a, b)
            count += 1
        sync()
        best = max(best, 2.0 * rows * hidden_size * intermediate_size * count / (time.perf_counter() - start))
    return best
