#!/usr/bin/env bash
# The body of hpsft's sbatch templates (scripts/train_slurm*.sbatch): one srun step with one
# task per rank, each running `python -m hpsft.train ARGS`; a run stopped by a signal
# (exit 75: it saved a checkpoint, docs/checkpoints.md) requeues the job, which then
# resumes from that checkpoint (trainer.resume=auto). See docs/slurm.md.
#
# Environment (sbatch exports the submitter's):
#   HPSFT_PYTHON        the Python that has hpsft installed (default: python on PATH)
#   HPSFT_REQUEUE       1 (default): requeue after exit 75; 0: just exit 75
#   HPSFT_MAX_REQUEUES  stop requeueing after this many restarts of the job (default 20)
#   OMP_NUM_THREADS     default: the CPUs per task
set -uo pipefail

PYTHON="${HPSFT_PYTHON:-python}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "hpsft: error: no Python '$PYTHON' on node $(hostname): set HPSFT_PYTHON to the venv's python" >&2
    exit 2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
export TOKENIZERS_PARALLELISM=false
PREEMPTED=75

echo "hpsft: job ${SLURM_JOB_ID} nodes=${SLURM_JOB_NODELIST} tasks=${SLURM_NTASKS} restart=${SLURM_RESTART_COUNT:-0} python=${PYTHON}"
# --cpus-per-task: srun (Slurm >= 22.05) no longer inherits it from sbatch.
# --kill-on-bad-exit: one failed rank ends the others instead of leaving them blocked in a
# collective until the process-group timeout.
srun --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" --kill-on-bad-exit=1 "$PYTHON" -m hpsft.train "$@"
status=$?
if [ "$status" -eq "$PREEMPTED" ] && [ "${HPSFT_REQUEUE:-1}" = 1 ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -lt "${HPSFT_MAX_REQUEUES:-20}" ]; then
        echo "hpsft: checkpointed on a signal (exit $PREEMPTED): requeueing job ${SLURM_JOB_ID}"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "hpsft: checkpointed on a signal (exit $PREEMPTED): not requeued, already restarted ${SLURM_RESTART_COUNT} times" >&2
    fi
fi
exit "$status"
