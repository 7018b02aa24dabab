#!/usr/bin/env bash
# The GPU checks in one bounded run (<= 8 minutes on one GPU), from the repository root:
#   1. environment: carried wheels (GPU_CHECKS_PREPARE=1), versions, nvidia-smi
#   2. tests: the GPU kernel tests, tests/ops/test_gpu_backends.py, tests/test_varlen_attention_gpu.py
#   3. bench: the loss benchmark, benchmarks/bench_varlen_ce.py --device cuda (bf16, N = 8k and
#      32k, H = 4096, V = 128256): torch.cuda.max_memory_allocated's extra for fwd+bwd of each
#      hpsft row against the byte accounting's figure (fails when off by > 2 %), and time and
#      memory against materialised logits, F.linear_cross_entropy and Liger-Kernel
#   4. step: an end-to-end bf16 ZeRO-1 step of a random-init Llama-3.2-1B-shaped model on packed
#      16k-token micro-batches (benchmarks/bench_gpu_step.py): tokens/s, MFU against 989
#      TFLOP/s, hpsft's loss against Liger's on the same batch
#   4b. megatron: the same step on the Megatron-Core engine (--engine megatron): tokens/s and MFU
#      at TP=1 on one GPU, TP=2 on 2 ranks when the device has 2 GPUs (a line otherwise)
#   5. ranks: the same step on 2 ranks (torchrun), and TP=2 against TP=1
#      (benchmarks/bench_tensor_parallel.py), when the device has 2 GPUs (a line otherwise)
#   6. train (not by default): a bf16 training run of configs/sft.yaml's SmolLM2-135M (random
#      weights of its architecture) with flash_attention_2 (hpsft_varlen where flash-attn is not
#      importable) and with sdpa: losses equal within bf16 tolerance, step times
#   7. ray (not by default): a Ray run (python -m hpsft.train_ray) with one GPU actor
#   8. qlora (not by default): a short QLoRA run (nf4, rank 16) of the training check's model in
#      bf16: the loss falls; the peak GPU memory is recorded
#   9. vision (not by default): the blank image's cost (benchmarks/bench_blank_image.py, bf16):
#      an imageless packed row's step with and without the tower pass on Qwen2-VL-2B's tower
# Every step runs under `timeout`, capped by what is left of GPU_CHECKS_BUDGET_S (470 s); a
# step the budget no longer allows is reported as skipped. One table, ${OUT:-gpu_results}/table.md,
# holds every step's result (read it first); each step's log sits next to it. Exit status: 0
# when every check that ran passed; checks that cannot run (flash-attn or ray not importable,
# one GPU for the 2-rank step) are reported as skipped, not passed.
#
# Modes (environment variables):
#   GPU_CHECKS_PREPARE=1  on the CPU machine, before lending the GPU: download the wheels the
#                         GPU machine cannot fetch (it has no network) into .whl/ (git-ignored
#                         through .git/info/exclude), then exit. Carry .whl in the device call.
#   GPU_CHECKS_ONLY="tests bench step megatron ranks"  the checks to run (the default; add train, ray, qlora, vision).
#   GPU_CHECKS_DRY_RUN=1  on a machine without GPU: .venv/bin/python, no venv, no nvidia-smi;
#                         the same steps on CPU at small sizes (GPU tests skipped, the
#                         benchmark's --account figures in place of its GPU run, the step on a
#                         tiny Llama, the 2-layer model in fp32 with hpsft_varlen in place of
#                         flash-attn) to check this script's flow; every step's timeout (and
#                         the budget) times GPU_CHECKS_TIMEOUT_SCALE, 4 by default there.
# docs/ops.md ("GPU checks") has the exact device call; docs/gpu_results.md what it measured on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${GPU_CHECKS_PREPARE:-0}" == 1 ]]; then
    # The H200 image (python3 3.12) has torch, triton, numpy, transformers, pytest, msgpack,
    # psutil, py-cpuinfo, einops, click, filelock, protobuf, requests; not deepspeed, omegaconf,
    # tensordict, pydantic, liger-kernel or ray. Versions pinned to what CI's venv runs.
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    download() {
        timeout 300 python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 "$@"
    }
    download -d .whl liger-kernel==0.8.5 tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 \
        hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 typing-extensions==4.16.0 jsonschema==4.26.0 referencing==0.37.0 \
        jsonschema-specifications==2025.9.1 rpds-py==2026.9.1 megatron-core==0.19.2 \
        peft==0.21.2 torchao==0.18.0 accelerate==1.16.0 &&
        # deepspeed ships an sdist only: a pure-Python wheel (ops JIT-build on first use).
        DS_BUILD_OPS=0 timeout 600 python3 -m pip wheel --no-deps -w .whl deepspeed==0.19.8 &&
        # ray's wheel (76 MB) alone exceeds what a device call carries (64 MiB). Its Java
        # jars, RLlib and the dashboard's web client are unused by hpsft: a copy without them.
        download -d "${TMPDIR:-/tmp}/hpsft_ray_wheel" ray==2.60.0 &&
        python3 - "${TMPDIR:-/tmp}"/hpsft_ray_wheel/ray-2.60.0-*.whl .whl <<'PY'
