"""FLUX.2's VAE decoder (diffusers' `AutoencoderKLFlux2`) and what its pipelines do between
their final latents and the images.

The decoder is `models.autoencoder_kl`'s, with 32 latent channels and a post-quant conv. What
differs is around it: the FLUX.2 pipelines hold their latents as 2x2 patches of those 32
channels, 128 channels on a grid half the size (`patches.pack_latents`' channel order: latent
channel, patch row, patch column), normalised per patch channel by the VAE's batch-norm
running statistics (`bn.running_mean`, `bn.running_var`, its `batch_norm_eps`), which the
VAE keeps but never applies itself. Before decoding, the pipeline undoes that normalisation,
unpacks the patches and decodes; the image processor maps [-1, 1] to [0, 1].

`Flux2VAEEncoder` is the way in, for the reference images an edit starts from: the
encoder's latent mean (the pipelines encode with `sample_mode="argmax"`), patched 2x2 and
normalised by the same statistics (`_encode_vae_image`).

`Flux2VAEDecoder` does all of it from the normalised patch grid (channels-last), and `decode`
is the pipeline's last step, `(params, latents [B, 128, h, w]) -> images [B, 16h, 16w, 3]` in
[0, 1] for the released four-level VAE. `params_from_state_dict` reads diffusers' state dict
(the decoder, the post-quant conv and the two statistics; the encoder is left out),
`encoder_params_from_state_dict` the encoder's half (encoder, quant conv, statistics).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import patches
from tree_grpo_jax.models.autoencoder_kl import DOWN_BLOCK, UP_BLOCK, Decoder, Encoder
from tree_grpo_jax.weights import convert

PATCH = patches.LATENT_PATCH

# black-forest-labs/FLUX.2-dev's vae/config.json (the klein releases ship the same VAE), as
# DustyL/blissful-tuner docs/flux2_architecture.md quotes it: four levels of 128 to 512
# channels, 32 latent channels, quant convs, batch-norm eps 1e-4 over the 128 patch channels.
FLUX2_DEV_VAE = {
    "_class_name": "AutoencoderKLFlux2",
    "act_fn": "silu",
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 32,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "patch_size": [2, 2],
    "sample_size": 1024,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": True,
    "use_quant_conv": True,
}

# State-dict prefixes each half reads (the BN counter is read by neither).
_STATISTICS = ("bn.running_mean", "bn.running_var")
_DECODER_PREFIXES = ("decoder.", "post_quant_conv.", *_STATISTICS)
_ENCODER_PREFIXES = ("encoder.", "quant_conv.", *_STATISTICS)


class Flux2VAEDecoder(nn.Module):
    """Normalised patch latents [B, h, w, 4 * latent] (channels-last) -> images
    [B, 2h * 2^(n-1), 2w * 2^(n-1), out] in about [-1, 1] for n blocks. The batch-norm
    statistics are top-level params (`running_mean`, `running_var`), read from the
    checkpoint's `bn.*` buffers and never trained."""

    latent_channels: int = 32
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    use_post_quant_conv: bool = True
    batch_norm_eps: float = 1e-4
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, patched):
        features = PATCH * PATCH * self.latent_channels
        batch, rows, columns, width = patched.shape
        if width != features:
            raise ValueError(f"patch latents have {width} channels, the VAE takes {features}.")
        mean = self.param("running_mean", nn.initializers.zeros, (features,))
        var = self.param("running_var", nn.initializers.ones, (features,))
        # The pipeline's arithmetic: x * sqrt(var + eps) + mean, in the latents' dtype.
        std = jnp.sqrt(var + self.batch_norm_eps).astype(patched.dtype)
        patched = patched * std + mean.astype(patched.dtype)
        tokens = patched.reshape(batch, rows * columns, features)
        latents = patches.unpack_latents(tokens, rows * PATCH, columns * PATCH)
        latents = jnp.transpose(latents, (0, 2, 3, 1)).astype(self.dtype)
        if self.use_post_quant_conv:
            latents = nn.Conv(
                self.latent_channels, (1, 1), padding="VALID", dtype=self.dtype,
                name="post_quant_conv",
            )(latents)  # fmt: skip
        return Decoder(
            out_channels=self.out_channels,
            block_out_channels=tuple(self.block_out_channels),
            layers_per_block=self.layers_per_block,
            groups=self.norm_num_groups,
            dtype=self.dtype,
            name="decoder",
        )(latents)

    def init_weights(self, rng: jax.Array) -> dict:
        patched = jnp.zeros((1, 1, 1, PATCH * PATCH * self.latent_channels))
        return self.init({"params": rng}, patched)["params"]


