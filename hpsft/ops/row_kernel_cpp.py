"""C++ (CPU) row kernel from csrc/varlen_ce_cpu.cpp (contract: row_options)."""

import functools

from hpsft.ops import native_build
from hpsft.ops.native_extensions import load_extension, native_rows_forward_
from hpsft.ops.row_options import RowOptions, round_into


@functools.cache
def _extension():
    return load_extension(
        native_build.CPU_EXTENSION,
        "hpsft_varlen_ce_cpu",
        native_build.CPU_SOURCES,
        extra_cflags=native_build.cpu_compile_args(),
        extra_ldflags=native_build.cpu_link_args(),
    )


def cpp_rows_forward_(block, labels, row_scale, options: RowOptions, compute_grad: bool, grad_out=None):
    losses = native_rows_forward_(_extension()[0], block, labels, row_scale, options, compute_grad)
    if compute_grad:
        round_into(block, grad_out)
    return losses


def cpp_shard_stats_(block, local_labels, options: RowOptions):
    """Pass 1 of the vocabulary-parallel form (contract in row_options)."""
    return tuple(_extension()[0].shard_stats_(block, local_labels, options.softcap))


def cpp_shard_grad_(block, local_labels, lse, p_factor, uniform, target_coef, options: RowOptions, grad_out=None):
    """Pass 2 of the vocabulary-parallel form (contract in row_options)."""
    _extension()[0].shard_grad_(block, local_labels, lse, p_factor, uniform, target_coef, options.softcap)
    round_into(block, grad_out)


def load_cpp_row_kernel():
    module, reason = _extension()
    return (cpp_rows_forward_, "") if module is not None else (None, reason)
