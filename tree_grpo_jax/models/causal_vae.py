"""The causal 3D convolutional VAE's decoder in Flax, channels-last, from a diffusers `vae/`
folder (its encoder for one image is `causal_vae_encoder`). Wan2.1 (diffusers' `AutoencoderKLWan`)
and Qwen-Image (`AutoencoderKLQwenImage`) share this network: the same modules, weight names
and shapes, and the same latent statistics in their configs. Qwen-Image decodes one latent
frame, a video of one frame.

Wan2.2's VAE (`AutoencoderKLWan` with `is_residual` and `patch_size`, Wan2.2-TI2V-5B's: 48
latent channels) is the same network with two changes. Its up blocks are residual: their
upsampler keeps the block's width instead of halving it, and a parameter-free shortcut adds
the block's input, each channel repeated and spread over the 2x2 (or 2x2x2 with time) cells
it grows into (`DupShortcut`). And its last conv gives `3 p^2` channels, the p x p pixels of
each output position (`unpatchify`), so a latent is `2**(levels - 1) * p` pixels wide (16).

diffusers decodes one latent frame at a time and carries each causal convolution's last two
input frames over to the next frame. That cache is exact: a convolution over the whole
sequence with the same causal padding (two zero frames in front, none behind) gives the
same numbers. `decode_fn` runs either way: one latent frame at a time by default (a scan
carrying the caches, so only one latent frame's video frames are alive), or all at once.
The one place where the frame-by-frame loop is not a plain causal convolution is the
temporal upsampler (`upsample3d`): the first latent frame passes through it alone (one
frame in, one frame out), and its time convolution sees the following frames as if the
sequence started at the second one (zeros before it). So F latent frames become
`1 + 2**u * (F - 1)` video frames for u temporal upsamplers (Wan2.1: u = 2,
`1 + 4 (F - 1)`), and `2**(levels - 1)` pixels per latent side (Wan2.1: 8).

Latents are de-normalised as WanPipeline and QwenImagePipeline do before `vae.decode`,
`latents / (1 / latents_std) + latents_mean` with the folder's per-channel statistics, and
the videos come back clamped and in [0, 1], `[B, T, H, W, 3]` (`models.media`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.base import ModelLoadError, cast_floats
from tree_grpo_jax.weights import convert, files

# Config fields the decoder does not read, with the one value it implements (Qwen-Image's
# `input_channels` is the pixels' channels, which its decoder gives back).
FIXED = {"input_channels": 3}
RGB = 3
# The diffusers classes of this network; a config without `_class_name` is taken as Wan's.
CLASS_NAMES = ("AutoencoderKLWan", "AutoencoderKLQwenImage")
_PREFIXES = ("decoder.", "post_quant_conv.")
_NORM_EPS = 1e-12  # torch.nn.functional.normalize's floor on the norm


# Both classes' own defaults (Wan2.1's statistics), for a config that leaves them out.
_DEFAULT_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
_DEFAULT_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CausalVAEConfig:
    """The fields of an `AutoencoderKLWan` or `AutoencoderKLQwenImage` config that the
    decoder reads, with Wan2.1's values as defaults (a folder's config.json may leave them
    out; Qwen-Image's has no `decoder_base_dim`, so its decoder is `base_dim` wide)."""

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    latents_mean: tuple[float, ...] = ()
    latents_std: tuple[float, ...] = ()
    is_residual: bool = False  # Wan2.2's residual up blocks
    patch_size: int | None = None  # Wan2.2's p x p pixels per output position
    out_channels: int = RGB  # the last conv's: 3 p^2
    in_channels: int = RGB  # the encoder's first conv's: 3 p^2
    attn_scales: tuple[float, ...] = ()  # the encoder's attention levels (the releases: none)

    @property
    def patch(self) -> int:
        return self.patch_size or 1

    @property
    def dim(self) -> int:
        return self.decoder_base_dim or self.base_dim

    @property
    def temporal_upsample(self) -> tuple[bool, ...]:
        """Whether each up block (all but the last) doubles the frames: the encoder's
        temporal downsampling read backwards."""
        levels = len(self.dim_mult) - 1
        return tuple(self.temperal_downsample[::-1][:levels])

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1) * self.patch

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(self.temporal_upsample)


