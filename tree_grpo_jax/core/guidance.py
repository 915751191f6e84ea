"""Calling the denoiser on a flat batch, with classifier-free guidance as one batched call, and
the same denoiser run over a few rows at a time."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp

PyTree = Any
# (params, x [B, *sample_shape], t [B], cond [B, L, D]) -> eps / v / velocity, shaped like x.
DenoiseFn = Callable[[PyTree, jax.Array, jax.Array, jax.Array], jax.Array]


@functools.partial(jax.jit, static_argnums=(0,))
def _denoise_once(denoise_fn, params, x, t, cond):
    return denoise_fn(params, x, t, cond)


def traced_once(denoise_fn: DenoiseFn) -> DenoiseFn:
    """`denoise_fn` behind one jit (the same numbers). Inside a traced program every call of
    the same shapes reuses one traced body: tracing the model is most of a small run's
    start, and a program that calls it at equal widths traces it once. A gradient through
    it transforms that body instead of tracing the model again under the gradient."""
    return functools.partial(_denoise_once, denoise_fn)


def guided_prediction(
    denoise_fn: DenoiseFn,
    params: PyTree,
    x: jax.Array,
    t: jax.Array,
    cond: jax.Array,
    uncond: jax.Array | None = None,
    guidance_scale: jax.Array | float = 1.0,
) -> jax.Array:
    """`pred_u + w * (pred_c - pred_u)`, or the plain conditional prediction if `uncond` is None.

    x: [B, *S]; t: [B]; cond: [B, L, D]; uncond: [L', D], the empty prompt's embedding.
    Conditional and unconditional rows go through the denoiser as one batch of 2B. With
    L' < L, each unconditional row takes its prompt's rows past L' (what a family conditions
    on besides the text, as a first frame to animate: the empty prompt keeps the image).
    """
    chex.assert_rank(cond, 3)
    chex.assert_equal_shape_prefix([x, t, cond], 1)
    if uncond is None:
        return denoise_fn(params, x, t, cond)
    chex.assert_rank(uncond, 2)
    rows = uncond.shape[0]
    uncond = jnp.broadcast_to(uncond.astype(cond.dtype), (cond.shape[0], rows, cond.shape[2]))
    uncond = jnp.concatenate([uncond, cond[:, rows:]], axis=1)
    both = denoise_fn(
        params,
        jnp.concatenate([x, x]),
        jnp.concatenate([t, t]),
        jnp.concatenate([uncond, cond]),
    )
    pred_u, pred_c = jnp.split(both.astype(jnp.float32), 2)
    return pred_u + guidance_scale * (pred_c - pred_u)


def in_chunks(denoise_fn: DenoiseFn, rows: int) -> DenoiseFn:
    """`denoise_fn` run over at most about `rows` rows at a time (`lax.map` over chunks), so a
    level's activations are those of one chunk; the same numbers, row by row. rows <= 0: the
    plain function. A batch of B rows becomes ceil(B / rows) chunks, chunk j taking rows j,
    j + n, j + 2n, ...: with the batch split over devices in contiguous blocks, every chunk
    keeps an equal share on each device. A batch that does not divide is padded by
    repeating its last row."""
    if rows <= 0:
        return denoise_fn

    def chunked(params, x, t, cond):
        batch = x.shape[0]
        count = -(-batch // rows)
        if count <= 1:
            return denoise_fn(params, x, t, cond)
        padded = -(-batch // count) * count

        def split(a):  # [B, ...] -> [count, padded / count, ...]
            if padded != batch:
                a = jnp.concatenate([a, jnp.repeat(a[-1:], padded - batch, axis=0)])
            return jnp.moveaxis(a.reshape(padded // count, count, *a.shape[1:]), 1, 0)

        out = jax.lax.map(lambda xs: denoise_fn(params, *xs), (split(x), split(t), split(cond)))
        out = jnp.moveaxis(out, 0, 1).reshape(padded, *out.shape[2:])
        return out[:batch]

    return chunked
