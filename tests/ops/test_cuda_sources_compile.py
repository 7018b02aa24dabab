"""The native sources must compile as C++17 (torch builds extensions as C++17 before it moved to
C++20, and pyproject allows torch >= 2.6): the C++ kernel and the CUDA binding against torch's
headers, the CUDA kernel with nvcc and the flags hpsft builds it with. The CUDA kernel cannot
run here."""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from hpsft.ops import native_build

CSRC = Path(__file__).resolve().parents[2] / "csrc"
NVCC = shutil.which("nvcc")


def cuda_include_dir() -> Path:
    # nvcc may be a wrapper script outside the toolkit (here /usr/local/bin/nvcc).
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", Path(NVCC).resolve().parents[1]]
    for home in filter(None, candidates):
        if (Path(home) / "include" / "cuda_runtime.h").exists():
            return Path(home) / "include"
    pytest.fail(f"no CUDA headers found in {candidates}: set CUDA_HOME to the toolkit next to {NVCC}")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_cuda_kernel_compiles_with_nvcc(tmp_path):
    command = [
        NVCC, "-c", "-std=c++17", *native_build.cuda_compile_args()["nvcc"],
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
        str(CSRC / "varlen_ce_cuda_kernel.cu"), "-o", str(tmp_path / "kernel.o"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    symbols = subprocess.run(["nm", str(tmp_path / "kernel.o")], capture_output=True, text=True).stdout
    assert "hpsft_varlen_ce_rows_f32" in symbols


def torch_header_syntax_check(source: Path, *include_dirs) -> subprocess.CompletedProcess:
    command = [
        "c++", "-std=c++17", "-fsyntax-only", f"-DTORCH_EXTENSION_NAME=_{source.stem}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{path}" for path in (*include_paths(), *include_dirs, sysconfig.get_paths()["include"])), str(source),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_cpu_kernel_is_cxx17():
    result = torch_header_syntax_check(CSRC / "varlen_ce_cpu.cpp")
    assert result.returncode == 0, result.stderr[-5000:]


@pytest.mark.skipif(NVCC is None, reason="nvcc (and its CUDA headers) is not installed")
def test_cuda_binding_compiles_against_torch_headers(tmp_path):
    # A CPU build of torch ships c10/cuda headers but not the one CMake generates for them;
    # in CUDA builds it only defines this macro.
    generated = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True)
    generated.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    result = torch_header_syntax_check(CSRC / "varlen_ce_cuda.cpp", tmp_path, cuda_include_dir())
    assert result.returncode == 0, result.stderr[-5000:]