def vae_config(config: dict, where: Path | str = "the VAE config") -> CausalVAEConfig:
    """The decoder's settings from a `vae/config.json` dict; one sentence (ModelLoadError)
    for a field the decoder does not implement or that does not fit the others."""
    files.check_fixed(config, FIXED, where)
    files.check_field_types(config, CausalVAEConfig, where)
    fields = {f.name for f in dataclasses.fields(CausalVAEConfig)}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in fields}
    kwargs.setdefault("latents_mean", tuple(_DEFAULT_MEAN))
    kwargs.setdefault("latents_std", tuple(_DEFAULT_STD))
    c = CausalVAEConfig(**kwargs)
    if len(c.dim_mult) < 1 or len(c.temperal_downsample) < len(c.dim_mult) - 1:
        raise ModelLoadError(
            f"{where} has {len(c.temperal_downsample)} temperal_downsample flags for "
            f"{len(c.dim_mult)} dim_mult levels; it needs one per level but the last."
        )
    for name in ("latents_mean", "latents_std"):
        if len(getattr(c, name)) != c.z_dim:
            raise ModelLoadError(
                f"{where} has {len(getattr(c, name))} {name} values for z_dim {c.z_dim}; "
                "it needs one per latent channel."
            )
    if any(s == 0 for s in c.latents_std):
        raise ModelLoadError(f"{where} has a zero in latents_std; every channel's must be > 0.")
    if c.patch < 1 or c.out_channels != RGB * c.patch**2:
        raise ModelLoadError(
            f"{where} has out_channels {c.out_channels} for patch_size {c.patch_size}; the "
            f"decoder gives 3 channels per pixel of each p x p patch, {RGB * c.patch**2}."
        )
    if c.in_channels != RGB * c.patch**2:
        raise ModelLoadError(
            f"{where} has in_channels {c.in_channels} for patch_size {c.patch_size}; the "
            f"encoder reads 3 channels per pixel of each p x p patch, {RGB * c.patch**2}."
        )
    return c


def num_frames(latent_frames: int, config: dict | CausalVAEConfig) -> int:
    """Video frames decoded from `latent_frames` latent frames (Wan2.1: 1 + 4 (F - 1))."""
    c = config if isinstance(config, CausalVAEConfig) else vae_config(config)
    return 1 + c.temporal_factor * (latent_frames - 1)


def latent_frames(video_frames: int, config: dict | CausalVAEConfig) -> int:
    """The latent frames that decode to `video_frames` frames; ValueError with one sentence
    when no whole number does (Wan2.1: frames must be 4k + 1)."""
    c = config if isinstance(config, CausalVAEConfig) else vae_config(config)
    k = c.temporal_factor
    if video_frames < 1 or (video_frames - 1) % k:
        raise ValueError(
            f"this VAE's videos have 1 + {k}k frames (k >= 0), so {video_frames} frames cannot be "
            f"decoded; use {1 + k * max(0, (video_frames - 1) // k)} or "
            f"{1 + k * (max(0, (video_frames - 1) // k) + 1)}."
        )
    return 1 + (video_frames - 1) // k


# ---------------------------------------------------------------------------------------------
# The modules, named as diffusers' PyTorch ones (`up_blocks_0` for `up_blocks.0`).


