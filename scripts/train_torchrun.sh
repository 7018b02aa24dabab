#!/usr/bin/env bash
# hpsft under torchrun, on one node or several (docs/launch.md).
#
#   NPROC=2 scripts/train_torchrun.sh --config configs/sft.yaml key=value ...      one node, 2 ranks
#   # on every node, c10d rendezvous (any node's address; the same RDZV_ID on all):
#   NNODES=2 NPROC=8 RDZV_ENDPOINT=node0:29400 RDZV_ID=sft1 scripts/train_torchrun.sh --config ...
#   # on every node, static ranks:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NPROC=8 scripts/train_torchrun.sh --config ...
#
# Environment:
#   NPROC          ranks per node (default 2; one per GPU on GPU nodes)
#   NNODES         nodes (default 1)
#   RDZV_ENDPOINT  host:port of the c10d rendezvous (multi-node; the host serves it), RDZV_ID its id
#   NODE_RANK, MASTER_ADDR, MASTER_PORT   static multi-node ranks instead of a rendezvous
#   MAX_RESTARTS   restarts of the whole group when a rank fails (default 0); with
#                  trainer.resume=auto (the default) each restart resumes from the last checkpoint,
#                  so set trainer.save_every
#   PYTHON         the Python that has hpsft installed (default: python on PATH)
#
# The mesh: the NNODES x NPROC ranks are DP x TP x SP, with TP = engine.tensor_parallel_size
# and SP = engine.sequence_parallel_size, e.g. NPROC=8 engine.tensor_parallel_size=4 -> DP 2 x
# TP 4; a TP group is TP consecutive ranks, inside a node when TP divides NPROC (docs/launch.md).
set -euo pipefail

# torchrun shares its rendezvous TCP store with the ranks' process group by default; after a
# restart the new ranks can then read the previous attempt's addresses (gloo: "connection
# refused"; pytorch issue 135712). A store of their own per attempt avoids it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

args=(--nproc_per_node "${NPROC:-2}" --max-restarts "${MAX_RESTARTS:-0}")
if [ -n "${RDZV_ENDPOINT:-}" ]; then
    args+=(--nnodes "${NNODES:-1}" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-hpsft}")
elif [ "${NNODES:-1}" != 1 ]; then
    args+=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK (0..NNODES-1) on each node, or RDZV_ENDPOINT}"
           --master-addr "${MASTER_ADDR:?set MASTER_ADDR to the address of node rank 0}"
           --master-port "${MASTER_PORT:-29500}")
else
    args+=(--standalone)
fi
exec "${PYTHON:-python}" -m torch.distributed.run "${args[@]}" -m hpsft.train "$@"
