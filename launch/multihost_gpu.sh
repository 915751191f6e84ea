#!/usr/bin/env bash
# Several GPU hosts: start this on every host with the same coordinator address.
# Usage: COORDINATOR=host0:1234 NUM_PROCESSES=2 PROCESS_ID=0 launch/multihost_gpu.sh CONFIG [...]
set -euo pipefail
export JAX_COORDINATOR_ADDRESS=${COORDINATOR:?set COORDINATOR=host:port}
export JAX_NUM_PROCESSES=${NUM_PROCESSES:?set NUM_PROCESSES}
export JAX_PROCESS_ID=${PROCESS_ID:?set PROCESS_ID}
config=${1:?usage: launch/multihost_gpu.sh CONFIG [overrides...]}
shift
exec python -m tree_grpo_jax.main --config="$config" "$@"
