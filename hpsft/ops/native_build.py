"""How the native kernels are built: read by setup.py and by the JIT fallback alike.

Plain stdlib so setup.py can load this file without importing hpsft or torch.
"""

import platform
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_EXTENSION = "hpsft.ops._varlen_ce_cpu"  # setup.py puts it next to this file
CPU_SOURCES = ["csrc/varlen_ce_cpu.cpp"]


def _has_cpu_flag(flag: str) -> bool:
    try:
        return f" {flag} " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


def cpu_compile_args() -> list[str]:
    # -fopenmp: at::parallel_for and `omp simd` are header code compiled into the extension.
    # AVX2/FMA only when the building machine has them: the vocabulary loops are 8 floats wide,
    # a build for another x86 machine without them would still run (SSE2 baseline).
    # -fno-trapping-math: lets the clamps in exp_of vectorise; no code reads FP exception flags.
    args = ["-O3", "-fopenmp", "-fno-trapping-math"]
    if platform.machine() == "x86_64" and _has_cpu_flag("avx2") and _has_cpu_flag("fma"):
        args += ["-mavx2", "-mfma"]
    return args


def cpu_link_args() -> list[str]:
    return ["-fopenmp"]

