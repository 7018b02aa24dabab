"""Loading a native kernel: the extension built by setup.py, else a JIT build from csrc/.

The JIT build goes to $TORCH_EXTENSIONS_DIR (tests point it at .cache/torch_extensions in the
repository), costs ~1 minute once, and later processes load the cached library. A prebuilt
extension wins even when csrc/ has changed since: rebuild with `pip install -e .` after edits.
"""

import importlib
import os
import warnings

from hpsft.ops import native_build


def load_extension(prebuilt_module: str, jit_name: str, sources: list[str], **build_args):
    """(module, "") or (None, why it is unavailable)."""
    try:
        return importlib.import_module(prebuilt_module), ""
    except ImportError as prebuilt_error:
        reason = f"not built by setup.py ({prebuilt_error})"
    paths = [str(native_build.REPO_ROOT / source) for source in sources]
    if not all(os.path.exists(path) for path in paths):
        return None, f"{reason}, and the csrc/ sources are not available for a JIT build"
    try:
        from torch.utils.cpp_extension import load

        return load(name=jit_name, sources=paths, **build_args), ""
    except Exception as jit_error:  # no compiler, broken toolchain, ...: report, let auto fall back
        warnings.warn(f"hpsft: JIT build of {jit_name} failed: {jit_error}")
        return None, f"{reason}, and the JIT build failed: {jit_error}"
