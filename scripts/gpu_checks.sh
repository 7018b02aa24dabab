#!/usr/bin/env bash
# The GPU checks of hpsft.ops in one run (~8 minutes on one H200), from the repository root:
#   1. environment: venv .venv-gpu, torch, hpsft, liger-kernel (each best effort, bounded)
#   2. nvidia-smi and versions
#   3. pytest tests/ops (CPU tests + tests/ops/test_gpu_backends.py)      -> exit status
#   4. benchmarks/bench_varlen_ce.py --device cuda (the 60 %-of-peak target case)
#   5. benchmarks/bench_packing.py --device cuda --sequences 256
# Logs go to ${OUT:-gpu_results}/ (5 files: env.log tests.log bench_varlen_ce.log
# bench_packing.log summary.txt). Exits non-zero when the tests fail or torch sees no GPU;
# a failed benchmark is reported in summary.txt but does not change the exit status.
#
# Modes (environment variables):
#   GPU_CHECKS_PREPARE=1  on the CPU machine, before lending the GPU: download the wheels the
#                         GPU machine cannot fetch (it has no network) into .whl/ (git-ignored
#                         through .git/info/exclude), then exit. Carry .whl in the device call.
#   GPU_CHECKS_DRY_RUN=1  on a machine without GPU: skip the venv and nvidia-smi, use
#                         .venv/bin/python, run the CPU-safe parts (tests with GPU tests
#                         skipped, benchmarks on CPU at small sizes) to check this script's flow.
# docs/ops.md ("GPU checks") has the exact device call.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${GPU_CHECKS_PREPARE:-0}" == 1 ]]; then
    # cp312 manylinux wheels for the H200 image's Python 3.12. torch, triton, numpy,
    # cloudpickle, transformers are in that image already; these are not.
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    timeout 300 python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl liger-kernel tensordict==0.15.3 pyvers==0.2.3
    status=$?
    ls -la .whl
    exit $status
fi

OUT_DIR="${OUT:-gpu_results}"
mkdir -p "$OUT_DIR"
# Keep what this script creates out of `git status` (where the tree has a .git).
for ignored in /.venv-gpu/ /gpu_results/; do
    [[ -d .git/info ]] && ! grep -qx "$ignored" .git/info/exclude 2>/dev/null && echo "$ignored" >>.git/info/exclude
done
DRY_RUN="${GPU_CHECKS_DRY_RUN:-0}"
# One JIT cache for pytest (tests/ops/conftest.py uses the same path) and the benchmark's
# child processes, so the CUDA extension is compiled once per run.
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"
export PYTHONUNBUFFERED=1
# hpsft imports from this tree even when the editable install below fails (offline).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Without network pip must fail in seconds, not retry for minutes.
export PIP_RETRIES=0 PIP_TIMEOUT=10 PIP_DISABLE_PIP_VERSION_CHECK=1
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME SECONDS LOG COMMAND...: run bounded, append to LOG, record the status
    local name=$1 seconds=$2 log=$3
    shift 3
    echo "=== $name: $* (timeout ${seconds}s)" >>"$log"
    local start=$SECONDS
    timeout "$seconds" "$@" >>"$log" 2>&1
    local status=$?
    note "$name: exit $status ($((SECONDS - start)) s)$([[ $status == 124 ]] && echo ', TIMED OUT')"
    return $status
}

ENV_LOG="$OUT_DIR/env.log"
if [[ "$DRY_RUN" == 1 ]]; then
    note "DRY RUN: no venv, no GPU; .venv/bin/python"
    PY=.venv/bin/python
    DEVICE=cpu
