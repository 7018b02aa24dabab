#!/usr/bin/env bash
# Installs the Debian packages that tests start private instances of, in a temp dir each:
#   Slurm + munge   tests/test_slurm.py's one-node cluster (tests/slurm_cluster.py)
#   pdsh + sshd     the deepspeed launcher's multi-node path (tests/ssh_server.py)
# Only the binaries: no service is started or enabled.
# Idempotent: does nothing when every binary is already there.
set -euo pipefail
missing=()
for binary in slurmctld slurmd sbatch munged pdsh sshd; do
    command -v "$binary" >/dev/null 2>&1 || [ -x "/usr/sbin/$binary" ] || missing+=("$binary")
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "install_system_packages: Slurm, munge, pdsh and sshd already installed, nothing to do"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
# slurmctld/slurmd: the daemons; slurm-client: sbatch, srun, squeue, sinfo, scontrol;
# munge: the authentication daemon every Slurm RPC goes through; pdsh + openssh-server
# (sshd; the ssh client is there already or comes with it): the deepspeed launcher's runner.
$SUDO apt-get install -y --no-install-recommends slurmd slurmctld slurm-client munge pdsh openssh-server openssh-client
