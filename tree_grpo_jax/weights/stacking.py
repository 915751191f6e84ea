"""Scanned layers at the weight boundary: a run of identical blocks held as one stacked module.

A model that scans its identical blocks (`model.scan_layers`) holds the run of blocks
`transformer_blocks_13` ... `transformer_blocks_22` as one module named
`transformer_blocks_13_to_22`, each of its leaves stacked on a leading layer axis. Everything
that speaks diffusers' names (the folders read and written, LoRA targets, PEFT files) sees
the blocks one by one: `stack` turns a tree of per-block names into the stacked tree a
model's params have, `unstack` turns it back. Both work on the top level of a tree (where
the transformers keep their block lists), on numpy or JAX arrays and on shape structs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

_STACKED = re.compile(r"^(?P<list>.+)_(?P<first>\d+)_to_(?P<last>\d+)$")


def stacked_name(list_name: str, first: int, last: int) -> str:
    """The module name of blocks `first`..`last` (inclusive) of `list_name`, stacked."""
    return f"{list_name}_{first}_to_{last}"


def parse(name: str) -> tuple[str, range] | None:
    """(list name, block indices) of a stacked module's name; None for any other name."""
    match = _STACKED.match(str(name))
    if not match:
        return None
    first, last = int(match["first"]), int(match["last"])
    return (match["list"], range(first, last + 1)) if last > first else None


def block_names(name: str) -> list[str]:
    """The per-block names a stacked module's name stands for ([name] for any other)."""
    parsed = parse(name)
    if parsed is None:
        return [name]
    list_name, indices = parsed
    return [f"{list_name}_{i}" for i in indices]


def is_stacked(tree: Mapping) -> bool:
    """Whether a tree's top level holds a stacked module."""
    return any(parse(k) is not None for k in tree)


def _stack_leaves(leaves):
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype)
    if isinstance(first, np.ndarray | np.generic):
        return np.stack(leaves)
    return jnp.stack(leaves)


def _unstack_leaf(leaf, index: int):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    return leaf[index]


def stack(tree: Mapping, reference: Mapping) -> dict:
    """`tree` (per-block names) with every module the `reference` tree holds stacked
    gathered from its blocks; a tree that is already stacked, or a reference that stacks
    nothing, comes back as it is. ValueError (one sentence) when a block is missing or the
    blocks' trees differ."""
    tree = dict(tree)
    for name in reference:
        parsed = parse(name)
        if parsed is None or name in tree:
            continue
        names = block_names(name)
        missing = [n for n in names if n not in tree]
        if missing:
            raise ValueError(f"the params lack {missing[0]}, one of the blocks of {name}.")
        blocks = [tree.pop(n) for n in names]
        structures = {jax.tree_util.tree_structure(b) for b in blocks}
        if len(structures) != 1:
            raise ValueError(f"the blocks of {name} do not all hold the same parameters.")
        tree[name] = jax.tree_util.tree_map(lambda *leaves: _stack_leaves(leaves), *blocks)
    return tree


def unstack(tree: Mapping) -> dict:
    """`tree` with every stacked module split back into its blocks, named one by one."""
    if not isinstance(tree, Mapping) or not is_stacked(tree):
        return tree
    out = {}
    for name, value in tree.items():
        parsed = parse(name)
        if parsed is None:
            out[name] = value
            continue
        for position, block in enumerate(block_names(name)):
            out[block] = jax.tree_util.tree_map(lambda x, p=position: _unstack_leaf(x, p), value)
    return out


def module_params(module, to_flax) -> dict:
    """The params of a Flax `module` (one with `scan_layers` and `init_weights(rng)`) from
    `to_flax(shapes)`, which maps a checkpoint holding the blocks one by one onto `shapes`
    (the unscanned module's params as shape structs); stacked where the module scans them."""
    blockwise = module.clone(scan_layers=False) if module.scan_layers else module
    params = to_flax(jax.eval_shape(blockwise.init_weights, jax.random.key(0)))
    if blockwise is not module:
        params = stack(params, jax.eval_shape(module.init_weights, jax.random.key(0)))
    return params