import os, sys, zipfile
source, folder = sys.argv[1], sys.argv[2]
unused = ("ray/jars/", "ray/rllib/", "ray/dashboard/client/")
with zipfile.ZipFile(source) as wheel, zipfile.ZipFile(
        os.path.join(folder, os.path.basename(source)), "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
    for item in wheel.infolist():
        if not item.filename.startswith(unused):
            out.writestr(item, wheel.read(item))
PY
    status=$?
    ls -la .whl
    du -sh .whl
    exit $status
fi

OUT_DIR="${OUT:-gpu_results}"
mkdir -p "$OUT_DIR"
# Keep what this script creates out of `git status` (where the tree has a .git).
for ignored in /gpu_results/; do
    [[ -d .git/info ]] && ! grep -qx "$ignored" .git/info/exclude 2>/dev/null && echo "$ignored" >>.git/info/exclude
done
DRY_RUN="${GPU_CHECKS_DRY_RUN:-0}"
ONLY=" ${GPU_CHECKS_ONLY:-tests bench step megatron ranks} "
wanted() { [[ "$ONLY" == *" $1 "* ]]; }
SCALE="${GPU_CHECKS_TIMEOUT_SCALE:-$([[ "$DRY_RUN" == 1 ]] && echo 4 || echo 1)}"
DEADLINE=$((SECONDS + ${GPU_CHECKS_BUDGET_S:-470} * SCALE))
# Training runs write checkpoints (GBs): outside $OUT, whose files all travel back.
RUNS_DIR="$(mktemp -d /tmp/hpsft_gpu_checks.XXXXXX)"
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# hpsft imports from this tree even when the editable install below fails (offline).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Without network pip must fail in seconds, not retry for minutes.
export PIP_RETRIES=0 PIP_TIMEOUT=10 PIP_DISABLE_PIP_VERSION_CHECK=1
TABLE="$OUT_DIR/table.md"
printf '| check | result | seconds | detail |\n|---|---|---|---|\n' >"$TABLE"
row() { echo "| $1 | $2 | $3 | ${4//|/\/} |" >>"$TABLE"; }  # a | in the detail would split the cell
FAILED=0

step() {  # step NAME SECONDS LOG COMMAND...: run under timeout (capped by the budget), log, status
    local name=$1 seconds=$(($2 * SCALE)) log=$3
    shift 3
    local left=$((DEADLINE - SECONDS))
    ((seconds > left)) && seconds=$left
    if ((seconds < 10)); then
        echo "=== $name: skipped, out of budget" >>"$log"
        return 125
    fi
    echo "=== $name: $* (timeout ${seconds}s)" >>"$log"
    local start=$SECONDS
    timeout "$seconds" "$@" >>"$log" 2>&1
    local status=$?
    echo "=== $name: exit $status after $((SECONDS - start)) s$([[ $status == 124 ]] && echo ', TIMED OUT')" >>"$log"
    return $status
}

result() {  # result NAME STATUS START LOG DETAIL: the table row of a step's exit status
    local name=$1 status=$2 seconds=$((SECONDS - $3)) log=$4 detail=$5
    case $status in
        0) row "$name" passed $seconds "$detail" ;;
        125) row "$name" "skipped (out of budget)" 0 "$detail" ;;
        124) row "$name" "FAILED (timed out)" $seconds "$detail; see $(basename "$log")"; FAILED=1 ;;
        *) row "$name" "FAILED (exit $status)" $seconds "$detail; see $(basename "$log")"; FAILED=1 ;;
    esac
}

