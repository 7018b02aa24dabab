#!/usr/bin/env bash
# Installs Debian's Slurm + munge, which tests/test_slurm.py needs to start its private
# one-node cluster (tests/slurm_cluster.py). Only the binaries: no service is started or
# enabled, the tests run their own slurmctld/slurmd/munged in a temp dir.
# Idempotent: does nothing when slurmctld is already on PATH.
set -euo pipefail
if command -v slurmctld >/dev/null 2>&1; then
    echo "install_slurm: slurmctld already installed ($(command -v slurmctld)), nothing to do"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
# slurmctld/slurmd: the daemons; slurm-client: sbatch, srun, squeue, sinfo, scontrol;
# munge: the authentication daemon every Slurm RPC goes through.
$SUDO apt-get install -y --no-install-recommends slurmd slurmctld slurm-client munge
