"""What a gradient keeps from its forward pass, from shapes alone."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def residual_bytes(fn, *args) -> int:
    """Bytes of the residuals `jax.vjp(fn, *args)` saves for the backward pass (the
    forward's activations that are not recomputed), traced abstractly: nothing runs."""
    vjp_fn = jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args)
    return sum(
        math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        for leaf in jax.tree_util.tree_leaves(vjp_fn)
    )