check() {  # check NAME SECONDS LOG DETAIL COMMAND...: a step that is a row of the table
    local name=$1 seconds=$2 log=$3 detail=$4 start=$SECONDS
    shift 4
    step "$name" "$seconds" "$log" "$@"
    result "$name" $? $start "$log" "$detail"
}

ENV_LOG="$OUT_DIR/env.log"
if [[ "$DRY_RUN" == 1 ]]; then
    PY=.venv/bin/python
    DEVICE=cpu
else
    DEVICE=cuda
    # The lent H200 has no network; its image's python3 holds a CUDA torch, triton, pytest and
    # transformers. The wheels carried in .whl (GPU_CHECKS_PREPARE=1) supply the rest from a
    # folder on PYTHONPATH, and hpsft runs from this tree (PYTHONPATH above): no venv, no index.
    PY=python3
    if compgen -G ".whl/*.whl" >/dev/null; then
        step carried-wheels 90 "$ENV_LOG" "$PY" -m pip install --no-index --no-deps --no-compile \
            --upgrade --target .cache/gpu_site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:$PWD/.cache/gpu_site"
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
for name in ("triton", "flash_attn", "ray", "liger_kernel", "transformers", "deepspeed", "tensordict", "hpsft"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as error:
        print(name, "NOT importable:", type(error).__name__, str(error)[:200])
EOF
row environment "-" "$SECONDS" "$(grep -E '^(torch|device|triton|flash_attn|ray) ' "$ENV_LOG" | awk '{print $1, ($2 == "NOT" ? "not importable" : $2)}' | tr '\n' ';')"
has() { "$PY" -c "import $1" >/dev/null 2>&1; }

if [[ "$DEVICE" == cuda ]] && ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    row "GPU visible" FAILED 0 "torch sees no CUDA device: every GPU check would be skipped"
    cat "$TABLE"
    exit 2
fi

# 2. GPU kernel tests: a kernel that does not build fails them (never a skip on a GPU machine).
if wanted tests; then
    start=$SECONDS
    step "GPU kernel tests" 150 "$OUT_DIR/tests.log" "$PY" -m pytest tests/ops/test_gpu_backends.py \
        tests/test_varlen_attention_gpu.py -q -rs -p no:cacheprovider
    result "GPU kernel tests" $? $start "$OUT_DIR/tests.log" \
        "pytest tests/ops/test_gpu_backends.py tests/test_varlen_attention_gpu.py: $(grep -Eo '[0-9]+ (passed|failed|skipped|errors?)' "$OUT_DIR/tests.log" | tr '\n' ' ')"
fi

# 3. Loss benchmark (each method cross-checked against fp64 before it is timed; the measured
# peak extra memory of each hpsft row against its byte accounting: exit 3 when off by > 2 %).
BENCH_LOG="$OUT_DIR/bench_varlen_ce.log"
if ! wanted bench; then
    :
elif [[ "$DEVICE" == cuda ]]; then
    check "loss benchmark" 200 "$BENCH_LOG" "bench_varlen_ce.py --device cuda, N=8k and 32k, H=4096, V=128256 (exit 3: a measured peak off its accounting by > 2%)" \
        "$PY" benchmarks/bench_varlen_ce.py --device cuda --repeats 3
else
    check "loss benchmark" 200 "$BENCH_LOG" "bench_varlen_ce.py --account (CPU: the figures a GPU run is held to)" \
        "$PY" benchmarks/bench_varlen_ce.py --account
fi

# 4-5. An end-to-end bf16 step of a Llama-3.2-1B-shaped model (random init, no download) on
# packed 16k-token micro-batches: one GPU, then 2 ranks when there are 2 GPUs.
STEP_LOG="$OUT_DIR/gpu_step.log"
if [[ "$DEVICE" == cuda ]]; then
    STEP_ARGS=(--shape 1b --device cuda --tokens 16384 --micro-batches 2 --steps 3 --out "$OUT_DIR")
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
else
    STEP_ARGS=(--shape tiny --device cpu --tokens 512 --micro-batches 2 --steps 1 --out "$OUT_DIR")
    GPUS=0
fi
step_detail() {  # the step log's summary lines of its last run
    echo "$(grep -o 'median after the warm-up.*' "$STEP_LOG" | tail -n 1); $(grep -E -o '^(loss on micro-batch 0|Liger-Kernel: ).*' "$STEP_LOG" | tail -n 1)"
}
if wanted step; then
    start=$SECONDS
    step "1B step, one rank" 150 "$STEP_LOG" "$PY" benchmarks/bench_gpu_step.py "${STEP_ARGS[@]}"
    result "1B-shaped bf16 step, 1 rank" $? $start "$STEP_LOG" "$(step_detail)"
fi
if ! wanted ranks; then
    :
elif ((GPUS < 2)); then
    row "1B-shaped bf16 step, 2 ranks" "skipped" 0 "$GPUS GPU(s) here: the 2-rank step needs 2"
else
    start=$SECONDS
    step "1B step, 2 ranks" 180 "$STEP_LOG" "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
        benchmarks/bench_gpu_step.py "${STEP_ARGS[@]}"
    result "1B-shaped bf16 step, 2 ranks" $? $start "$STEP_LOG" "$(step_detail)"
fi
# 5b. Tensor parallelism: TP=1 against TP=2 (DeepSpeed AutoTP, 2 ranks, ZeRO-1) on SmolLM2-135M's
# widths with 8/4 heads (benchmarks/bench_tensor_parallel.py): step time and each rank's
# parameter + gradient + optimizer bytes counted by tensor (the GPU target: TP=2 <= 0.55x TP=1).
# The Megatron-Core engine (engine.name=megatron) on the same step: TP=1 on one GPU, TP=2 over
# two (megatron-core is a carried wheel: GPU_CHECKS_PREPARE=1).
MEGATRON_LOG="$OUT_DIR/megatron_step.log"
megatron_detail() {  # the Megatron step log's summary line of its last run
    grep -o 'median after the warm-up.*' "$MEGATRON_LOG" | tail -n 1
}
if ! wanted megatron; then
    :
elif ! has megatron.core; then
    row "1B-shaped bf16 step, Megatron engine" "skipped" 0 "megatron.core not importable (carry .whl: GPU_CHECKS_PREPARE=1)"
else
    start=$SECONDS
    step "Megatron step, TP=1" 150 "$MEGATRON_LOG" "$PY" benchmarks/bench_gpu_step.py "${STEP_ARGS[@]}" --engine megatron
    result "1B-shaped bf16 step, Megatron engine TP=1, 1 rank" $? $start "$MEGATRON_LOG" "$(megatron_detail)"
    if ((GPUS < 2)) && [[ "$DEVICE" == cuda ]]; then
        row "1B-shaped bf16 step, Megatron engine TP=2, 2 ranks" "skipped" 0 "$GPUS GPU(s) here: TP=2 needs 2"
    else
        start=$SECONDS
        step "Megatron step, TP=2" 180 "$MEGATRON_LOG" "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
            benchmarks/bench_gpu_step.py "${STEP_ARGS[@]}" --engine megatron --tensor-parallel-size 2
        result "1B-shaped bf16 step, Megatron engine TP=2, 2 ranks" $? $start "$MEGATRON_LOG" "$(megatron_detail)"
    fi
fi
TP_LOG="$OUT_DIR/tensor_parallel.log"
if [[ "$DEVICE" == cuda ]]; then
    TP_ARGS=(--device cuda --dtype bfloat16 --layers 30 --tokens 8192 --steps 3)
else
    TP_ARGS=(--device cpu --dtype float32 --layers 1 --tokens 256 --steps 1)
fi
if ! wanted ranks; then
    :
elif ((GPUS < 2)) && [[ "$DEVICE" == cuda ]]; then
    row "TP=2 vs TP=1 (AutoTP)" "skipped" 0 "$GPUS GPU(s) here: TP=2 needs 2"
else
    check "TP=2 vs TP=1 (AutoTP)" 240 "$TP_LOG" "$(echo bench_tensor_parallel.py "${TP_ARGS[@]}")" \
        "$PY" benchmarks/bench_tensor_parallel.py "${TP_ARGS[@]}"
fi

# 6. bf16 training of the default model, flash-attn vs sdpa. The full model's weights (514 MB)
# exceed what a device call carries: random weights of its architecture (same time per token,
# and the two attention paths must agree on any weights).
TRAIN_LOG="$OUT_DIR/train.log"
if [[ "$DEVICE" == cuda ]]; then
    MODEL=.cache/models/smollm2-135m FAST=flash_attention_2 DTYPE=bfloat16 TOLERANCE=2e-2 STEPS=6
else
    MODEL=.cache/models/smollm2-135m-2l FAST=hpsft_varlen DTYPE=float32 TOLERANCE=1e-4 STEPS=2
fi
if [[ -f $MODEL/config.json && ! -f $MODEL/model.safetensors ]]; then
    step random-weights 60 "$TRAIN_LOG" "$PY" -c "
import sys
from transformers import AutoConfig, AutoModelForCausalLM
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1])).save_pretrained(sys.argv[1])
print('random weights written to', sys.argv[1])" "$MODEL"
fi
train_args() {  # train_args RUN_NAME ATTENTION: TRAIN_ARGS = a short run of configs/sft.yaml
    TRAIN_ARGS=(--config configs/sft.yaml "model.path=$MODEL" "model.attn_implementation=$2" "engine.dtype=$DTYPE"
        "trainer.total_steps=$STEPS" trainer.val_before_train=false trainer.export_hf=false
        trainer.progress_bar=false "trainer.loggers=[jsonl]" trainer.resume=disable "trainer.output_dir=$RUNS_DIR/$1")
}
if wanted train && [[ "$DEVICE" == cuda ]] && ! has flash_attn; then
    # flash-attn has no wheel for this image (PyPI has its sdist only; built, it exceeds what a
    # call carries): hpsft's own packed attention, what model.attn_implementation=auto then runs.
    FAST=hpsft_varlen
    row "flash_attention_2" "skipped" 0 "flash_attn is not importable here: training compares hpsft_varlen with sdpa"
