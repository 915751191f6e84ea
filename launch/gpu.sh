#!/usr/bin/env bash
# One host with one or more GPUs. Usage: [SEQUENCE=S] launch/gpu.sh configs/sd15.py \
#   [--workdir=DIR] [--config.x=y ...]
# Install JAX for CUDA first: pip install -U "jax[cuda12]"
# SEQUENCE=S (--config.mesh.sequence=S) splits each sample's tokens over S devices of the host:
# for long videos or large images, when one sample's activations are too much for one device
# (docs/devices-and-hosts.md); the model's attention heads must divide by S, and the GPUs by S.
set -euo pipefail
config=${1:?usage: launch/gpu.sh CONFIG [flags...]}
shift
python=${PYTHON:-python3}
# Let XLA take most of the GPU up front; fragmentation costs more than the reserve.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# The XLA flags of tree_grpo_jax/gpu_flags.py (each with its reason there) that XLA_FLAGS
# does not name already: a flag you set keeps your value.
XLA_FLAGS=$("$python" -m tree_grpo_jax.gpu_flags)
export XLA_FLAGS
extra=()
if [[ -n "${SEQUENCE:-}" ]]; then
  extra+=(--config.mesh.sequence="$SEQUENCE")
fi
exec "$python" -m tree_grpo_jax.main --config="$config" "${extra[@]}" "$@"
