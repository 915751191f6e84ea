"""Latents packed into tokens of 2x2 patches, the way the packed-latent DiT pipelines (FLUX.1,
Qwen-Image) feed their transformers: shared, so each family packs as the others do."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

LATENT_PATCH = 2  # the pipelines' 2x2 packing of latents into tokens


def pack_latents(latents: jax.Array) -> jax.Array:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: each 2x2 patch as one token, channels ordered
    (channel, patch row, patch column), tokens row-major (the pipelines' `_pack_latents`)."""
    chex.assert_rank(latents, 4)
    batch, channels, height, width = latents.shape
    check_even(height, width)
    rows, columns = height // LATENT_PATCH, width // LATENT_PATCH
    patches = latents.reshape(batch, channels, rows, LATENT_PATCH, columns, LATENT_PATCH)
    patches = jnp.transpose(patches, (0, 2, 4, 1, 3, 5))
    return patches.reshape(batch, rows * columns, channels * LATENT_PATCH**2)


def unpack_latents(tokens: jax.Array, height: int, width: int) -> jax.Array:
    """[B, (H/2)(W/2), 4C] -> [B, C, H, W], the inverse of `pack_latents` (the
    pipelines' `_unpack_latents` take the image size; here H, W are the latent size)."""
    chex.assert_rank(tokens, 3)
    check_even(height, width)
    batch, count, features = tokens.shape
    rows, columns = height // LATENT_PATCH, width // LATENT_PATCH
    if count != rows * columns or features % LATENT_PATCH**2:
        raise ValueError(
            f"{count} tokens of {features} features are not the packing of {height}x{width} "
            "latents."
        )
    channels = features // LATENT_PATCH**2
    patches = tokens.reshape(batch, rows, columns, channels, LATENT_PATCH, LATENT_PATCH)
    patches = jnp.transpose(patches, (0, 3, 1, 4, 2, 5))
    return patches.reshape(batch, channels, height, width)


def check_even(height: int, width: int) -> None:
    if height % LATENT_PATCH or width % LATENT_PATCH:
        raise ValueError(
            f"Latents {height}x{width} do not pack into {LATENT_PATCH}x{LATENT_PATCH} patches."
        )