fi
if wanted train; then
    start=$SECONDS
    train_args fast "$FAST"
    step "train $FAST" 120 "$TRAIN_LOG" "$PY" -m hpsft.train "${TRAIN_ARGS[@]}" &&
        train_args sdpa sdpa && step "train sdpa" 120 "$TRAIN_LOG" "$PY" -m hpsft.train "${TRAIN_ARGS[@]}"
    status=$?
    if [[ $status == 0 ]]; then
        step "compare losses" 30 "$TRAIN_LOG" \
            "$PY" - "$RUNS_DIR/fast/metrics.jsonl" "$RUNS_DIR/sdpa/metrics.jsonl" "$TOLERANCE" <<'EOF'
import json, sys
import statistics
def metric(path, key):
    return {r["step"]: r[key] for r in map(json.loads, open(path)) if key in r}
fast, sdpa, tolerance = metric(sys.argv[1], "train/loss"), metric(sys.argv[2], "train/loss"), float(sys.argv[3])
assert fast and fast.keys() == sdpa.keys(), f"steps differ: {sorted(fast)} vs {sorted(sdpa)}"
worst = max(abs(fast[s] - sdpa[s]) / abs(sdpa[s]) for s in sdpa)
print("train/loss", {s: (fast[s], sdpa[s]) for s in sorted(sdpa)}, f"max relative difference {worst:.2e}")
# Step 1 holds one-off work (kernel compilation, allocator warm-up): the median of the rest.
times = [statistics.median(list(metric(path, "perf/step_time_s").values())[1:] or [float("nan")]) for path in sys.argv[1:3]]
print(f"median step time after step 1: {times[0]:.3f} s vs {times[1]:.3f} s (sdpa)")
assert worst <= tolerance, f"{worst:.2e} > {tolerance}"
EOF
        result "training $DTYPE, $FAST vs sdpa" $? $start "$TRAIN_LOG" \
            "$STEPS steps each; train/loss per step within $TOLERANCE relative: $(grep -o 'max relative difference [0-9.e+-]*' "$TRAIN_LOG" | tail -n 1); $(grep -o 'median step time.*' "$TRAIN_LOG" | tail -n 1)"
        cp "$RUNS_DIR/fast/metrics.jsonl" "$OUT_DIR/train_fast_metrics.jsonl" 2>/dev/null
        cp "$RUNS_DIR/sdpa/metrics.jsonl" "$OUT_DIR/train_sdpa_metrics.jsonl" 2>/dev/null
    else
        result "training $DTYPE, $FAST vs sdpa" $status $start "$TRAIN_LOG" "a training run did not finish"
    fi