class CausalConv3d(nn.Module):
    """`WanCausalConv3d` over [B, T, H, W, C]: half the window of zeros on each side in space
    and kt - 1 frames in front in time, none behind. The frames in front are zeros, or, when
    the `cache` collection is mutable (a chunk of a video decoded after the ones before it),
    the last kt - 1 frames this conv saw, which it keeps there (zeros before the first)."""

    features: int
    kernel: tuple[int, int, int]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        kt, kh, kw = self.kernel
        kernel = self.param(
            "kernel", nn.initializers.lecun_normal(), (*self.kernel, x.shape[-1], self.features)
        )
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        x = x.astype(self.dtype)
        if kt > 1 and self.is_mutable_collection("cache"):
            b, _, h, w, c = x.shape
            frames = self.variable("cache", "frames", jnp.zeros, (b, kt - 1, h, w, c), x.dtype)
            x = jnp.concatenate([frames.value.astype(x.dtype), x], axis=1)
            frames.value = x[:, x.shape[1] - (kt - 1) :]
        elif kt > 1:
            x = jnp.pad(x, ((0, 0), (kt - 1, 0), (0, 0), (0, 0), (0, 0)))
        y = jax.lax.conv_general_dilated(
            x,
            kernel.astype(self.dtype),
            window_strides=(1, 1, 1),
            padding=((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)),
            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        )
        return y + bias.astype(self.dtype)


class RMSNorm(nn.Module):
    """`WanRMS_norm`: x / ||x|| over channels (in float32) * sqrt(C) * scale; no bias."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        channels = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (channels,))
        x32 = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True))
        normalized = (x32 / jnp.maximum(norm, _NORM_EPS)).astype(self.dtype)
        return normalized * math.sqrt(channels) * scale.astype(self.dtype)


class ResidualBlock(nn.Module):
    """`WanResidualBlock`: norm, SiLU, 3x3x3 causal conv, twice, plus a 1x1x1 shortcut
    when the channel count changes."""

    out_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = x
        if x.shape[-1] != self.out_dim:
            h = CausalConv3d(self.out_dim, (1, 1, 1), self.dtype, name="conv_shortcut")(x)
        x = nn.silu(RMSNorm(self.dtype, name="norm1")(x))
        x = CausalConv3d(self.out_dim, (3, 3, 3), self.dtype, name="conv1")(x)
        x = nn.silu(RMSNorm(self.dtype, name="norm2")(x))
        x = CausalConv3d(self.out_dim, (3, 3, 3), self.dtype, name="conv2")(x)
        return x + h


class AttentionBlock(nn.Module):
    """`WanAttentionBlock`: one-head self-attention over each frame's pixels (frames do not
    see each other), with 1x1 conv projections and a residual."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        b, t, h, w, c = x.shape
        frames = x.reshape(b * t, h, w, c)
        y = RMSNorm(self.dtype, name="norm")(frames)
        qkv = nn.Conv(3 * c, (1, 1), dtype=self.dtype, name="to_qkv")(y).reshape(
            b * t, h * w, 3 * c
        )
        q, k, v = jnp.split(qkv, 3, axis=-1)
        scores = jnp.einsum("nqc,nkc->nqk", q, k).astype(jnp.float32) / math.sqrt(c)
        weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        y = jnp.einsum("nqk,nkc->nqc", weights, v).reshape(b * t, h, w, c)
        y = nn.Conv(c, (1, 1), dtype=self.dtype, name="proj")(y)
        return y.reshape(b, t, h, w, c) + x


