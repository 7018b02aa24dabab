#!/usr/bin/env bash
# hpsft under the deepspeed launcher, on one node or on the nodes of a hostfile (docs/launch.md).
#
#   NPROC=2 scripts/train_deepspeed.sh --config configs/sft.yaml key=value ...          one node, 2 ranks
#   HOSTFILE=scripts/hostfile.example MASTER_ADDR=10.0.0.1 \
#       scripts/train_deepspeed.sh --config configs/sft.yaml ...                          every host of the hostfile
#
# Environment (each becomes a launcher option, placed before the module):
#   NPROC        ranks per node. One node: default 2, always passed (on CPU the launcher
#                counts NUMA nodes, not cores). With HOSTFILE: at most NPROC of each host's slots.
#   HOSTFILE     lines "<host> slots=<ranks>" (scripts/hostfile.example). The launcher starts
#                the hosts' ranks through LAUNCHER; pdsh needs passwordless ssh to every host.
#   NUM_NODES    use only the first NUM_NODES hosts of the hostfile
#   INCLUDE, EXCLUDE   host/slot filters, e.g. INCLUDE="node1@node2:0,1" (not with NPROC/NUM_NODES)
#   MASTER_ADDR  the address of the first host, as the others reach it (with a hostfile: give
#                it, or the launcher asks the first host over ssh); MASTER_PORT (default 29500)
#   LAUNCHER     pdsh (default), openmpi, mpich, impi, mvapich or slurm
#   DS_ARGS      further launcher options, e.g. DS_ARGS="--ssh_port 2222 --no_ssh_check"
#   PYTHON       the Python that has hpsft installed (default: python on PATH); under pdsh
#                every host must have it at the same path, and the repository or package too
# Ranks on other hosts see only the variables the launcher exports (PYTHON*, NCCL*, UCX*, ...)
# and the KEY=value lines of .deepspeed_env (in $HOME or the current directory; DS_ENV_FILE
# names another file): put OMP_NUM_THREADS, HF_HOME, TORCH_EXTENSIONS_DIR, ... there.
#
# The mesh: the hosts x NPROC ranks are DP x TP x SP, with TP = engine.tensor_parallel_size
# and SP = engine.sequence_parallel_size, e.g. NPROC=8 engine.tensor_parallel_size=4 -> DP 2 x
# TP 4; a TP group is TP consecutive ranks, inside a node when TP divides NPROC (docs/launch.md).
set -euo pipefail

args=(--master_port "${MASTER_PORT:-29500}")
if [ -n "${MASTER_ADDR:-}" ]; then args+=(--master_addr "$MASTER_ADDR"); fi
if [ -n "${HOSTFILE:-}" ]; then
    if [ ! -f "$HOSTFILE" ]; then
        echo "train_deepspeed.sh: HOSTFILE=$HOSTFILE is not a file (lines '<host> slots=<ranks>')" >&2
        exit 2
    fi
    args+=(--hostfile "$HOSTFILE" --launcher "${LAUNCHER:-pdsh}")
    if [ -n "${NUM_NODES:-}" ]; then args+=(--num_nodes "$NUM_NODES"); fi
    if [ -n "${NPROC:-}" ]; then args+=(--num_gpus "$NPROC"); fi
elif [ -z "${INCLUDE:-}${EXCLUDE:-}" ]; then
    args+=(--num_gpus "${NPROC:-2}")
fi
if [ -n "${INCLUDE:-}" ]; then args+=(--include "$INCLUDE"); fi
if [ -n "${EXCLUDE:-}" ]; then args+=(--exclude "$EXCLUDE"); fi
read -r -a extra <<< "${DS_ARGS:-}"
exec "${PYTHON:-python}" -m deepspeed.launcher.runner "${args[@]}" "${extra[@]}" --module hpsft.train "$@"
