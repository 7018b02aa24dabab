"""CUDA row kernel from csrc/varlen_ce_cuda*.{cpp,cu} (contract: row_options), fp32 blocks."""

import functools

import torch

from hpsft.ops import native_build
from hpsft.ops.native_extensions import load_extension, native_rows_forward_
from hpsft.ops.row_options import RowOptions


@functools.cache
def _extension():
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    flags = native_build.cuda_compile_args()
    return load_extension(
        native_build.CUDA_EXTENSION,
        "hpsft_varlen_ce_cuda",
        native_build.CUDA_SOURCES,
        extra_cflags=flags["cxx"],
        extra_cuda_cflags=flags["nvcc"],
    )


def cuda_rows_forward_(block, labels, row_scale, options: RowOptions, compute_grad: bool):
    return native_rows_forward_(_extension()[0], block, labels, row_scale, options, compute_grad)


def load_cuda_row_kernel():
    module, reason = _extension()
    return (cuda_rows_forward_, "") if module is not None else (None, reason)
