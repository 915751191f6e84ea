"""FLUX.1-Kontext editing: a prompt's input image as FluxKontextPipeline's `image=` reference.

The pipeline encodes the image with the VAE (the latent mean, `(z - shift) * scale`), packs
it in 2x2 patches as the noisy latents, and gives its tokens to the transformer after the
noisy ones, with the noisy tokens' position ids but for a first coordinate of 1; the output
for them is dropped. Here the reference tokens and their ids ride in the prompt's
conditioning (`models.references`): after the T5 rows and the pooled CLIP row, one row per
reference token, its 64 packed channels, its 3 ids, zeros. `load.make_denoise` splits them
off again. The schedule's mu counts the noisy tokens only, as the pipeline's does.

The input images are squares of `reference_resolution` pixels (a multiple of 16), so the
pipeline with `_auto_resize=False` keeps them as they are: the pixels only go to [-1, 1].
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import autoencoder, patches
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.flux import transformer

REFERENCE_OFFSET = 1.0  # the reference tokens' first id coordinate (the noisy tokens' is 0)
DEFAULT_SIDE = 1024  # the pipeline's default output side, when neither resolution is set


def reference_ids(height: int, width: int) -> np.ndarray:
    """[(H/2)(W/2), 3] float32 ids of a reference of H x W latents: the noisy latents' ids
    (`transformer.image_ids`) with the first coordinate set to `REFERENCE_OFFSET`."""
    ids = transformer.image_ids(height, width)
    ids[:, 0] = REFERENCE_OFFSET
    return ids


def reference_pixels(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] uint8 -> [H, W, 3] float32 in [-1, 1], as the pipeline's image processor
    normalises (its resize to the same size keeps the pixels)."""
    return np.asarray(image, np.float32) / np.float32(255.0) * 2.0 - 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class KontextReferences:
    """The pipeline's `prepare_latents` for a prompt's reference images ([H, W, 3] uint8
    each) -> (tokens [M, 4 * latent], ids [M, 3]) float32, one image after another."""

    encode: object  # `autoencoder.load_encode`'s
    params: dict
    multiple: int  # pixels per packed token

    def __call__(self, images) -> tuple[np.ndarray, np.ndarray]:
        tokens, ids = [], []
        for image in images:
            pixels = jnp.asarray(reference_pixels(image))[None]
            latents = self.encode(self.params, pixels)
            tokens.append(np.asarray(patches.pack_latents(latents)[0], np.float32))
            ids.append(reference_ids(*latents.shape[2:]))
        return np.concatenate(tokens), np.concatenate(ids)


def load_references(folder: Path, dtype, hint: str, vae_scale: int) -> KontextReferences:
    """The `vae/` folder's encoder as `KontextReferences`."""
    encode, params = autoencoder.load_encode(folder, dtype, hint)
    return KontextReferences(encode, params, vae_scale * patches.LATENT_PATCH)


def reference_side(options, vae_scale: int) -> int:
    """The side in pixels of an editing model's input images: `reference_resolution`, or the
    output's `resolution` when 0; a multiple of a packed token's pixels."""
    side = int(options.reference_resolution or options.resolution or DEFAULT_SIDE)
    multiple = vae_scale * patches.LATENT_PATCH
    if side < multiple or side % multiple:
        raise ModelLoadError(
            f"model.flux.reference_resolution {side} must be a positive multiple of {multiple} "
            "pixels (one 2x2 patch of latents)."
        )
    return side


def conditioning_width(module) -> int:
    """The width of an editing model's rows: the text's (T5's and the pooled vector's), or
    wider where a reference row's channels and ids need it (never for the releases, 4096
    against 67)."""
    return max(
        module.joint_attention_dim,
        module.pooled_projection_dim,
        module.in_channels + transformer.ID_AXES,
    )


def reference_tokens(options, vae_scale: int) -> int:
    """The reference rows after a prompt's text rows (0 without editing)."""
    if not options.reference_images:
        return 0
    per_side = reference_side(options, vae_scale) // (vae_scale * patches.LATENT_PATCH)
    return options.reference_images * per_side**2
