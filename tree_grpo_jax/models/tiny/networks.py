"""The tiny model's networks: Stable Diffusion's parts at 8x8 pixels.

A two-layer CLIP text encoder (`models.clip.CLIPTextModel`) over the word tokenizer, a
conditional UNet with cross-attention (`models.unet.UNet2DConditionModel`) on 8x8x1 pixel
space, and no VAE: `decode` maps [-1, 1] to [0, 1]. The UNet runs with diffusers' Flax UNet
numerics (`unet.FLAX_NUMERICS`: tanh-approximate GELU, transformer GroupNorm eps 1e-5): the
shipped weights were trained with them.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import clip, unet
from tree_grpo_jax.models.tiny import tokenizer

SAMPLE_SHAPE = (1, 8, 8)  # channels first, as the denoiser sees it

UNET_CONFIG = dict(
    sample_size=8,
    in_channels=1,
    out_channels=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 64),  # GroupNorm uses 32 groups: multiples of 32
    layers_per_block=1,
    attention_head_dim=4,  # SD1.x's name for the number of heads
    cross_attention_dim=32,
)
TEXT_CONFIG = dict(
    vocab_size=len(tokenizer.VOCAB),
    hidden_size=32,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=tokenizer.MAX_LENGTH,
    projection_dim=32,
    pad_token_id=tokenizer.PAD_ID,
    bos_token_id=tokenizer.BOS_ID,
    eos_token_id=tokenizer.EOS_ID,
)


@functools.cache
def make_unet(dtype=jnp.float32) -> unet.UNet2DConditionModel:
    return unet.unet_module(UNET_CONFIG, dtype, **unet.FLAX_NUMERICS)


@functools.cache
def make_text_encoder(dtype=jnp.float32) -> clip.CLIPTextModel:
    return clip.CLIPTextModel(clip.TextConfig(**TEXT_CONFIG), dtype=dtype)


def init_weights(key: jax.Array) -> dict:
    """Random weights `{"unet": ..., "text_encoder": ...}` (float32)."""
    unet_key, text_key = jax.random.split(key)
    hidden = TEXT_CONFIG["hidden_size"]
    unet_params = make_unet().init(
        unet_key,
        jnp.zeros((1, *SAMPLE_SHAPE)),
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1, tokenizer.MAX_LENGTH, hidden)),
    )["params"]
    text_params = clip.init_text(make_text_encoder(), text_key, tokenizer.MAX_LENGTH)
    return {"unet": unet_params, "text_encoder": text_params}


def random_weights(seed: int) -> dict:
    """Random weights drawn in numpy from the architecture's shapes: fan-in scaled normal
    kernels, small normal embeddings, unit scales, zero biases.

    The networks' own `init` traces and compiles the whole UNet forward (~15 s on two CPU
    cores); this gives a usable random model in well under a second.
    """
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(init_weights, jax.random.key(0))

    def draw(path, leaf):
        name = path[-1].key
        if name == "kernel":
            fan_in = int(np.prod(leaf.shape[:-1]))
            return (rng.standard_normal(leaf.shape) / np.sqrt(fan_in)).astype(np.float32)
        if name == "embedding":
            return (0.02 * rng.standard_normal(leaf.shape)).astype(np.float32)
        fill = 1.0 if name == "scale" else 0.0
        return np.full(leaf.shape, fill, np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def encode_tokens(text_params, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Token ids `[P, L]` -> the encoder's last hidden states `[P, L, D]`, as SD conditions."""
    encoder = make_text_encoder(jax.tree.leaves(text_params)[0].dtype)
    out = encoder.apply({"params": text_params}, input_ids, attention_mask.astype("i4"))
    return out.last_hidden_state


@functools.cache
def denoise_fn(dtype):
    """One function object per dtype, so jitted callers that take it as static compile once."""
    module = make_unet(dtype)

    def denoise(params, x, t, cond):
        chex.assert_rank(x, 4)
        chex.assert_shape(t, (x.shape[0],))
        chex.assert_rank(cond, 3)
        return module.apply({"params": params}, x.astype(dtype), t, cond.astype(dtype)).sample

    return denoise


@jax.jit  # one program per batch size, not one per operation
def decode(x: jax.Array) -> jax.Array:
    """Pixel space [-1, 1], channels first -> images `[B, 8, 8, 1]` in [0, 1]."""
    chex.assert_rank(x, 4)
    images = jnp.clip((x.astype(jnp.float32) + 1.0) / 2.0, 0.0, 1.0)
    return jnp.transpose(images, (0, 2, 3, 1))
