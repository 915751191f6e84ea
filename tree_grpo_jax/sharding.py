"""Devices, the mesh and where arrays live.

One mesh with axes ('data', 'fsdp'). Batches split their leading axis over both axes.
Parameters and optimizer state shard over 'fsdp' along their largest dimension that the
axis divides, and stay replicated when no dimension does. With fsdp = 1 this is plain data
parallelism; with data = 1 it is fully sharded.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")


def maybe_initialize_distributed() -> None:
    """Joins a multi-host job when the environment describes one (no-op on one host).

    GPU hosts: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (see
    launch/multihost_gpu.sh). TPU VM pods describe themselves.
    """
    if jax.distributed.is_initialized():
        return
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    elif os.environ.get("TPU_WORKER_HOSTNAMES", "localhost") not in ("", "localhost"):
        jax.distributed.initialize()


def mesh_shape(data: int, fsdp: int, num_devices: int | None = None) -> tuple[int, int]:
    """Resolves -1 (all remaining devices) and checks the product; raises one sentence."""
    n = num_devices or jax.device_count()
    if data == -1 and fsdp == -1:
        raise ValueError("only one of mesh.data and mesh.fsdp may be -1.")
    if data == -1:
        data = n // fsdp if fsdp > 0 and n % fsdp == 0 else 0
    if fsdp == -1:
        fsdp = n // data if data > 0 and n % data == 0 else 0
    if data < 1 or fsdp < 1 or data * fsdp != n:
        raise ValueError(
            f"a mesh of data={data} x fsdp={fsdp} does not cover the {n} available device(s)."
        )
    return data, fsdp


def make_mesh(data: int = -1, fsdp: int = 1, devices=None) -> Mesh:
    """A ('data', 'fsdp') mesh over `devices` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    data, fsdp = mesh_shape(data, fsdp, len(devices))
    return Mesh(np.asarray(devices).reshape(data, fsdp), BATCH_AXES)


def fsdp_spec(shape: tuple[int, ...], fsdp_size: int) -> P:
    """Shards the largest dimension that `fsdp_size` divides; replicated if none does."""
    if fsdp_size == 1:
        return P()
    candidates = [d for d in range(len(shape)) if shape[d] % fsdp_size == 0]
    if not candidates:
        return P()
    dim = max(candidates, key=lambda d: shape[d])
    spec = [None] * len(shape)
    spec[dim] = "fsdp"
    return P(*spec)


def param_shardings(mesh: Mesh, tree):
    """NamedShardings for a pytree of arrays (params or optimizer state)."""
    fsdp_size = mesh.shape["fsdp"]
    return jax.tree_util.tree_map(
        lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), fsdp_size)), tree
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading axis over every device."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def num_batch_shards(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def shard_batch(mesh: Mesh, tree):
    """Places every array of a host batch with its leading axis split over the mesh."""
    sharding = batch_sharding(mesh)
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, sharding), tree)