else
    DEVICE=cuda
    # Carried wheels (GPU_CHECKS_PREPARE=1) go to a folder on PYTHONPATH, so they serve
    # whichever interpreter runs below (.venv-gpu or the image's python3).
    if compgen -G ".whl/*.whl" >/dev/null; then
        step carried-wheels 120 "$ENV_LOG" python3 -m pip install --no-index --no-deps --upgrade \
            --target .cache/gpu_site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:$PWD/.cache/gpu_site"
    fi
    # The lent H200 has no network; its image's python3 (itself a venv, /opt/torch/.venv)
    # holds a CUDA torch, triton, pytest and transformers. --system-site-packages exposes the
    # base interpreter's packages, which may not include those: if .venv-gpu ends up without
    # a working CUDA torch (pip could not reach an index), the image's python3 is used.
    step venv 60 "$ENV_LOG" python3 -m venv --system-site-packages .venv-gpu
    PY=.venv-gpu/bin/python
    step pip-torch 180 "$ENV_LOG" "$PY" -m pip install torch==2.13.0
    step pip-build-tools 60 "$ENV_LOG" "$PY" -m pip install setuptools wheel ninja
    # flash-attn is deliberately absent ([dev] does not pull it; building it takes far too long).
    # setup.py builds the C++ and CUDA extensions here; if the install cannot run, the tests
    # JIT-build them into TORCH_EXTENSIONS_DIR instead.
    step pip-hpsft 240 "$ENV_LOG" "$PY" -m pip install --no-build-isolation -e ".[dev]" ||
        step pip-hpsft-no-deps 180 "$ENV_LOG" "$PY" -m pip install --no-build-isolation --no-deps -e .
    "$PY" -c "import liger_kernel" 2>/dev/null ||
        step pip-liger 90 "$ENV_LOG" "$PY" -m pip install liger-kernel
    # A venv whose torch broke (e.g. an install cut off by its timeout) falls back to the image's.
    if ! "$PY" -c "import torch; assert torch.cuda.is_available()" >>"$ENV_LOG" 2>&1; then
        note "torch in .venv-gpu does not see a GPU; falling back to the image's python3"
        PY=python3
    fi
    timeout 30 nvidia-smi >>"$ENV_LOG" 2>&1
fi

timeout 120 "$PY" - >>"$ENV_LOG" 2>&1 <<'EOF'
import importlib, platform, sys
import torch
print("python", sys.version.split()[0], platform.machine(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("triton", "liger_kernel", "transformers", "tensordict", "hpsft"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as error:
        print(name, "NOT importable:", error)
EOF
grep -E '^(python|torch|device|triton|liger_kernel|transformers|tensordict|hpsft) ' "$ENV_LOG" | tee -a "$SUMMARY"

if [[ "$DEVICE" == cuda ]] && ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    note "FAIL: torch sees no CUDA device; the GPU tests would only be skipped"
    exit 2
fi

# Tests: the exit status of this script. -rs lists why a backend was skipped.
step pytest 330 "$OUT_DIR/tests.log" "$PY" -m pytest tests/ops -q -rs -p no:cacheprovider
TEST_STATUS=$?
tail -n 25 "$OUT_DIR/tests.log" | grep -E 'passed|failed|error|SKIPPED.*test_gpu' | tail -n 8 | tee -a "$SUMMARY"

BENCH_LOG="$OUT_DIR/bench_varlen_ce.log"
if [[ "$DEVICE" == cuda ]]; then
    # The target case (N=8192, H=4096, V=128256) and its chat-like variant (a third supervised).
    step bench-varlen-ce 240 "$BENCH_LOG" "$PY" benchmarks/bench_varlen_ce.py --device cuda --repeats 5 \
        --case 4096 128256 8192 1.0 --case 4096 128256 8192 0.3333
else
    step bench-varlen-ce 240 "$BENCH_LOG" "$PY" benchmarks/bench_varlen_ce.py --quick
fi
grep -E '^target|\| hpsft' "$BENCH_LOG" | tee -a "$SUMMARY"

PACK_LOG="$OUT_DIR/bench_packing.log"
MODEL=.cache/models/smollm2-135m-4l
if [[ -f $MODEL/config.json && ! -f $MODEL/model.safetensors ]]; then
    # The weights (166 MB) exceed what a device call carries (64 MiB); random weights of the
    # same architecture cost the same time per token, which is all bench_packing measures.
    step random-weights 120 "$PACK_LOG" "$PY" -c "
import sys
from transformers import AutoConfig, AutoModelForCausalLM
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1])).save_pretrained(sys.argv[1])
print('random weights written to', sys.argv[1])" "$MODEL"
fi
if [[ "$DEVICE" == cuda ]]; then
    step bench-packing 150 "$PACK_LOG" "$PY" benchmarks/bench_packing.py --device cuda --sequences 256
else
    step bench-packing 150 "$PACK_LOG" "$PY" benchmarks/bench_packing.py --device cpu --sequences 16
fi
tail -n 6 "$PACK_LOG" >>"$SUMMARY"

note "tests: $([[ $TEST_STATUS == 0 ]] && echo PASSED || echo "FAILED (exit $TEST_STATUS)"); logs in $OUT_DIR/"
exit $TEST_STATUS
