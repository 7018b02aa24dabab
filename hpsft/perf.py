"""Throughput accounting: model FLOPs of a packed step and a measured matmul peak for MFU."""

import time

import torch


def model_flops(n_params: int, n_layers: int, hidden_size: int, lengths: list[int]) -> float:
    """Training FLOPs (forward + backward) the model needs for these sequences.

    6 * params per token for the dense layers, plus causal attention: per layer, the scores
    and the weighted sum cost 4 * len^2 * hidden forward, halved by the causal mask,
    tripled for forward + backward. Counted per sequence, as packing computes it.
    """
    tokens = sum(lengths)
    attention = 6 * n_layers * hidden_size * sum(n * n for n in lengths)
    return 6.0 * n_params * tokens + attention


def measure_matmul_peak(rows: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                        device: torch.device, seconds: float = 0.5) -> float:
    """FLOP/s of a GEMM of the model's MLP shape on this device: the ceiling MFU is read against."""
    a = torch.randn(rows, hidden_size, dtype=dtype, device=device)
    b = torch.randn(hidden_size, intermediate_size, dtype=dtype, device=device)
    torch.matmul(a, b)  # warm-up (thread pools, kernels)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, b)
        count += 1
    sync()
    return 2.0 * rows * hidden_size * intermediate_size * count / (time.perf_counter() - start)
