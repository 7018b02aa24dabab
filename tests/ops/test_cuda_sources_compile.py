"""The CUDA kernel cannot run here, but its sources must compile: nvcc for the kernel, the host
compiler against torch's headers for the binding."""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

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
        NVCC, "-c", "-O3", "--use_fast_math",
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
        str(CSRC / "varlen_ce_cuda_kernel.cu"), "-o", str(tmp_path / "kernel.o"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    symbols = subprocess.run(["nm", str(tmp_path / "kernel.o")], capture_output=True, text=True).stdout
    assert "hpsft_varlen_ce_rows_f32" in symbols


@pytest.mark.skipif(NVCC is None, reason="nvcc (and its CUDA headers) is not installed")
def test_cuda_binding_compiles_against_torch_headers(tmp_path):
    # A CPU build of torch ships c10/cuda headers but not the one CMake generates for them;
    # in CUDA builds it only defines this macro.
    generated = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True)
    generated.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cuda_include = cuda_include_dir()
    command = [
        "c++", "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=_varlen_ce_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{path}" for path in include_paths()), f"-I{tmp_path}", f"-I{cuda_include}",
        f"-I{sysconfig.get_paths()['include']}", str(CSRC / "varlen_ce_cuda.cpp"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
