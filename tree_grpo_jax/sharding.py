"""Devices, the mesh, where arrays live and how processes share them.

One mesh with axes ('data', 'fsdp', 'sequence'). Batches split their leading axis over
'data' and 'fsdp' (`BATCH_AXES`). Parameters and optimizer state shard over 'fsdp' and
'sequence' together along their largest dimension that the axes divide (over 'fsdp' alone
where none does, replicated where 'fsdp' divides none either). With fsdp = 1 and sequence
= 1 this is plain data parallelism; with data = 1 it is fully sharded. 'sequence' (size 1
unless `mesh.sequence` asks for more) splits one sample's tokens over devices inside the DiT
families' denoisers (`run.denoiser`); its devices hold the same rows, and split the weights
between them as ZeRO does. It is the innermost axis, so a sample's devices are neighbours
(one host, the fastest links).

With several processes (hosts), each holds the rows of the global batch that live on its
devices: `global_batch` assembles host-local rows into one global array, `local_rows` takes
a process's rows back out, `gather` and `agree` combine small host values (rewards, counts,
flags) so that every process takes the same decisions. With one process they are plain
placements and copies.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
SEQUENCE_AXIS = "sequence"
MESH_AXES = (*BATCH_AXES, SEQUENCE_AXIS)


def maybe_initialize_distributed() -> None:
    """Joins a multi-host job when the environment describes one (no-op on one host).

    GPU hosts: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (see
    launch/multihost_gpu.sh). TPU VM pods describe themselves.
    """
    if jax.distributed.is_initialized() or not describes_a_job():
        return
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:  # a TPU pod describes itself
        jax.distributed.initialize()


def describes_a_job() -> bool:
    """Whether the environment describes a multi-host job for `maybe_initialize_distributed`
    to join: then nothing may start JAX's backend (`jax.devices()`) before it does."""
    tpu_hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "localhost")
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or tpu_hosts not in ("", "localhost")


def mesh_shape(
    data: int, fsdp: int, num_devices: int | None = None, sequence: int = 1
) -> tuple[int, int]:
    """(data, fsdp) with -1 resolved over the devices `sequence` leaves (each sample's tokens
    take `sequence` of them), the product checked; raises one sentence."""
    n = num_devices or jax.device_count()
    if sequence < 1 or n % sequence:
        raise ValueError(
            f"mesh.sequence={sequence} does not divide the {n} available device(s); set it to "
            f"a divisor of {n}."
        )
    n //= sequence
    where = f"the {n} device(s) mesh.sequence={sequence} leaves" if sequence > 1 else None
    where = where or f"the {n} available device(s)"
    if data == -1 and fsdp == -1:
        raise ValueError("only one of mesh.data and mesh.fsdp may be -1.")
    # -1 takes the devices the other axis leaves; name the axis that does not divide them
    # (not the 0 the -1 would have become).
    for axis, size, other in (("fsdp", fsdp, data), ("data", data, fsdp)):
        if other == -1 and size >= 1 and n % size:
            raise ValueError(
                f"mesh.{axis}={size} does not divide {where}, so "
                f"mesh.{'data' if axis == 'fsdp' else 'fsdp'}=-1 has no size; set "
                f"mesh.{axis} to a divisor of {n}."
            )
    if data == -1:
        data = n // fsdp if fsdp > 0 and n % fsdp == 0 else 0
    if fsdp == -1:
        fsdp = n // data if data > 0 and n % data == 0 else 0
    if data < 1 or fsdp < 1 or data * fsdp != n:
        shape = f"data={data} x fsdp={fsdp}" + (f" x sequence={sequence}" if sequence > 1 else "")
        raise ValueError(
            f"a mesh of {shape} does not cover the {n * sequence} available device(s)."
        )
    return data, fsdp


