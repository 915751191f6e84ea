"""diffusers' `AutoencoderKL`, the image VAE of Stable Diffusion 1.x (4 latent channels, with
quant convs), SD3 / 3.5 and FLUX.1 (16 latent channels, none), as Linen modules over
channels-last images [B, H, W, C].

The parameter tree is the one diffusers' former Flax VAE had: module lists as `down_blocks_0`
(`weights.convert.DIFFUSERS_LIST_NAMES`), the mid-block attention under the old names
`query`, `key`, `value` and `proj_attn`, the encoder, decoder and quant convs at the top. So
Flax msgpack files written for that class load unchanged, `weights.convert` maps a
diffusers `vae/` folder's PyTorch names onto it, and the same key initialises the same
values. The computation is that class's too, op for op: GroupNorm with eps 1e-6 and its
statistics in float32, SiLU, convolutions and projections in `dtype`, nearest 2x upsampling,
downsampling by a stride-2 conv after one row and column of zeros at the bottom right, and
one-head attention with the 1 / sqrt(C) scale split as C^-1/4 on queries and keys.

`encode` gives the latent Gaussian's mean and log-variance (clipped to [-30, 20]); `decode`
gives images in about [-1, 1]. Both take and give unscaled latents: the pipelines'
`scaling_factor` and `shift_factor` are their callers' business.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tree_grpo_jax.weights import files

NORM_EPS = 1e-6
LOGVAR_RANGE = (-30.0, 20.0)  # diffusers' clip of the encoder's log-variance
DOWN_BLOCK = "DownEncoderBlock2D"
UP_BLOCK = "UpDecoderBlock2D"


def _conv3x3(features: int, dtype, name: str) -> nn.Conv:
    return nn.Conv(
        features, (3, 3), strides=(1, 1), padding=((1, 1), (1, 1)), dtype=dtype, name=name
    )


def _conv1x1(features: int, dtype, name: str | None = None) -> nn.Conv:
    return nn.Conv(features, (1, 1), strides=(1, 1), padding="VALID", dtype=dtype, name=name)


def _group_norm(groups: int, name: str) -> nn.GroupNorm:
    # No dtype: the output follows the input and the (cast) params, as the former class did.
    return nn.GroupNorm(num_groups=groups, epsilon=NORM_EPS, name=name)


class ResnetBlock2D(nn.Module):
    """GroupNorm, SiLU, 3x3 conv, twice, plus the input (through a 1x1 conv,
    `conv_shortcut`, when the channel count changes)."""

    out_channels: int
    groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.swish(_group_norm(self.groups, "norm1")(x))
        h = _conv3x3(self.out_channels, self.dtype, "conv1")(h)
        h = nn.swish(_group_norm(self.groups, "norm2")(h))
        h = _conv3x3(self.out_channels, self.dtype, "conv2")(h)
        if x.shape[-1] != self.out_channels:
            x = _conv1x1(self.out_channels, self.dtype, "conv_shortcut")(x)
        return h + x


class AttentionBlock(nn.Module):
    """One-head self-attention over all pixels, after a GroupNorm, with a residual."""

    groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        b, height, width, c = x.shape
        tokens = _group_norm(self.groups, "group_norm")(x).reshape(b, height * width, c)

        def project(name):  # [B, T, C] -> [B, heads=1, T, C]
            return nn.Dense(c, dtype=self.dtype, name=name)(tokens)[:, None]

        query, key, value = project("query"), project("key"), project("value")
        # 1/sqrt(C) split between the two operands keeps the scores' magnitudes in range.
        scale = 1 / math.sqrt(math.sqrt(c))
        scores = jnp.einsum("bhqd,bhkd->bhqk", query * scale, key * scale)
        weights = nn.softmax(scores, axis=-1)
        mixed = jnp.einsum("bhkd,bhqk->bhqd", value, weights)[:, 0]
        out = nn.Dense(c, dtype=self.dtype, name="proj_attn")(mixed)
        return out.reshape(b, height, width, c) + x


class Downsample2D(nn.Module):
    """Half the height and width: a zero row and column at the bottom right, then a
    stride-2 3x3 conv without padding."""

    channels: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        conv = nn.Conv(
            self.channels, (3, 3), strides=(2, 2), padding="VALID", dtype=self.dtype, name="conv"
        )
        return conv(x)


class Upsample2D(nn.Module):
    """Twice the height and width: each pixel repeated 2x2 (nearest), then a 3x3 conv."""

    channels: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return _conv3x3(self.channels, self.dtype, "conv")(x)


class MidBlock2D(nn.Module):
    """Resnet, attention, resnet at the lowest resolution, the channel count unchanged."""

    channels: int
    groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = ResnetBlock2D(self.channels, self.groups, self.dtype, name="resnets_0")(x)
        x = AttentionBlock(self.groups, self.dtype, name="attentions_0")(x)
        return ResnetBlock2D(self.channels, self.groups, self.dtype, name="resnets_1")(x)


class DownEncoderBlock2D(nn.Module):
    """`num_layers` resnets, then (but in the last block) a downsampler."""

    out_channels: int
    num_layers: int
    groups: int
    add_downsample: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = ResnetBlock2D(self.out_channels, self.groups, self.dtype, name=f"resnets_{i}")(x)
        if self.add_downsample:
            x = Downsample2D(self.out_channels, self.dtype, name="downsamplers_0")(x)
        return x


class UpDecoderBlock2D(nn.Module):
    """`num_layers` resnets, then (but in the last block) an upsampler."""

    out_channels: int
    num_layers: int
    groups: int
    add_upsample: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = ResnetBlock2D(self.out_channels, self.groups, self.dtype, name=f"resnets_{i}")(x)
        if self.add_upsample:
            x = Upsample2D(self.out_channels, self.dtype, name="upsamplers_0")(x)
        return x


class Encoder(nn.Module):
    """Images [B, H, W, in] -> [B, H / 2^(n-1), W / 2^(n-1), out] for n blocks."""

    out_channels: int
    block_out_channels: tuple[int, ...]
    layers_per_block: int
    groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        channels = self.block_out_channels
        x = _conv3x3(channels[0], self.dtype, "conv_in")(x)
        for i, width in enumerate(channels):
            x = DownEncoderBlock2D(
                width,
                self.layers_per_block,
                self.groups,
                add_downsample=i < len(channels) - 1,
                dtype=self.dtype,
                name=f"down_blocks_{i}",
            )(x)
        x = MidBlock2D(channels[-1], self.groups, self.dtype, name="mid_block")(x)
        x = nn.swish(_group_norm(self.groups, "conv_norm_out")(x))
        return _conv3x3(self.out_channels, self.dtype, "conv_out")(x)


class Decoder(nn.Module):
    """Latents [B, h, w, latent] -> images [B, h * 2^(n-1), w * 2^(n-1), out] for n blocks;
    each up block has one resnet more than an encoder block."""

    out_channels: int
    block_out_channels: tuple[int, ...]
    layers_per_block: int
    groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, z):
        channels = tuple(reversed(self.block_out_channels))
        x = _conv3x3(channels[0], self.dtype, "conv_in")(z)
        x = MidBlock2D(channels[0], self.groups, self.dtype, name="mid_block")(x)
        for i, width in enumerate(channels):
            x = UpDecoderBlock2D(
                width,
                self.layers_per_block + 1,
                self.groups,
                add_upsample=i < len(channels) - 1,
                dtype=self.dtype,
                name=f"up_blocks_{i}",
            )(x)
        x = nn.swish(_group_norm(self.groups, "conv_norm_out")(x))
        return _conv3x3(self.out_channels, self.dtype, "conv_out")(x)


class AutoencoderKL(nn.Module):
    """The VAE; its fields are the `vae/config.json` fields it reads (and, so that
    `files.check_field_types` can check a config against them, the types they take).
    `act_fn` is always SiLU and `sample_size` only sizes `init_weights`' dummy image."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = (DOWN_BLOCK,)
    up_block_types: tuple[str, ...] = (UP_BLOCK,)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int = 32
    scaling_factor: float = 0.18215
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    dtype: Any = jnp.float32

    def setup(self):
        shared = dict(
            block_out_channels=tuple(self.block_out_channels),
            layers_per_block=self.layers_per_block,
            groups=self.norm_num_groups,
            dtype=self.dtype,
        )
        # The encoder gives the mean and the log-variance of each latent channel.
        self.encoder = Encoder(out_channels=2 * self.latent_channels, **shared)
        self.decoder = Decoder(out_channels=self.out_channels, **shared)
        if self.use_quant_conv:
            self.quant_conv = _conv1x1(2 * self.latent_channels, self.dtype)
        if self.use_post_quant_conv:
            self.post_quant_conv = _conv1x1(self.latent_channels, self.dtype)

    def encode(self, images):
        """Images [B, H, W, in] in about [-1, 1] -> (mean, logvar), each [B, h, w, latent]."""
        moments = self.encoder(images)
        if self.use_quant_conv:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, *LOGVAR_RANGE)

    def decode(self, latents):
        """Latents [B, h, w, latent] -> images [B, H, W, out] in about [-1, 1]."""
        if self.use_post_quant_conv:
            latents = self.post_quant_conv(latents)
        return self.decoder(latents)

    def __call__(self, images):
        """The images encoded to their latent means and decoded back."""
        mean, _ = self.encode(images)
        return self.decode(mean)

    def init_weights(self, rng: jax.Array) -> dict:
        """Params from `rng`: the values the former Flax class drew from the same key (its
        first of three subkeys initialised the params)."""
        params_rng = jax.random.split(rng, 3)[0]
        image = jnp.zeros((1, self.sample_size, self.sample_size, self.in_channels))
        return self.init({"params": params_rng}, image)["params"]


def module_from_config(config: dict, where: Path | str, dtype, fixed: dict) -> AutoencoderKL:
    """The VAE a `vae/config.json` describes, checked: `fixed` names fields the caller runs
    with one value only, and every block must be the plain resnet kind, one per width."""
    files.check_fixed(config, fixed, where)
    files.check_field_types(config, AutoencoderKL, where)
    for key, kind in (("down_block_types", DOWN_BLOCK), ("up_block_types", UP_BLOCK)):
        blocks = config.get(key, getattr(AutoencoderKL, key))
        widths = config.get("block_out_channels", AutoencoderKL.block_out_channels)
        if any(b != kind for b in blocks) or len(blocks) != len(widths):
            raise files.ModelLoadError(
                f"{where} sets {key}={list(blocks)!r}, but only one {kind!r} per "
                f"block_out_channels entry ({len(widths)}) is supported."
            )
    names = {f.name for f in dataclasses.fields(AutoencoderKL)} - {"parent", "name", "dtype"}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in names}
    return AutoencoderKL(**kwargs, dtype=dtype)