class Resample(nn.Module):
    """`WanResample` in the decoder's two modes: `upsample2d` (nearest 2x in space, then a
    3x3 conv to half the channels) and `upsample3d` (first a causal time conv to twice the
    channels whose halves become two frames, for every frame but the video's first, which
    passes alone: `first` says whether x starts the video)."""

    mode: str
    dtype: Any = jnp.float32
    out_features: int | None = None  # half the channels unless given (Wan2.2: all of them)

    @nn.compact
    def __call__(self, x, first: bool):
        b, t, h, w, c = x.shape
        out = self.out_features or c // 2
        if self.mode == "upsample3d":
            head, rest = (x[:, :1], x[:, 1:]) if first else (x[:, :0], x)
            n = rest.shape[1]  # zero for a first chunk of one frame: the conv keeps its zeros
            rest = CausalConv3d(2 * c, (3, 1, 1), self.dtype, name="time_conv")(rest)
            # channels [s*c, (s+1)*c) of frame i are output frame 2i + s
            rest = rest.reshape(b, n, h, w, 2, c)
            rest = jnp.moveaxis(rest, 4, 2).reshape(b, 2 * n, h, w, c)
            x = jnp.concatenate([head.astype(rest.dtype), rest], axis=1)
        t = x.shape[1]
        x = jnp.repeat(jnp.repeat(x, 2, axis=2), 2, axis=3)  # nearest-exact, factor 2
        x = nn.Conv(out, (3, 3), padding=((1, 1), (1, 1)), dtype=self.dtype, name="resample_1")(
            x.reshape(b * t, 2 * h, 2 * w, c)
        )
        return x.reshape(b, t, 2 * h, 2 * w, out)


class UpBlock(nn.Module):
    """`WanUpBlock`: num_res_blocks + 1 residual blocks, then the upsampler (if any)."""

    out_dim: int
    num_res_blocks: int
    upsample_mode: str | None
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, first: bool):
        for i in range(self.num_res_blocks + 1):
            x = ResidualBlock(self.out_dim, self.dtype, name=f"resnets_{i}")(x)
        if self.upsample_mode is not None:
            x = Resample(self.upsample_mode, self.dtype, name="upsamplers_0")(x, first)
        return x


def dup_shortcut(x, out_dim: int, time_factor: int, first: bool):
    """`DupUp3D`, the residual up block's shortcut: [B, T, H, W, C] -> [B, T ft, 2H, 2W,
    out_dim] without weights. Each input channel is repeated so that the repeats fill, in
    order, output channel o's ft x 2 x 2 cells (time, row, column); a chunk that starts the
    video drops its first ft - 1 frames, as the upsampler passes the first frame alone."""
    b, t, h, w, c = x.shape
    cells = time_factor * 4
    x = jnp.repeat(x, out_dim * cells // c, axis=-1)
    x = x.reshape(b, t, h, w, out_dim, time_factor, 2, 2)
    x = jnp.transpose(x, (0, 1, 5, 2, 6, 3, 7, 4))
    x = x.reshape(b, t * time_factor, 2 * h, 2 * w, out_dim)
    return x[:, time_factor - 1 :] if first else x


class ResidualUpBlock(nn.Module):
    """`WanResidualUpBlock` (Wan2.2): residual blocks, then an upsampler that keeps the
    width (if any), plus the input through `dup_shortcut`."""

    out_dim: int
    num_res_blocks: int
    upsample_mode: str | None
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, first: bool):
        shortcut = x
        for i in range(self.num_res_blocks + 1):
            x = ResidualBlock(self.out_dim, self.dtype, name=f"resnets_{i}")(x)
        if self.upsample_mode is None:
            return x
        x = Resample(self.upsample_mode, self.dtype, self.out_dim, name="upsampler")(x, first)
        time_factor = 2 if self.upsample_mode == "upsample3d" else 1
        return x + dup_shortcut(shortcut, self.out_dim, time_factor, first).astype(x.dtype)


def unpatchify(x, patch: int):
    """[B, T, H, W, 3 p^2] -> [B, T, pH, pW, 3]: channel `c p^2 + i p + j` is pixel (j, i) of
    its position's patch (row j, column i), as diffusers' `unpatchify` orders them."""
    if patch == 1:
        return x
    b, t, h, w, _ = x.shape
    x = x.reshape(b, t, h, w, RGB, patch, patch)  # (..., c, i: column, j: row)
    x = jnp.transpose(x, (0, 1, 2, 6, 3, 5, 4))
    return x.reshape(b, t, h * patch, w * patch, RGB)