def make_mesh(data: int = -1, fsdp: int = 1, devices=None, sequence: int = 1) -> Mesh:
    """A ('data', 'fsdp', 'sequence') mesh over `devices` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    data, fsdp = mesh_shape(data, fsdp, len(devices), sequence)
    return Mesh(np.asarray(devices).reshape(data, fsdp, sequence), MESH_AXES)


def config_mesh(config, devices=None) -> Mesh:
    """The mesh `config.mesh` describes over `devices` (default: all of them)."""
    m = config.mesh
    sequence = m.get("sequence", 1)
    local = jax.local_device_count()
    if multi_process() and local % sequence:  # every process passes whole rows
        raise ValueError(
            f"mesh.sequence={sequence} must divide each host's {local} devices: a sample's "
            "devices stay on one host."
        )
    return make_mesh(m.data, m.fsdp, devices, sequence)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """The mesh's axis sizes as a run reports them: 'sequence' only where it splits."""
    sizes = {axis: int(mesh.shape[axis]) for axis in BATCH_AXES}
    if sequence_size(mesh) > 1:
        sizes[SEQUENCE_AXIS] = sequence_size(mesh)
    return sizes


def sequence_size(mesh: Mesh) -> int:
    """Devices one sample's tokens are split over (1 on a mesh without the axis)."""
    return int(mesh.shape.get(SEQUENCE_AXIS, 1))


def local_mesh(mesh: Mesh) -> Mesh:
    """A mesh like `mesh` over this process's devices only (`mesh` itself with one process):
    for what each process computes on its own rows, such as the reward models."""
    if not multi_process():
        return mesh
    devices = jax.local_devices()
    sequence = sequence_size(mesh)
    sequence = sequence if len(devices) % sequence == 0 else 1
    fsdp = mesh.shape["fsdp"] if (len(devices) // sequence) % mesh.shape["fsdp"] == 0 else 1
    return make_mesh(-1, fsdp, devices, sequence)


def fsdp_spec(shape: tuple[int, ...], fsdp_size: int, sequence_size: int = 1) -> P:
    """Shards the largest dimension that the weight axes divide: 'fsdp' and 'sequence'
    together (`fsdp_size * sequence_size` ways), else 'fsdp' alone; replicated if none does."""
    options = [("fsdp", fsdp_size)]
    if sequence_size > 1:
        options.insert(0, (("fsdp", SEQUENCE_AXIS), fsdp_size * sequence_size))
    for axes, size in options:
        candidates = [d for d in range(len(shape)) if size > 1 and shape[d] % size == 0]
        if candidates:
            dim = max(candidates, key=lambda d: shape[d])
            spec = [None] * len(shape)
            spec[dim] = axes
            return P(*spec)
    return P()


def param_shardings(mesh: Mesh, tree):
    """NamedShardings for a pytree of arrays (params or optimizer state): over 'fsdp' and
    'sequence' (`fsdp_spec`). A sample's devices on 'sequence' hold different tokens and
    the same weights, so they split the weights between them as the 'fsdp' devices do, and
    each layer is gathered where it runs."""
    fsdp_size, sequence = mesh.shape["fsdp"], sequence_size(mesh)
    return jax.tree_util.tree_map(
        lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), fsdp_size, sequence)), tree
    )


def row_axes(mesh: Mesh, rows: int) -> tuple[str, ...] | None:
    """The axes `rows` rows split over for work done row by row outside the denoiser (the
    decode): every axis where the mesh's devices divide them, a 'sequence' axis's devices
    included (they hold the same rows and would otherwise each do them all); else the batch
    axes where those divide them; else None."""
    for axes in (MESH_AXES, BATCH_AXES) if sequence_size(mesh) > 1 else (BATCH_AXES,):
        if rows % math.prod(mesh.shape[a] for a in axes) == 0:
            return axes
    return None


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading axis over every device."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def num_batch_shards(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def shard_batch(mesh: Mesh, tree):
    """Places every array of a host batch with its leading axis split over the mesh. With
    several processes each passes its own rows, and the global batch is all processes' rows
    in process order (see `global_batch`)."""
    return global_batch(mesh, tree)


# ---------------------------------------------------------------------------------------------
# Several processes.


def is_primary() -> bool:
    """The one process that writes logs, pictures and summaries."""
    return jax.process_index() == 0


def multi_process() -> bool:
    return jax.process_count() > 1


def process_rows(total: int) -> slice:
    """This process's rows of a global batch of `total` rows (equal, contiguous parts)."""
    count = jax.process_count()
    if total % count:
        raise ValueError(f"a batch of {total} rows cannot be split over {count} processes.")
    size = total // count
    return slice(jax.process_index() * size, (jax.process_index() + 1) * size)


