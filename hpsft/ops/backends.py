"""Which row kernel runs: the dispatcher behind backend="auto"|"cpp"|"triton"|"torch".

auto: on a GPU Triton, else torch; on CPU the C++ extension (built by setup.py or JIT-built
on first use), else torch. fp64 runs on cpp (CPU) or torch only. An explicitly requested
backend that cannot run raises and says why. There is one GPU row kernel, Triton's: a CUDA
one existed, was never faster on paper (same two sweeps per row) and never ran, while
Triton's is checked on CPU by its interpreter (docs/ops.md).

Meta tensors (shapes and dtypes, no data) take the CUDA path: the byte accounting
(byte_accounting.py) replays a GPU step's allocations on them, so every choice the CUDA path
makes from the device is made the same way for meta.
"""

import os

import torch

from hpsft.ops.row_options import RowKernel, ShardKernels

BACKENDS = ("auto", "cpp", "triton", "torch")


def runs_cuda_path(device: torch.device) -> bool:
    """CUDA tensors, or meta tensors standing in for them."""
    return device.type in ("cuda", "meta")


def _load(name: str, device: torch.device, dtype: torch.dtype) -> tuple[RowKernel | None, str]:
    """(kernel, "") when `name` can run on this device and dtype, else (None, why not)."""
    if name == "torch":
        from hpsft.ops.row_kernel_torch import torch_rows_forward_

        return torch_rows_forward_, ""
    if name == "cpp":
        if device.type != "cpu":
            return None, f"the C++ kernel runs on CPU tensors, got {device}"
        from hpsft.ops.row_kernel_cpp import load_cpp_row_kernel

        return load_cpp_row_kernel()
    if dtype == torch.float64:
        return None, f"the {name} kernel computes in fp32; use backend='cpp' or 'torch' for fp64"
    if name == "triton":
        if not runs_cuda_path(device) and os.environ.get("TRITON_INTERPRET") != "1":
            return None, f"Triton needs CUDA tensors, or TRITON_INTERPRET=1 (set before import) for {device} tensors"
        try:
            from hpsft.ops.row_kernel_triton import load_triton_row_kernel
        except ImportError as error:
            return None, f"Triton is not importable ({error})"
        return load_triton_row_kernel()
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def select_row_kernel(requested: str, device: torch.device, dtype: torch.dtype) -> tuple[str, RowKernel]:
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested != "auto":
        kernel, reason = _load(requested, device, dtype)
        if kernel is None:
            raise RuntimeError(f"backend={requested!r} cannot run: {reason}")
        return requested, kernel
    native = ("triton",) if runs_cuda_path(device) else ("cpp",)
    for name in (*native, "torch"):  # torch always loads
        kernel, _ = _load(name, device, dtype)
        if kernel is not None:
            return name, kernel


def shard_kernels(name: str) -> ShardKernels:
    """The vocabulary-parallel passes of the backend select_row_kernel chose (and so could load)."""
    if name == "cpp":
        from hpsft.ops.row_kernel_cpp import cpp_shard_grad_, cpp_shard_stats_

        return ShardKernels(cpp_shard_stats_, cpp_shard_grad_)
    if name == "triton":
        from hpsft.ops.row_kernel_triton import triton_shard_grad_, triton_shard_stats_

        return ShardKernels(triton_shard_stats_, triton_shard_grad_)
    from hpsft.ops.row_kernel_torch import torch_shard_grad_, torch_shard_stats_

    return ShardKernels(torch_shard_stats_, torch_shard_grad_)
