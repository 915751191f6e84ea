"""The causal 3D convolutional VAE's encoder for one image, in Flax, channels-last: a video's
first frame, as image-to-video pipelines encode the frame they start from (`load_encoder`,
`encode_fn`); the network's shared blocks and config are `causal_vae`'s.

The encoder reads one frame: diffusers encodes a video's first frame alone, where every causal
convolution sees zeros in front and the temporal downsamplers pass it through, so one image
is encoded exactly without any cache. Its latents are the distribution's mean (`mode()`, as
`WanImageToVideoPipeline` takes them), normalised `(z - latents_mean) / latents_std`.
Measured against diffusers' `AutoencoderKLWan.encode` on tiny random VAEs
(tests/parity/test_wan_vae.py, float32, CPU): within 5e-7 of latents of scale ~1 for Wan2.1's
and Wan2.2's, the image at the video's size or resized to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.base import ModelLoadError, cast_floats
from tree_grpo_jax.models.causal_vae import (
    RGB,
    CausalConv3d,
    CausalVAEConfig,
    MidBlock,
    ResidualBlock,
    RMSNorm,
    vae_config,
    vae_state,
)
from tree_grpo_jax.weights import convert, files

_ENCODER_PREFIXES = ("encoder.", "quant_conv.")

# ---------------------------------------------------------------------------------------------
# The encoder, for one image: the first frame of a video, as image-to-video pipelines encode
# the frame they start from. diffusers encodes a video's first frame alone (its first chunk),
# with every causal conv's frames in front zeros; the temporal downsamplers' time convs only
# start at the second chunk, so a lone first frame never reaches them.


def patchify(x, patch: int):
    """[B, T, pH, pW, 3] -> [B, T, H, W, 3 p^2], `unpatchify`'s inverse (channel
    `c p^2 + i p + j` is pixel (row j, column i) of the position's patch)."""
    if patch == 1:
        return x
    b, t, hp, wp, c = x.shape
    x = x.reshape(b, t, hp // patch, patch, wp // patch, patch, c)  # (.., j: row, .., i, c)
    x = jnp.transpose(x, (0, 1, 2, 4, 6, 5, 3))
    return x.reshape(b, t, hp // patch, wp // patch, c * patch * patch)


class DownResample(nn.Module):
    """`WanResample` in its two down modes on a video's first frame: one zero row and column
    after the last, then a 3x3 conv of stride 2 (`downsample3d`'s time conv waits for the
    second chunk, which a lone frame never has)."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        b, t, h, w, c = x.shape
        y = nn.Conv(
            c,
            (3, 3),
            strides=(2, 2),
            padding=((0, 1), (0, 1)),
            dtype=self.dtype,
            name="resample_1",
        )(x.reshape(b * t, h, w, c))
        return y.reshape(b, t, *y.shape[1:])


def avg_shortcut(x, out_dim: int, time_factor: int, space_factor: int):
    """`AvgDown3D`, the residual down block's shortcut: zero frames in front up to a multiple
    of `time_factor`, each (time, row, column) cell's values stacked channel-major, and each
    output channel the mean of its run of consecutive stacked channels."""
    pad = (-x.shape[1]) % time_factor
    x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0), (0, 0), (0, 0)))
    b, t, h, w, c = x.shape
    ft, fs = time_factor, space_factor
    x = x.reshape(b, t // ft, ft, h // fs, fs, w // fs, fs, c)
    x = jnp.transpose(x, (0, 1, 3, 5, 7, 2, 4, 6))  # (c, ft, row, column) stacked
    x = x.reshape(b, t // ft, h // fs, w // fs, out_dim, c * ft * fs * fs // out_dim)
    return x.mean(axis=-1)


class ResidualDownBlock(nn.Module):
    """`WanResidualDownBlock` (Wan2.2): residual blocks, the downsampler (if any), plus the
    input through `avg_shortcut`."""

    out_dim: int
    num_res_blocks: int
    temporal: bool
    down: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        shortcut = x
        for i in range(self.num_res_blocks):
            x = ResidualBlock(self.out_dim, self.dtype, name=f"resnets_{i}")(x)
        if self.down:
            x = DownResample(self.dtype, name="downsampler")(x)
        ft = 2 if self.temporal and self.down else 1
        fs = 2 if self.down else 1
        return x + avg_shortcut(shortcut, self.out_dim, ft, fs).astype(x.dtype)


class Encoder3d(nn.Module):
    """`WanEncoder3d` on a video's first frame: [B, 1, H, W, 3 p^2] -> [B, 1, H / 2**levels,
    W / 2**levels, 2 z_dim] (the latent distribution's mean and log-variance)."""

    config: CausalVAEConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.config
        levels = len(c.dim_mult)
        dims = [c.base_dim * u for u in (1, *c.dim_mult)]
        x = CausalConv3d(dims[0], (3, 3, 3), self.dtype, name="conv_in")(x)
        k = 0  # Wan2.1's blocks are one flat list
        for i, out_dim in enumerate(dims[1:]):
            down = i != levels - 1
            if c.is_residual:
                temporal = bool(c.temperal_downsample[i]) if down else False
                x = ResidualDownBlock(
                    out_dim, c.num_res_blocks, temporal, down, self.dtype, name=f"down_blocks_{i}"
                )(x)
                continue
            for _ in range(c.num_res_blocks):
                x = ResidualBlock(out_dim, self.dtype, name=f"down_blocks_{k}")(x)
                k += 1
            if down:
                x = DownResample(self.dtype, name=f"down_blocks_{k}")(x)
                k += 1
        x = MidBlock(self.dtype, name="mid_block")(x)
        x = nn.silu(RMSNorm(self.dtype, name="norm_out")(x))
        return CausalConv3d(2 * c.z_dim, (3, 3, 3), self.dtype, name="conv_out")(x)


class CausalVAEEncoder(nn.Module):
    """The encoder then `quant_conv`, on images [B, H, W, 3] in [-1, 1] (H, W multiples of
    `spatial_factor`): the latent distribution's mean, [B, H / s, W / s, z_dim], not yet
    normalised. The params are {"encoder", "quant_conv"}, as the folder's keys are
    prefixed."""

    config: CausalVAEConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images):
        c = self.config
        x = patchify(images[:, None].astype(self.dtype), c.patch)
        x = Encoder3d(c, self.dtype, name="encoder")(x)
        x = CausalConv3d(2 * c.z_dim, (1, 1, 1), self.dtype, name="quant_conv")(x)
        return x[:, 0, :, :, : c.z_dim]  # the mean; the log-variance is not used


# ---------------------------------------------------------------------------------------------
# Building, converting and loading.


def encoder_module(config: dict | CausalVAEConfig, dtype=jnp.float32) -> CausalVAEEncoder:
    """The first-frame encoder a `vae/config.json` dict (or a CausalVAEConfig) describes;
    ValueError for an encoder with attention levels (`attn_scales`), which no release has."""
    c = config if isinstance(config, CausalVAEConfig) else vae_config(config)
    if c.attn_scales:
        raise ValueError(
            f"the VAE's encoder has attention at scales {list(c.attn_scales)}; only encoders "
            "without (attn_scales empty, as the Wan releases') are implemented."
        )
    return CausalVAEEncoder(c, dtype)


def encoder_shapes(module: CausalVAEEncoder) -> dict:
    """The encoder's params as ShapeDtypeStructs (nothing is computed)."""
    s = module.config.spatial_factor
    images = jnp.zeros((1, s, s, RGB), module.dtype)
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), images)["params"])