def global_batch(mesh: Mesh, tree, axis: int = 0):
    """Host-local arrays -> global arrays split along `axis` over every device of the mesh;
    each process passes the rows its devices hold (with one process: all of them)."""
    spec = P(*([None] * axis), BATCH_AXES)
    sharding = NamedSharding(mesh, spec)
    if not multi_process():
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, sharding), tree)
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree
    )


def replicate_host(mesh: Mesh, x) -> jax.Array:
    """A host array every process holds the same copy of -> copies on every device."""
    if not multi_process():
        return jax.device_put(np.asarray(x), replicated(mesh))
    return jax.make_array_from_process_local_data(replicated(mesh), np.asarray(x))


def replicate(mesh: Mesh, tree):
    """(Global) arrays -> copies on every device of the mesh."""
    return _replicating(mesh)(tree)


@functools.lru_cache(maxsize=8)
def _replicating(mesh: Mesh):
    """One jitted copy per mesh: a new function on every call would be traced anew."""
    return jax.jit(lambda t: t, out_shardings=replicated(mesh))


def replicate_like(mesh: Mesh, tree):
    """`tree` copied onto every device: arrays are copied, shapes (`ShapeDtypeStruct`, as a
    plan passes) take the replicated layout."""
    if all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(tree)):
        return replicate(mesh, tree)
    rep = replicated(mesh)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree
    )


def local_rows(x, rows: slice, axis: int = 0) -> np.ndarray:
    """The `rows` of `axis` of a (possibly global) array, read from this process's shards
    only: the data path never needs another process's rows."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)[(slice(None),) * axis + (rows,)]
    start, stop = rows.start, rows.stop
    shape = list(x.shape)
    shape[axis] = stop - start
    out = np.empty(shape, x.dtype)
    filled = np.zeros(stop - start, bool)
    for shard in x.addressable_shards:
        index = shard.index[axis]
        lo, hi = index.start or 0, x.shape[axis] if index.stop is None else index.stop
        a, b = max(lo, start), min(hi, stop)
        if a < b and not filled[a - start : b - start].all():
            src = (slice(None),) * axis + (slice(a - lo, b - lo),)
            dst = (slice(None),) * axis + (slice(a - start, b - start),)
            out[dst] = np.asarray(shard.data)[src]
            filled[a - start : b - start] = True
    if not filled.all():
        raise ValueError(f"rows {start}:{stop} of an array of shape {x.shape} are not all here.")
    return out


def to_host(x) -> np.ndarray:
    """The whole value of an array on every process (a global one is gathered)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather(local) -> np.ndarray:
    """Every process's rows of a host array, concatenated in process order (same shape on
    every process)."""
    local = np.asarray(local)
    if not multi_process():
        return local
    if local.dtype.itemsize == 8:  # JAX carries 32-bit values (x64 off): send the raw bits
        bits = np.ascontiguousarray(local).reshape(len(local), -1).view(np.uint32)
        return gather(bits).view(local.dtype).reshape(-1, *local.shape[1:])
    return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def primary_text(text: str, size: int = 512) -> str:
    """The primary process's `text` on every process (a name made from its clock)."""
    if not multi_process():
        return text
    raw = text.encode()[:size]
    data = np.zeros(size, np.uint8)
    data[: len(raw)] = np.frombuffer(raw, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(data))
    return bytes(data).rstrip(b"\0").decode()


def agree(value: float, how: str = "max") -> float:
    """One number all processes agree on: the max, min or sum of theirs."""
    if not multi_process():
        return value
    values = gather(np.asarray([value], np.float64))
    return float({"max": np.max, "min": np.min, "sum": np.sum}[how](values))


def local_tree(tree, rows: slice):
    """This process's prompt rows of a `rollout.Tree` rolled out over every process's
    devices: its segments' per-prompt arrays and its leaves, on the host."""
    segments = tuple(
        seg.replace(
            parents=local_rows(seg.parents, rows, axis=1),
            children=local_rows(seg.children, rows, axis=1),
            log_probs=local_rows(seg.log_probs, rows, axis=1),
            steps=to_host(seg.steps),
            active=to_host(seg.active),
            means=None if seg.means is None else local_rows(seg.means, rows, axis=1),
            x0_hats=None if seg.x0_hats is None else local_rows(seg.x0_hats, rows, axis=1),
        )
        for seg in tree.segments
    )
    return tree.replace(segments=segments, leaves=local_rows(tree.leaves, rows))
