#!/usr/bin/env bash
# Several GPU hosts: start this on every host with the same COORDINATOR, NUM_PROCESSES and
# WORKDIR, and PROCESS_ID 0 .. NUM_PROCESSES-1. Checkpoints are written by all hosts
# together, so WORKDIR/checkpoints (or CHECKPOINT_DIR) must be one folder every host reaches
# (a shared file system, or gs://...); process 0 alone writes the logs and pictures.
# Usage: COORDINATOR=host0:1234 NUM_PROCESSES=2 PROCESS_ID=0 WORKDIR=/shared/runs/a \
#          [CHECKPOINT_DIR=gs://bucket/a] [SEQUENCE=S] launch/multihost_gpu.sh CONFIG [flags...]
# SEQUENCE=S (--config.mesh.sequence=S) splits each sample's tokens over S GPUs of one host
# (their all-to-alls stay on its NVLink): for long videos or large images, when one sample's
# activations are too much for one device (docs/devices-and-hosts.md); the model's attention
# heads and each host's GPUs must divide by S.
set -euo pipefail
export JAX_COORDINATOR_ADDRESS=${COORDINATOR:?set COORDINATOR=host:port}
export JAX_NUM_PROCESSES=${NUM_PROCESSES:?set NUM_PROCESSES}
export JAX_PROCESS_ID=${PROCESS_ID:?set PROCESS_ID}
workdir=${WORKDIR:?set WORKDIR, the same folder on every host}
config=${1:?usage: launch/multihost_gpu.sh CONFIG [flags...]}
shift
extra=()
if [[ -n "${CHECKPOINT_DIR:-}" ]]; then
  extra+=(--config.checkpoint.dir="$CHECKPOINT_DIR")
fi
if [[ -n "${SEQUENCE:-}" ]]; then
  extra+=(--config.mesh.sequence="$SEQUENCE")
fi
python=${PYTHON:-python3}
# As launch/gpu.sh: most of each GPU up front, and the XLA flags of tree_grpo_jax/gpu_flags.py
# that XLA_FLAGS does not name already (a flag you set keeps your value).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
XLA_FLAGS=$("$python" -m tree_grpo_jax.gpu_flags)
export XLA_FLAGS
exec "$python" -m tree_grpo_jax.main --config="$config" --workdir="$workdir" \
  "${extra[@]}" "$@"
