#!/usr/bin/env bash
# Submit a Ray-path run to a running cluster (`ray start --head ...` on the head node):
#   RAY_ADDRESS=http://HEAD:8265 scripts/ray_submit.sh [--config FILE] key=value ...
# The job runs `python -m hpsft.train_ray ARGS` in this repository's directory on the head
# node, with this Python (PYTHON to change it): the nodes must see the same paths (shared
# filesystem or identical images). Extra `ray job submit` options go in RAY_SUBMIT_ARGS,
# e.g. RAY_SUBMIT_ARGS='--runtime-env-json {"env_vars":{"NCCL_DEBUG":"INFO"}}'.
set -euo pipefail
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard address, e.g. http://127.0.0.1:8265}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$(command -v python)}"
RAY="$(dirname "$PYTHON")/ray"
[ -x "$RAY" ] || RAY=ray
# ray job submit re-quotes its entrypoint words for the head node's shell: hand it one bash -c.
ENTRYPOINT="cd $(printf %q "$REPO") && exec $(printf %q "$PYTHON") -m hpsft.train_ray$(printf ' %q' "$@")"
# shellcheck disable=SC2086  # RAY_SUBMIT_ARGS is a list of options
exec "$RAY" job submit --address "$RAY_ADDRESS" ${RAY_SUBMIT_ARGS:-} -- bash -c "$ENTRYPOINT"
