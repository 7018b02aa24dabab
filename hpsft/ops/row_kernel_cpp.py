"""C++ (CPU) row kernel: the extension built by setup.py, else JIT-built from csrc/.

The JIT build goes to $TORCH_EXTENSIONS_DIR (tests point it at .cache/torch_extensions in
the repository) and takes ~1 minute once; later processes load the cached library.
If neither works, `load_cpp_row_kernel` says why and backend="auto" falls back to torch.
"""

import functools
import importlib
import os
import warnings

from hpsft.ops import native_build
from hpsft.ops.row_options import RowOptions


@functools.cache
def _extension():
    """(module, "") or (None, why it is unavailable)."""
    try:
        return importlib.import_module(native_build.CPU_EXTENSION), ""
    except ImportError as prebuilt_error:
        reason = f"not built by setup.py ({prebuilt_error})"
    sources = [str(native_build.REPO_ROOT / source) for source in native_build.CPU_SOURCES]
    if not all(os.path.exists(path) for path in sources):
        return None, f"{reason}, and the csrc/ sources are not available for a JIT build"
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name="hpsft_varlen_ce_cpu",
            sources=sources,
            extra_cflags=native_build.cpu_compile_args(),
            extra_ldflags=native_build.cpu_link_args(),
        )
        return module, ""
    except Exception as jit_error:  # compiler missing, headers broken, ...: fall back loudly
        warnings.warn(f"hpsft: JIT build of the C++ cross-entropy kernel failed, using torch: {jit_error}")
        return None, f"{reason}, and the JIT build failed: {jit_error}"


def cpp_rows_forward_(block, labels, row_scale, options: RowOptions, compute_grad: bool):
    module, _ = _extension()
    return tuple(
        module.rows_forward_(
            block, labels, row_scale, options.softcap, options.label_smoothing, options.z_loss_weight, compute_grad
        )
    )


def load_cpp_row_kernel():
    module, reason = _extension()
    return (cpp_rows_forward_, "") if module is not None else (None, reason)