class MidBlock(nn.Module):
    """`WanMidBlock` with one layer: residual, attention, residual."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        x = ResidualBlock(c, self.dtype, name="resnets_0")(x)
        x = AttentionBlock(self.dtype, name="attentions_0")(x)
        return ResidualBlock(c, self.dtype, name="resnets_1")(x)


class Decoder3d(nn.Module):
    """`WanDecoder3d`: latents [B, F, h, w, z] -> video [B, T, H, W, 3] in about [-1, 1]."""

    config: CausalVAEConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, first: bool):
        c = self.config
        mult = c.dim_mult
        dims = [c.dim * u for u in (mult[-1], *mult[::-1])]
        x = CausalConv3d(dims[0], (3, 3, 3), self.dtype, name="conv_in")(x)
        x = MidBlock(self.dtype, name="mid_block")(x)
        block = ResidualUpBlock if c.is_residual else UpBlock
        for i, out_dim in enumerate(dims[1:]):
            mode = None
            if i != len(mult) - 1:
                mode = "upsample3d" if c.temporal_upsample[i] else "upsample2d"
            x = block(out_dim, c.num_res_blocks, mode, self.dtype, name=f"up_blocks_{i}")(x, first)
        x = nn.silu(RMSNorm(self.dtype, name="norm_out")(x))
        return CausalConv3d(c.out_channels, (3, 3, 3), self.dtype, name="conv_out")(x)


class CausalVAEDecoder(nn.Module):
    """`post_quant_conv` then the decoder, on de-normalised latents [B, F, h, w, z_dim]; the
    params are {"post_quant_conv", "decoder"}, as the folder's keys are prefixed. `first`:
    whether z starts the video (False for a later chunk, decoded with the `cache` collection
    its predecessors left)."""

    config: CausalVAEConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, z, first: bool = True):
        z = CausalConv3d(self.config.z_dim, (1, 1, 1), self.dtype, name="post_quant_conv")(z)
        return unpatchify(
            Decoder3d(self.config, self.dtype, name="decoder")(z, first), self.config.patch
        )


# ---------------------------------------------------------------------------------------------
# Building, converting, loading and decoding.


def decoder_module(config: dict | CausalVAEConfig, dtype=jnp.float32) -> CausalVAEDecoder:
    """The decoder a `vae/config.json` dict (or a parsed CausalVAEConfig) describes."""
    c = config if isinstance(config, CausalVAEConfig) else vae_config(config)
    return CausalVAEDecoder(c, dtype)


def decoder_shapes(module: CausalVAEDecoder) -> dict:
    """The decoder's params as ShapeDtypeStructs (nothing is computed)."""
    c = module.config
    z = jnp.zeros((1, 2, 1, 1, c.z_dim), module.dtype)  # two frames: upsample3d's time conv
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), z)["params"])


def vae_state(state: dict[str, np.ndarray], prefixes: tuple[str, ...], shapes, skip=()):
    """The keys of `state` under `prefixes` (but those holding a `skip` part) as Flax params
    of `shapes`; the RMS norms' broadcast-shaped gammas flattened."""
    kept = {}
    for key, value in state.items():
        if not key.startswith(prefixes) or any(part in key for part in skip):
            continue
        value = np.asarray(value)
        if key.endswith(".gamma"):  # [C, 1, 1(, 1)] broadcast shapes -> [C]
            value = value.reshape(-1)
        kept[key] = value
    return convert.pytorch_to_flax(kept, convert.shapes_of(shapes))


def convert_decoder(state: dict[str, np.ndarray], config: dict | CausalVAEConfig) -> dict:
    """diffusers `AutoencoderKLWan` or `AutoencoderKLQwenImage` weights -> the decoder's Flax
    params (numpy, their dtype). Encoder and `quant_conv` keys are ignored; a missing, extra
    or mis-shaped decoder weight is a ParamTreeMismatch naming it."""
    return vae_state(state, _PREFIXES, decoder_shapes(decoder_module(config)))


