"""Loading a native kernel: the extension built by setup.py, else a JIT build from csrc/.

The JIT build goes to $TORCH_EXTENSIONS_DIR (tests point it at .cache/torch_extensions in the
repository), costs ~1 minute once, and later processes load the cached library (torch
rebuilds it when the sources or flags change). A prebuilt extension older than its csrc/
sources is stale, e.g. after editing a kernel in an editable install: it is skipped for a
JIT build of the current sources until `pip install -e .` rebuilds it.
"""

import importlib
import importlib.util
import os
import warnings

from hpsft.ops import native_build
from hpsft.ops.row_options import RowOptions


def _prebuilt(module_name: str, sources: list[str]):
    """(module or None, why not)."""
    try:
        spec = importlib.util.find_spec(module_name)
    except ImportError as error:
        return None, f"not built by setup.py ({error})"
    if spec is None or spec.origin is None:
        return None, "not built by setup.py"
    existing = [path for path in sources if os.path.exists(path)]
    if existing and os.path.getmtime(spec.origin) < max(map(os.path.getmtime, existing)):
        return None, f"{spec.origin} is older than csrc/ (rebuild with pip install -e .)"
    return importlib.import_module(module_name), ""


def native_rows_forward_(module, block, labels, row_scale, options: RowOptions, compute_grad: bool):
    """Call a native row kernel: the C++ and CUDA bindings share this signature."""
    return tuple(
        module.rows_forward_(
            block, labels, row_scale, options.softcap, options.label_smoothing, options.z_loss_weight, compute_grad
        )
    )


def load_extension(prebuilt_module: str, jit_name: str, sources: list[str], **build_args):
    """(module, "") or (None, why it is unavailable)."""
    paths = [str(native_build.REPO_ROOT / source) for source in sources]
    module, reason = _prebuilt(prebuilt_module, paths)
    if module is not None:
        return module, ""
    if not all(os.path.exists(path) for path in paths):
        return None, f"{reason}, and the csrc/ sources are not available for a JIT build"
    try:
        from torch.utils.cpp_extension import load

        return load(name=jit_name, sources=paths, **build_args), ""
    except Exception as jit_error:  # no compiler, broken toolchain, ...: report, let auto fall back
        warnings.warn(f"hpsft: JIT build of {jit_name} failed: {jit_error}")
        return None, f"{reason}, and the JIT build failed: {jit_error}"