fi

# 7. Ray: the driver and one actor holding the GPU (n_workers_per_node=1).
RAY_LOG="$OUT_DIR/ray.log"
if ! wanted ray; then
    :
elif ! has ray; then
    row "Ray run, one GPU actor" "skipped" 0 "ray is not importable here (its wheel exceeds what a device call carries)"
else
    export RAY_AUTH_MODE=disabled RAY_TMPDIR="$RUNS_DIR/ray"
    mkdir -p "$RAY_TMPDIR"
    train_args ray sdpa
    check "Ray run, one $DEVICE actor" 150 "$RAY_LOG" "python -m hpsft.train_ray, $STEPS steps, $DTYPE" \
        "$PY" -m hpsft.train_ray "${TRAIN_ARGS[@]}" ray.n_workers_per_node=1
fi

# 8. QLoRA (not by default): a short nf4 run of the training check's model (model.lora.rank=16
# on every linear layer, quantize_base=nf4, lr 2e-4, sdpa): train/loss must fall (the last step's
# below the first) and the process's peak GPU memory (torch.cuda.max_memory_allocated) is recorded.
# It needs peft, torchao and accelerate (carried wheels: GPU_CHECKS_PREPARE=1).
QLORA_LOG="$OUT_DIR/qlora.log"
if ! wanted qlora; then
    :
