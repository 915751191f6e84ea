"""The VAE of the flow families (SD3 / 3.5 and FLUX.1): `models.autoencoder_kl`'s
`AutoencoderKL` (diffusers' of that name) with 16 latent channels and no quant convs, from a
diffusers `vae/` folder.

The decoder is read and run to decode; the encoder only for editing (FLUX.1-Kontext's
reference images, `load_encode`), which takes the latent Gaussian's mean as the pipeline's
`sample_mode="argmax"` does and scales it `(z - shift_factor) * scaling_factor`. Latents
are unscaled as the pipelines do before decoding, `z / scaling_factor + shift_factor` with
the folder's factors (SD3.5: 1.5305 and 0.0609; FLUX.1: 0.3611 and 0.1159), and the images
come back in [0, 1].
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from tree_grpo_jax.models.autoencoder_kl import AutoencoderKL, module_from_config
from tree_grpo_jax.models.base import Decoder, cast_floats
from tree_grpo_jax.weights import convert, files

# Config fields the decoder does not read, with the one value it implements.
FIXED = {
    "act_fn": "silu",
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}


def vae_module(config: dict, where: Path, dtype) -> AutoencoderKL:
    """The VAE a `vae/config.json` describes, checked."""
    return module_from_config(config, where, dtype, FIXED)


def part_shapes(module, part: str, dtype=jnp.float32) -> dict:
    """The params of the VAE's `part` ("encoder" or "decoder") as ShapeDtypeStructs in
    `dtype` (nothing is computed)."""
    init = jax.eval_shape(module.init_weights, jax.random.PRNGKey(0))
    return jax.eval_shape(lambda p: cast_floats({part: p}, dtype), init[part])


def _read_part(folder: Path, dtype, hint: str, part: str):
    """`(module, params of `part`, config)` of a `vae/` folder; the other part is never
    read (its tensors are dropped before conversion)."""
    config = files.read_json(folder / "config.json", hint)
    module = vae_module(config, folder / "config.json", dtype)
    state = files.read_weights(folder, "diffusion_pytorch_model", hint)
    state = {k: v for k, v in state.items() if k.startswith(f"{part}.")}
    reference = convert.shapes_of(part_shapes(module, part))
    params = convert.folder_to_flax(folder, state, reference, hint)
    return module, params, config


def load_decoder(folder: Path, dtype, hint: str):
    """`(module, decoder params, config)` of a `vae/` folder; the encoder is never read."""
    module, params, config = _read_part(folder, dtype, hint, "decoder")
    return module, cast_floats(params, dtype), config


def load_encode(folder: Path, dtype, hint: str):
    """`(encode, encoder params)` of a `vae/` folder (its decoder is not read):
    `encode(params, images [B, H, W, 3] in [-1, 1]) -> latents [B, C, H / 8, W / 8]`,
    jitted, the encoder's mean shifted and scaled by the folder's factors."""
    module, params, config = _read_part(folder, dtype, hint, "encoder")
    scaling = float(config.get("scaling_factor", 0.18215))
    shift = float(config.get("shift_factor") or 0.0)

    @jax.jit
    def encode(params, images):
        mean, _ = module.apply({"params": params}, images.astype(dtype), method="encode")
        latents = (mean.astype(jnp.float32) - shift) * scaling
        return jnp.transpose(latents, (0, 3, 1, 2))

    return encode, cast_floats(params, dtype)


def decode_fn(module, config: dict, batch_size: int, dtype):
    """`(decoder params, latents [B, C, h, w]) -> images [B, H, W, 3]` in [0, 1], jitted;
    `batch_size` latents go through the decoder at once."""
    scaling = float(config.get("scaling_factor", 0.18215))  # absent: diffusers' default
    shift = float(config.get("shift_factor") or 0.0)

    def decode_one(params, z):  # z [h, w, c] -> image [H, W, 3]
        return module.apply({"params": params}, z[None], method=lambda m, z: m.decoder(z))[0]

    @jax.jit
    def decode_latents(params, latents):
        z = jnp.transpose(latents, (0, 2, 3, 1)).astype(jnp.float32) / scaling + shift
        images = jax.lax.map(
            lambda zi: decode_one(params, zi.astype(dtype)), z, batch_size=batch_size
        )
        return jnp.clip(images.astype(jnp.float32) / 2.0 + 0.5, 0.0, 1.0)

    return decode_latents


def load_decode(folder: Path, dtype, hint: str, batch_size: int):
    """`(decode, config)` of a `vae/` folder: `decode(latents)` is `decode_fn`'s with the
    decoder's params (`load_decoder`'s), as a loaded model's `decode`."""
    module, params, config = load_decoder(folder, dtype, hint)
    return Decoder(decode_fn(module, config, batch_size, dtype), params), config