class Flux2VAEEncoder(nn.Module):
    """Images [B, H, W, in] in [-1, 1] (H, W multiples of 2 * 2^(n-1)) -> normalised patch
    latents [B, H / 2^n, W / 2^n, 4 * latent] (channels-last): the encoder's mean through
    the quant conv, 2x2 patches (`patches.pack_latents`' channel order), minus the batch-norm
    running mean over sqrt(var + eps), as the pipelines' `_encode_vae_image` gives them."""

    latent_channels: int = 32
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    use_quant_conv: bool = True
    batch_norm_eps: float = 1e-4
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images):
        features = PATCH * PATCH * self.latent_channels
        moments = Encoder(
            out_channels=2 * self.latent_channels,  # mean and log-variance
            block_out_channels=tuple(self.block_out_channels),
            layers_per_block=self.layers_per_block,
            groups=self.norm_num_groups,
            dtype=self.dtype,
            name="encoder",
        )(images.astype(self.dtype))
        if self.use_quant_conv:
            moments = nn.Conv(
                2 * self.latent_channels, (1, 1), padding="VALID", dtype=self.dtype,
                name="quant_conv",
            )(moments)  # fmt: skip
        mean = moments[..., : self.latent_channels]
        batch, height, width, _ = mean.shape
        tokens = patches.pack_latents(jnp.transpose(mean, (0, 3, 1, 2)))
        grid = tokens.reshape(batch, height // PATCH, width // PATCH, features)
        running_mean = self.param("running_mean", nn.initializers.zeros, (features,))
        running_var = self.param("running_var", nn.initializers.ones, (features,))
        std = jnp.sqrt(running_var + self.batch_norm_eps).astype(grid.dtype)
        return (grid - running_mean.astype(grid.dtype)) / std

    def init_weights(self, rng: jax.Array) -> dict:
        side = PATCH * 2 ** (len(self.block_out_channels) - 1)
        return self.init({"params": rng}, jnp.zeros((1, side, side, 3)))["params"]


def encoder_from_config(config: Mapping, dtype=jnp.float32) -> Flux2VAEEncoder:
    """The encoder half an `AutoencoderKLFlux2` config describes (checked as
    `module_from_config` checks it; the released encoders take RGB)."""
    decoder = module_from_config(config, dtype)
    config = dict(config)
    widths = config.get("block_out_channels", Flux2VAEEncoder.block_out_channels)
    blocks = config.get("down_block_types", [DOWN_BLOCK] * len(widths))
    if len(blocks) != len(widths) or any(b != DOWN_BLOCK for b in blocks):
        raise ValueError(f"down_block_types {list(blocks)!r} are not one {DOWN_BLOCK} per width.")
    if config.get("in_channels", 3) != 3:
        raise ValueError(f"the VAE takes {config['in_channels']} image channels, not RGB.")
    return Flux2VAEEncoder(
        latent_channels=decoder.latent_channels,
        block_out_channels=tuple(widths),
        layers_per_block=decoder.layers_per_block,
        norm_num_groups=decoder.norm_num_groups,
        use_quant_conv=config.get("use_quant_conv", True),
        batch_norm_eps=decoder.batch_norm_eps,
        dtype=dtype,
    )


def module_from_config(config: Mapping, dtype=jnp.float32) -> Flux2VAEDecoder:
    """The decoder an `AutoencoderKLFlux2` config describes (diffusers' defaults where a field
    is absent). ValueError (one sentence) for a variant it does not implement."""
    config = dict(config)
    unsupported = {
        "act_fn": "silu",
        "mid_block_add_attention": True,
        "patch_size": [PATCH, PATCH],
    }
    for key, value in unsupported.items():
        if key in config and list(np.atleast_1d(config[key])) != list(np.atleast_1d(value)):
            raise ValueError(f"the VAE config sets {key}={config[key]!r}; only {value!r} is run.")
    widths = config.get("decoder_block_out_channels") or config.get(
        "block_out_channels", Flux2VAEDecoder.block_out_channels
    )
    blocks = config.get("up_block_types", [UP_BLOCK] * len(widths))
    if len(blocks) != len(widths) or any(b != UP_BLOCK for b in blocks):
        raise ValueError(f"up_block_types {list(blocks)!r} are not one {UP_BLOCK} per width.")
    return Flux2VAEDecoder(
        latent_channels=config.get("latent_channels", 32),
        out_channels=config.get("out_channels", 3),
        block_out_channels=tuple(widths),
        layers_per_block=config.get("layers_per_block", 2),
        norm_num_groups=config.get("norm_num_groups", 32),
        use_post_quant_conv=config.get("use_post_quant_conv", True),
        batch_norm_eps=float(config.get("batch_norm_eps", 1e-4)),
        dtype=dtype,
    )


def params_from_state_dict(state: Mapping[str, np.ndarray], module: Flux2VAEDecoder) -> dict:
    """diffusers' `AutoencoderKLFlux2` state dict (numpy arrays) as the decoder's params;
    `convert.ParamTreeMismatch` names missing, unexpected and mis-shaped tensors."""
    kept = {k: v for k, v in state.items() if k.startswith(_DECODER_PREFIXES)}
    # The statistics sit at the top of our tree, not under `bn`.
    kept = {k.removeprefix("bn."): v for k, v in kept.items()}
    shapes = jax.eval_shape(module.init_weights, jax.random.PRNGKey(0))
    return convert.pytorch_to_flax(kept, convert.shapes_of(shapes))


def encoder_params_from_state_dict(
    state: Mapping[str, np.ndarray], module: Flux2VAEEncoder
) -> dict:
    """The encoder half of diffusers' `AutoencoderKLFlux2` state dict as `module`'s params."""
    kept = {k: v for k, v in state.items() if k.startswith(_ENCODER_PREFIXES)}
    kept = {k.removeprefix("bn."): v for k, v in kept.items()}
    shapes = jax.eval_shape(module.init_weights, jax.random.PRNGKey(0))
    return convert.pytorch_to_flax(kept, convert.shapes_of(shapes))


def decode_fn(module: Flux2VAEDecoder):
    """`decode(params, latents [B, 4 * latent, h, w]) -> images [B, H, W, out]` in [0, 1],
    jitted: the pipeline's normalised patch latents (as its `prepare_latents` lays them out)
    to the images its image processor gives."""

    @jax.jit
    def decode(params, latents):
        patched = jnp.transpose(latents, (0, 2, 3, 1))
        images = module.apply({"params": params}, patched)
        return jnp.clip(images.astype(jnp.float32) / 2.0 + 0.5, 0.0, 1.0)

    return decode


def tokens_to_latents(tokens: jax.Array, rows: int, columns: int) -> jax.Array:
    """The transformer's tokens [B, rows * columns, C] (row-major, as the pipeline's latent
    ids place them) -> the latent grid [B, C, rows, columns] `decode` takes."""
    batch, count, features = tokens.shape
    if count != rows * columns:
        raise ValueError(f"{count} tokens are not a {rows}x{columns} grid.")
    return jnp.transpose(tokens.reshape(batch, rows, columns, features), (0, 3, 1, 2))