def convert_encoder(state: dict[str, np.ndarray], config: dict | CausalVAEConfig) -> dict:
    """diffusers `AutoencoderKLWan` weights -> the first-frame encoder's Flax params. The
    temporal downsamplers' time convs are left out: a video's first frame never reaches
    them. A missing, extra or mis-shaped encoder weight is a ParamTreeMismatch naming it."""
    shapes = encoder_shapes(encoder_module(config))
    return vae_state(state, _ENCODER_PREFIXES, shapes, skip=(".time_conv.",))


def load_encoder(folder: Path, dtype, hint: str):
    """`(module, params, CausalVAEConfig)` of the first-frame encoder of a diffusers `vae/`
    folder, without torch; one sentence (ModelLoadError ending in `hint`) for a folder
    without the encoder's weights or that does not fit."""
    folder = Path(folder)
    where = folder / "config.json"
    config = vae_config(files.read_json(where, hint), where)
    state = files.read_weights(folder, "diffusion_pytorch_model", hint)
    if not any(key.startswith(_ENCODER_PREFIXES) for key in state):
        raise ModelLoadError(
            f"{folder} holds no VAE encoder weights (encoder.*, quant_conv.*), which encoding "
            f"input images needs; {hint}."
        )
    try:
        module = encoder_module(config, dtype)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {str(e).rstrip('.')}; {hint}.") from None
    with convert.weights_of(folder, hint):
        params = convert_encoder(state, config)
    return module, cast_floats(params, dtype), config


def image_to_pixels(image, height: int, width: int) -> np.ndarray:
    """An [H, W, 3] uint8 image at `height` x `width` in [-1, 1], float32, as the video
    pipelines preprocess the image they start from: resized (Lanczos, no crop) when its
    size differs, then scaled."""
    from PIL import Image

    pixels = np.asarray(image)
    if pixels.ndim != 3 or pixels.shape[-1] != RGB or pixels.dtype != np.uint8:
        raise ValueError(f"an input image is [H, W, 3] uint8, got {pixels.shape} {pixels.dtype}.")
    if pixels.shape[:2] != (height, width):
        resized = Image.fromarray(pixels).resize((width, height), resample=Image.LANCZOS)
        pixels = np.asarray(resized)
    return pixels.astype(np.float32) / 127.5 - 1.0


def encode_fn(module: CausalVAEEncoder, config: dict | CausalVAEConfig):
    """`encode(params, images [B, H, W, 3] in [-1, 1]) -> latents [B, H / s, W / s, z_dim]`,
    jitted: the latent distribution's mean (its mode), normalised as the pipelines do,
    `(mean - latents_mean) / latents_std`: the first latent frame of a video that starts
    with these images, in the samples' layout."""
    c = config if isinstance(config, CausalVAEConfig) else vae_config(config)
    mean = jnp.asarray(c.latents_mean, jnp.float32)
    inv_std = 1.0 / jnp.asarray(c.latents_std, jnp.float32)  # as the pipeline writes it

    @jax.jit
    def encode(params, images):
        z = module.apply({"params": params}, images.astype(module.dtype))
        return (z.astype(jnp.float32) - mean) * inv_std

    return encode