elif ! has peft || ! has torchao || ! has accelerate; then
    row "QLoRA nf4 run" "skipped" 0 "peft, torchao or accelerate not importable (carry .whl: GPU_CHECKS_PREPARE=1)"
else
    start=$SECONDS
    STEPS=$((STEPS * 2)) train_args qlora sdpa
    step "QLoRA nf4 run" 150 "$QLORA_LOG" "$PY" - "$RUNS_DIR/qlora/metrics.jsonl" "${TRAIN_ARGS[@]}" \
        model.lora.rank=16 model.lora.alpha=32 model.lora.quantize_base=nf4 optim.lr=2.0e-4 <<'EOF'
import json, sys
import torch
from hpsft.commands.train import main
status = main(sys.argv[2:])  # in this process: its peak GPU memory is the run's
assert status == 0, f"hpsft.train exited {status}"
losses = {r["step"]: r["train/loss"] for r in map(json.loads, open(sys.argv[1])) if "train/loss" in r}
peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
first, last = min(losses), max(losses)
print(f"QLoRA nf4: train/loss {losses[first]:.4f} at step {first}, {losses[last]:.4f} at step {last}; "
      f"peak GPU memory {peak:.3f} GiB")
assert losses[last] < losses[first], "train/loss did not fall"
EOF
    result "QLoRA nf4 run, $DTYPE" $? $start "$QLORA_LOG" "$(grep -o 'QLoRA nf4: .*' "$QLORA_LOG" | tail -n 1)"
fi

# 9. Vision (not by default): what the blank image (packed_vision_lm.py: an imageless micro-batch
# runs the tower on one blank image so every rank reduces the same gradients) costs a step on a
# GPU; on the CPU it was 1.96x-2.93x on Qwen2-VL-2B's tower (benchmarks/README.md), bound there
# by reading the tower's weights. The dry run: 1 decoder layer, 64 tokens.
VISION_LOG="$OUT_DIR/vision.log"
if wanted vision; then
    if [[ "$DRY_RUN" == 1 ]]; then VISION_ARGS=(--decoder-layers 1 --tokens 64 --steps 1); else VISION_ARGS=(--tokens 4096); fi
    check "blank image, Qwen2-VL-2B tower" 120 "$VISION_LOG" "bench_blank_image.py on $DEVICE" \
        "$PY" benchmarks/bench_blank_image.py --device "$DEVICE" "${VISION_ARGS[@]}"
fi

rm -rf "$RUNS_DIR"
row total "$([[ $FAILED == 0 ]] && echo "no failure" || echo FAILED)" "$SECONDS" \
    "budget ${GPU_CHECKS_BUDGET_S:-470} s x $SCALE; logs in $OUT_DIR/"
{  # the benchmark's and the step's own tables (and their verdict lines) below the checks
    echo
    grep -E '^(torch|F\.linear|Liger|accounted)' "$BENCH_LOG"
    echo
    grep -E '^\||^target|^accounting' "$BENCH_LOG"
    echo
    grep -E '^\||-shaped Llama|^median after|^loss on micro-batch|^Liger-Kernel: ' "$STEP_LOG"
    echo
    grep -E '^\||-shaped Llama|^TP=' "$TP_LOG"
    echo
    grep -E '^\||^torch ' "$VISION_LOG"
} >>"$TABLE" 2>/dev/null
cat "$TABLE"
exit $FAILED
