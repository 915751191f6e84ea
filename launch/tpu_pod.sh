#!/usr/bin/env bash
# A TPU VM pod slice: runs the same command on every worker; each host draws its own prompts
# and jax.distributed.initialize() joins them (TPU_WORKER_HOSTNAMES is set on TPU VMs).
# Usage: launch/tpu_pod.sh TPU_NAME ZONE configs/sd15.py [--config.x=y ...]
set -euo pipefail
tpu=${1:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG [overrides...]}
zone=${2:?zone}
config=${3:?config}
shift 3
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command \
  "cd tree_grpo_jax && python -m tree_grpo_jax.main --config=$config --config.mesh.data=-1 $*"
