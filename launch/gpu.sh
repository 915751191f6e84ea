#!/usr/bin/env bash
# One host with one or more GPUs. Usage: launch/gpu.sh configs/sd15.py [--workdir=DIR] [--config.x=y ...]
# Install JAX for CUDA first: pip install -U "jax[cuda12]"
set -euo pipefail
config=${1:?usage: launch/gpu.sh CONFIG [flags...]}
shift
# Let XLA take most of the GPU up front; fragmentation costs more than the reserve.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
exec "${PYTHON:-python3}" -m tree_grpo_jax.main --config="$config" "$@"
