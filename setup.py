"""Builds hpsft's native varlen cross-entropy kernels next to the pure-Python package.

Metadata lives in pyproject.toml; this file only adds the optional extensions:
  hpsft.ops._varlen_ce_cpu   C++/OpenMP row kernel (csrc/varlen_ce_cpu.cpp), always tried
(the GPU row kernel is Triton's, compiled by Triton at run time)
Install with `pip install --no-build-isolation -e .` (the build needs the installed torch).
If an extension cannot be built (no torch at build time, no compiler, HPSFT_BUILD_EXTENSIONS=0)
the install still succeeds as pure Python: hpsft.ops then JIT-builds the C++ kernel into
$TORCH_EXTENSIONS_DIR on first use, or falls back to its torch kernel.
"""

import importlib.util
import os
import warnings
from pathlib import Path

from setuptools import setup


def _native_build():
    # Loaded by path: importing the hpsft package here would import torch-dependent modules.
    path = Path(__file__).parent / "hpsft" / "ops" / "native_build.py"
    spec = importlib.util.spec_from_file_location("hpsft_native_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extensions_and_commands():
    if os.environ.get("HPSFT_BUILD_EXTENSIONS", "1") == "0":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        warnings.warn("torch is not importable at build time: installing hpsft without native kernels")
        return [], {}

    class OptionalBuildExtension(BuildExtension):
        """A failed build leaves a pure-Python install (and a warning) instead of no install."""

        def run(self):
            try:
                super().run()
            except Exception as error:  # no compiler, broken toolchain, ...: see the docstring above
                warnings.warn(f"hpsft native kernels not (all) built, hpsft.ops will JIT-build or use torch: {error}")

    build = _native_build()
    extensions = [
        CppExtension(
            build.CPU_EXTENSION,
            build.CPU_SOURCES,
            extra_compile_args=build.cpu_compile_args(),
            extra_link_args=build.cpu_link_args(),
        )
    ]
    return extensions, {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = _extensions_and_commands()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
