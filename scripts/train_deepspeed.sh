#!/usr/bin/env bash
# One node, N ranks under the deepspeed launcher. On CPU it counts NUMA nodes, not cores,
# so the rank count is always given:  NPROC=2 scripts/train_deepspeed.sh key=value ...
set -euo pipefail
exec deepspeed --num_gpus "${NPROC:-2}" --master_port "${MASTER_PORT:-29500}" --module hpsft.train "$@"
