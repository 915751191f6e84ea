"""Digests of a checkpoint's arrays: two uint32 sums over each leaf's bits (the plain sum
and a position-weighted one), the same whatever the mesh, so a restore can tell bits changed
on disk since the save from the state that was saved. Computed on the host when one process
holds the whole state, on the devices when it is sharded over several processes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def named_leaves(tree) -> list[tuple[str, Any]]:
    """(path, leaf) of every leaf; paths as orbax names them ("opt_state.1.mu.w"), so a
    saved tree's metadata, a restored tree and a live state (its dataclasses, named tuples
    and dicts) compare leaf by leaf."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(".".join(_key_name(k) for k in path), leaf) for path, leaf in leaves]


DIGESTS_KEY = "digests"  # in the meta document: leaf path -> [sum, weighted sum]
_WORD_TYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _digestible(leaf) -> bool:
    """Arrays of whole-byte dtypes; Python and NumPy scalars are left out (orbax may hand
    them back as another type, whose bits would not compare)."""
    if not isinstance(leaf, (jax.Array, np.ndarray)):
        return False
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return False  # orbax saves their key data, not the typed keys
    dtype = np.dtype(leaf.dtype)
    if dtype == np.bool_:
        return True
    # (bfloat16 and the float8 types are NumPy "void" kinds: ask jnp what they are)
    if jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    else:
        return False  # complex: left out
    return dtype.itemsize in _WORD_TYPES and bits == 8 * dtype.itemsize  # not 4-bit packed


def _words(x: jax.Array) -> jax.Array:
    """`x`'s bits as uint32 words: one per element (two for 64-bit dtypes, in a last axis)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, _WORD_TYPES[x.dtype.itemsize]).astype(jnp.uint32)


def _position_multipliers(shape: tuple[int, ...]) -> jax.Array:
    """An odd uint32 per element, mixed from its row-major flat index. Built from per-axis
    iotas rather than by flattening, which would regather a sharded array."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index + iota * np.uint32(stride % 2**32)
        stride *= shape[axis]
    # Two multiplies and a shift (of murmur3's finalizer): each costs compile time per leaf.
    mixed = index * np.uint32(0x9E3779B9)
    mixed = (mixed ^ (mixed >> 16)) * np.uint32(0x85EBCA6B)
    return mixed | np.uint32(1)


def _leaf_digest(x: jax.Array) -> jax.Array:
    """[sum of the words, sum of word x multiplier], both wrapping at 2**32: integer sums
    do not depend on the reduction order (so neither on the sharding), and an odd
    multiplier makes any change to a single word change the second sum."""
    words = _words(x)
    weighted = words * _position_multipliers(words.shape)
    # One reduction for both sums: one loop, and one kernel to compile, per leaf.
    sums = jax.lax.reduce(
        (words, weighted),
        (np.uint32(0), np.uint32(0)),
        lambda a, b: (a[0] + b[0], a[1] + b[1]),
        tuple(range(words.ndim)),
    )
    return jnp.stack(sums)


@jax.jit
def _digest_leaves(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([_leaf_digest(x) for x in leaves])


_HOST_CHUNK = 1 << 22  # elements per step of the host digest: bounds its scratch memory


def _host_digest(x: np.ndarray) -> list[int]:
    """`_leaf_digest` in numpy, for arrays this process holds whole: the same two sums, by
    uint32 arithmetic that wraps as the device's does."""
    if x.dtype == np.bool_:
        words = x.astype(np.uint32).ravel()
    else:
        words = np.ascontiguousarray(x).view(_WORD_TYPES[x.dtype.itemsize]).ravel()
    total = weighted = np.uint32(0)
    for start in range(0, words.size, _HOST_CHUNK):
        chunk = words[start : start + _HOST_CHUNK].astype(np.uint32)
        mixed = np.arange(start, start + chunk.size, dtype=np.uint32) * np.uint32(0x9E3779B9)
        mixed = ((mixed ^ (mixed >> np.uint32(16))) * np.uint32(0x85EBCA6B)) | np.uint32(1)
        total = total + chunk.sum(dtype=np.uint32)
        weighted = weighted + (chunk * mixed).sum(dtype=np.uint32)
    return [int(total), int(weighted)]


def state_digests(tree: Any) -> dict[str, list[int]]:
    """path -> [sum, weighted sum] of every array leaf of `tree`. A state this process
    holds whole is digested on the host (no program to compile); one sharded over several
    processes where its arrays live (every process must call it)."""
    named = [(path, leaf) for path, leaf in named_leaves(tree) if _digestible(leaf)]
    if all(not isinstance(leaf, jax.Array) or leaf.is_fully_addressable for _, leaf in named):
        with np.errstate(over="ignore"):
            return {path: _host_digest(np.asarray(leaf)) for path, leaf in named}
    # One program per set of devices: jit refuses arrays committed to different ones.
    groups: dict[Any, list[tuple[str, Any]]] = {}
    for path, leaf in named:
        devices = leaf.sharding.device_set if isinstance(leaf, jax.Array) else None
        groups.setdefault(None if devices is None else frozenset(devices), []).append((path, leaf))
    digests = {}
    for members in groups.values():
        result = _digest_leaves([leaf for _, leaf in members])
        if result.is_fully_replicated or result.is_fully_addressable:
            values = np.asarray(result)
        else:
            values = np.asarray(multihost_utils.process_allgather(result, tiled=True))
        digests.update({path: [int(a), int(b)] for (path, _), (a, b) in zip(members, values)})
    return {path: digests[path] for path, _ in named}  # in the tree's leaf order


def first_digest_mismatch(recorded: dict, tree: Any) -> str | None:
    """The path of the first leaf of `tree` whose digest differs from `recorded`'s (leaves
    `recorded` does not name are not checked); None if all agree."""
    for path, digest in state_digests(tree).items():
        if path in recorded and [int(v) for v in recorded[path]] != digest:
            return path
    return None
