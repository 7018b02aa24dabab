#!/usr/bin/env bash
# Submit a Ray-path run (python -m hpsft.train_ray) to a running Ray cluster as a Ray job:
#   RAY_ADDRESS=http://HEAD:8265 scripts/ray_submit.sh [--config FILE] key=value ...
# Run it from any directory. hpsft's arguments reach the job intact (spaces, brackets,
# quotes): each is quoted for the head node's shell.
#
# Environment:
#   RAY_ADDRESS       the cluster's dashboard address (required)
#   HPSFT_CODE        upload (default): this repository is uploaded as the job's working
#                     directory (Ray's runtime_env working_dir; .venv, .cache, .git, runs and
#                     build outputs left out), so the cluster needs hpsft's dependencies
#                     but not hpsft itself; installed: the job imports the hpsft installed
#                     on the cluster's nodes and runs in their current directory
#   PYTHON            the Python the job runs on the head node (default: python there)
#   RAY_SUBMIT_ARGS   extra `ray job submit` options, split on spaces, e.g. "--no-wait"
#   RAY               the ray CLI (default: ray next to PYTHON when it exists, else ray on PATH)
# Paths in hpsft's arguments (data files, model, trainer.output_dir) are read on the
# cluster: give absolute paths that its nodes see. A relative output_dir would land in the
# job's temporary working directory.
set -euo pipefail
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard address, e.g. http://127.0.0.1:8265}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python}"
RAY="${RAY:-$(dirname "$PYTHON")/ray}"
[ -x "$RAY" ] || RAY=ray

ENTRYPOINT="exec $(printf %q "$PYTHON") -m hpsft.train_ray$(printf ' %q' "$@")"
submit=("$RAY" job submit --address "$RAY_ADDRESS")
case "${HPSFT_CODE:-upload}" in
    upload)
        RUNTIME_ENV="$(printf '{"working_dir": "%s", "excludes": [".venv", ".cache", ".git", "runs", "build", "*.egg-info", "__pycache__"]}' "$REPO")"
        submit+=(--runtime-env-json "$RUNTIME_ENV") ;;
    installed) ;;
    *) echo "ray_submit.sh: HPSFT_CODE must be upload or installed, not '$HPSFT_CODE'" >&2; exit 2 ;;
esac
read -r -a extra <<< "${RAY_SUBMIT_ARGS:-}"
# ray job submit joins its entrypoint words for the head node's shell: hand it one bash -c.
exec "${submit[@]}" "${extra[@]}" -- bash -c "$ENTRYPOINT"
