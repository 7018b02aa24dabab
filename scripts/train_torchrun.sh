#!/usr/bin/env bash
# One node, N ranks under torchrun:  NPROC=2 scripts/train_torchrun.sh [--config FILE] key=value ...
set -euo pipefail
exec torchrun --standalone --nproc_per_node "${NPROC:-2}" -m hpsft.train "$@"