def load_decoder(folder: Path, dtype, hint: str):
    """`(module, params, CausalVAEConfig)` of a diffusers `vae/` folder, without torch; one
    sentence (ModelLoadError ending in `hint`) for a folder that does not fit."""
    folder = Path(folder)
    where = folder / "config.json"
    raw = files.read_json(where, hint)
    if raw.get("_class_name", CLASS_NAMES[0]) not in CLASS_NAMES:
        raise ModelLoadError(
            f"{where} describes {raw['_class_name']}, not a causal video VAE "
            f"({' or '.join(CLASS_NAMES)}); {hint}."
        )
    config = vae_config(raw, where)
    state = files.read_weights(folder, "diffusion_pytorch_model", hint)
    with convert.weights_of(folder, hint):
        params = convert_decoder(state, config)
    module = decoder_module(config, dtype)
    return module, cast_floats(params, dtype), config


def decode_chunks(module: CausalVAEDecoder, params, z):
    """The decoder on z [B, F, h, w, z_dim] one latent frame at a time, as diffusers decodes:
    the first frame alone, then a scan over the others carrying every causal conv's last
    frames (the `cache` collection). The same numbers as one call on all F frames, with the
    activations of one latent frame's video frames alive instead of the whole video's."""
    video, state = module.apply({"params": params}, z[:, :1], first=True, mutable=["cache"])
    if z.shape[1] == 1:
        return video

    def step(cache, zt):
        out, state = module.apply(
            {"params": params, "cache": cache}, zt[:, None], first=False, mutable=["cache"]
        )
        return state["cache"], out

    _, rest = jax.lax.scan(step, state["cache"], jnp.moveaxis(z[:, 1:], 1, 0))
    rest = jnp.moveaxis(rest, 0, 1)  # [B, F - 1, frames per latent, H, W, 3]
    return jnp.concatenate([video, rest.reshape(rest.shape[0], -1, *rest.shape[3:])], axis=1)


def decode_fn(
    module: CausalVAEDecoder,
    config: dict | CausalVAEConfig,
    dtype,
    batch_size: int = 1,
    chunked: bool = True,
):
    """`decode(params, latents [B, F, h, w, z_dim]) -> videos [B, T, H, W, 3]` in [0, 1],
    jitted, T = `num_frames(F)`; `batch_size` videos go through the decoder at once, each
    one latent frame at a time (`decode_chunks`) or, without `chunked`, all frames at once
    (fewer, larger programs; activation memory grows with the frames: for Wan2.1's 81 frames
    at 480x832 in bfloat16, XLA's CPU plan holds 5 GiB of temporaries chunked, 64 GiB not)."""
    c = config if isinstance(config, CausalVAEConfig) else vae_config(config)
    mean = jnp.asarray(c.latents_mean, jnp.float32)
    inv_std = 1.0 / jnp.asarray(c.latents_std, jnp.float32)  # as the pipeline writes it

    def decode_one(params, z):  # [F, h, w, z] -> [T, H, W, 3] in [-1, 1]
        z = z[None].astype(dtype)
        if chunked:
            return decode_chunks(module, params, z)[0]
        return module.apply({"params": params}, z)[0]

    @jax.jit
    def decode(params, latents):
        if latents.ndim != 5 or latents.shape[-1] != c.z_dim:
            raise ValueError(
                f"the VAE's latents are [B, F, h, w, {c.z_dim}], channels last; got "
                f"{latents.shape}."
            )
        z = latents.astype(jnp.float32) / inv_std + mean
        videos = jax.lax.map(lambda zi: decode_one(params, zi), z, batch_size=batch_size)
        videos = jnp.clip(videos.astype(jnp.float32), -1.0, 1.0)
        return videos / 2.0 + 0.5

    return decode
