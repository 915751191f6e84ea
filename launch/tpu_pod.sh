#!/usr/bin/env bash
# A TPU VM pod slice: runs the same command on every worker, which join one job through
# jax.distributed.initialize() (TPU VMs describe themselves). Every worker gets the same
# WORKDIR (a local folder; worker 0 writes the logs there) and the checkpoints go to
# CHECKPOINT_DIR, a gs:// URL all workers reach.
# Usage: WORKDIR=runs/sd15-pod CHECKPOINT_DIR=gs://bucket/sd15-pod [SEQUENCE=S] \
#          launch/tpu_pod.sh TPU_NAME ZONE configs/sd15.py [--config.x=y ...]
# SEQUENCE=S (--config.mesh.sequence=S) splits each sample's tokens over S chips (the mesh's
# innermost axis): for long videos or large images, when one sample's activations are too much
# for one chip (docs/devices-and-hosts.md); the model's attention heads and each worker's
# chips must divide by S.
# The repository is expected in ~/tree_grpo_jax on every worker (REPO_DIR to change it),
# installed with: pip install -e . "jax[tpu]"
set -euo pipefail
tpu=${1:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG [flags...]}
zone=${2:?zone}
config=${3:?config}
shift 3
workdir=${WORKDIR:?set WORKDIR, one name for every worker}
checkpoints=${CHECKPOINT_DIR:?set CHECKPOINT_DIR=gs://bucket/path}
args=(--config="$config" --workdir="$workdir" --config.checkpoint.dir="$checkpoints"
  --config.mesh.data=-1 "$@")
if [[ -n "${SEQUENCE:-}" ]]; then
  args+=(--config.mesh.sequence="$SEQUENCE")
fi
# Quote every argument for the remote shell, so spaces and quotes arrive intact.
remote="cd $(printf '%q' "${REPO_DIR:-tree_grpo_jax}") && python3 -m tree_grpo_jax.main$(printf ' %q' "${args[@]}")"
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "$remote"
