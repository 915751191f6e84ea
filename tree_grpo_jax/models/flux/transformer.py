"""The FLUX.1 transformer in Flax, computing what diffusers' PyTorch `FluxTransformer2DModel`
computes.

FLUX works on 16-channel latents packed into 2x2 patches outside the network
(`patches.pack_latents`: [B, 16, H, W] -> [B, H/2 * W/2, 64] tokens). The text tokens (T5)
come first, then the image tokens. `num_layers` double-stream blocks keep separate weights
per stream (AdaLN-zero, projections, feed-forwards) around one joint attention;
`num_single_layers` single-stream blocks then run both streams as one sequence, attention
and MLP in parallel. Every query and key is RMS-normalised per head and rotated by a 3-axis
RoPE of the token's position ids (`image_ids`: (0, row, column); text ids are zeros). The
conditioning vector is the embedded timestep (sigma * 1000), the embedded guidance scale
for FLUX.1-dev (`guidance_embeds`; FLUX.1-schnell has none) and the projected pooled CLIP
embedding.

Module and attribute names are diffusers' PyTorch names with list indices merged
(`single_transformer_blocks_3/attn/norm_q`, `transformer_blocks_0/ff/net_0/proj`), so
`convert.pytorch_to_flax` maps a diffusers `transformer/` safetensors file onto these params
with no table, and `convert.flax_to_pytorch(params, list_names=MODULE_LISTS)` gives the
file's keys back. The file has no buffers.

Activations run in `dtype` (float32 or bfloat16) with float32 `param_dtype`; norms, RoPE and
the timestep features are computed in float32 and rounded to `dtype`. The RoPE angles are
float32 here where diffusers takes them in float64: their cosines and sines differ by at most
2.2e-6 over a 1024-pixel image's ids (positions up to 63). Against the PyTorch model in
float32 on CPU (tests/parity/test_flux_transformer.py: tiny random FLUX.1-dev and -schnell style
models, outputs of scale ~2.4) the largest difference is 2.2e-6 (9.2e-7 of the scale), at
JAX's default matmul precision; bfloat16 compute is within 1% of float32.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import dit_layers
from tree_grpo_jax.models.dit_layers import (
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    Attention,
    Block,
    CombinedTimestepTextProjEmbeddings,
    DiT,
    FeedForward,
    RMSNorm,
    check_rope_axes,
    gated_feed_forward,
    module_from_config,
    rotate_pairs,
    run_stack,
)
from tree_grpo_jax.models.patches import LATENT_PATCH, check_even

ROPE_THETA = 10000.0
MLP_RATIO = 4
ID_AXES = 3  # (offset, row, column): FLUX.1's position ids
TIMESTEP_SCALE = 1000.0  # diffusers' forward multiplies sigma (and guidance) by this
# Module lists of this model, for `convert.flax_to_pytorch(params, list_names=MODULE_LISTS)`.
MODULE_LISTS = frozenset({"transformer_blocks", "single_transformer_blocks", "to_out", "net"})


def image_ids(height: int, width: int) -> np.ndarray:
    """[(H/2)(W/2), 3] float32 position ids of the packed tokens of H x W latents, in
    `pack_latents`' order: (0, patch row, patch column), as diffusers' FluxPipeline builds
    them (`_prepare_latent_image_ids(batch, H // 2, W // 2, ...)`)."""
    check_even(height, width)
    rows, columns = np.meshgrid(
        np.arange(height // LATENT_PATCH), np.arange(width // LATENT_PATCH), indexing="ij"
    )
    ids = np.stack([np.zeros_like(rows), rows, columns], axis=-1)
    return ids.reshape(-1, ID_AXES).astype(np.float32)


def text_ids(num_tokens: int) -> np.ndarray:
    """[T, 3] float32 zeros: FLUX.1's text tokens all sit at position 0."""
    return np.zeros((num_tokens, ID_AXES), np.float32)


def rope_frequencies(axes_dims: tuple[int, ...], theta: float = ROPE_THETA) -> list[np.ndarray]:
    """Per id axis, the [d / 2] float32 rotation frequencies theta^(-2i / d) (float64, as
    diffusers' `FluxPosEmbed` takes them, then rounded)."""
    return dit_layers.rope_frequencies(axes_dims, theta)


def rope_tables(ids: jax.Array, axes_dims: tuple[int, ...], theta: float = ROPE_THETA):
    """ids [S, axes] -> (cos, sin), each [S, head_dim / 2] float32: the angle of the i-th
    (even, odd) channel pair of a head; axis a owns `axes_dims[a] / 2` consecutive pairs."""
    chex.assert_rank(ids, 2)
    chex.assert_axis_dimension(ids, 1, len(axes_dims))
    positions = jnp.asarray(ids, jnp.float32)
    angles = jnp.concatenate(
        [
            positions[:, axis, None] * jnp.asarray(freqs)[None, :]
            for axis, freqs in enumerate(rope_frequencies(axes_dims, theta))
        ],
        axis=-1,
    )
    return jnp.cos(angles), jnp.sin(angles)


class FluxAttention(Attention):
    """Multi-head attention with RMS qk-norm and RoPE. `joint` (double-stream blocks): the
    text tokens have their own projections (`add_*_proj`, `norm_added_*`), go first in the
    one softmax, and both streams have an output projection; returns (image out, text out).
    Otherwise (single-stream blocks) the input is the joined sequence and the attended
    values are returned unprojected."""

    joint: bool = False

    def setup(self):
        dim = self.width
        norm = functools.partial(RMSNorm, **self.dtypes)
        self.to_q, self.to_k, self.to_v = self.dense(dim), self.dense(dim), self.dense(dim)
        self.norm_q, self.norm_k = norm(), norm()
        if self.joint:
            self.to_out_0 = self.dense(dim)
            self.add_q_proj = self.dense(dim)
            self.add_k_proj = self.dense(dim)
            self.add_v_proj = self.dense(dim)
            self.norm_added_q, self.norm_added_k = norm(), norm()
            self.to_add_out = self.dense(dim)

    def __call__(self, hidden_states, rope, context=None):
        query = self.norm_q(self._heads(self.to_q(hidden_states)))
        key = self.norm_k(self._heads(self.to_k(hidden_states)))
        value = self._heads(self.to_v(hidden_states))
        if self.joint:
            query = jnp.concatenate(
                [self.norm_added_q(self._heads(self.add_q_proj(context))), query], axis=1
            )
            key = jnp.concatenate(
                [self.norm_added_k(self._heads(self.add_k_proj(context))), key], axis=1
            )
            value = jnp.concatenate([self._heads(self.add_v_proj(context)), value], axis=1)
        attended = self._attend(rotate_pairs(query, *rope), rotate_pairs(key, *rope), value)
        if not self.joint:
            return attended
        text_tokens = context.shape[1]
        return self.to_out_0(attended[:, text_tokens:]), self.to_add_out(attended[:, :text_tokens])


class FluxTransformerBlock(Block):
    """A double-stream block: joint attention of the image and text streams, then a
    feed-forward per stream, each residual gated by AdaLN-zero. Returns (image, text)."""

    def setup(self):
        self.norm1 = AdaLayerNormZero(**self.dtypes)
        self.norm1_context = AdaLayerNormZero(**self.dtypes)
        self.attn = FluxAttention(joint=True, **self.attention_arguments)
        self.ff = FeedForward(dim=self.dim, **self.dtypes)
        self.ff_context = FeedForward(dim=self.dim, **self.dtypes)

    def __call__(self, hidden_states, context, temb, rope):
        normed, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, temb)
        c_normed, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(context, temb)
        attn_out, context_attn_out = self.attn(normed, rope, c_normed)

        hidden_states = hidden_states + gate[:, None] * attn_out
        hidden_states = gated_feed_forward(hidden_states, self.ff, shift_mlp, scale_mlp, gate_mlp)
        context = context + c_gate[:, None] * context_attn_out
        context = gated_feed_forward(context, self.ff_context, c_shift_mlp, c_scale_mlp, c_gate_mlp)
        return hidden_states, context


class FluxSingleTransformerBlock(Block):
    """A single-stream block over the joined [text, image] sequence: attention and a GELU-tanh
    MLP read the same AdaLN-modulated input; `proj_out` mixes both into one gated residual."""

    def setup(self):
        self.norm = AdaLayerNormZero(chunks=3, **self.dtypes)
        self.proj_mlp = self.dense(self.dim * MLP_RATIO)
        self.proj_out = self.dense(self.dim)
        self.attn = FluxAttention(**self.attention_arguments)

    def __call__(self, tokens, temb, rope):
        normed, gate = self.norm(tokens, temb)
        mlp = nn.gelu(self.proj_mlp(normed), approximate=True)
        mixed = self.proj_out(jnp.concatenate([self.attn(normed, rope), mlp], axis=-1))
        return tokens + gate[:, None] * mixed


class FluxTransformer(DiT):
    """FLUX.1's transformer: `(hidden_states [B, N_img, in_channels], encoder_hidden_states
    [B, N_txt, joint_attention_dim], pooled_projections [B, pooled_projection_dim], timestep
    [B] (sigma in [0, 1]), img_ids [N_img, 3], txt_ids [N_txt, 3], guidance [B] or None) ->
    [B, N_img, out_channels]`, diffusers' forward arguments, in the compute `dtype`.

    `guidance` (the distilled guidance scale, e.g. 3.5) is required with `guidance_embeds`
    (FLUX.1-dev) and refused without it (FLUX.1-schnell). Timestep and guidance are scaled by
    1000 in float32. The fields are diffusers' `transformer/config.json` fields;
    `attention` names the `models.attention` backend (model.attention).
    """

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    param_dtype: jnp.dtype = jnp.float32

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels

    def check(self) -> None:
        """Raises a one-sentence ValueError for field values this module does not implement."""
        if self.patch_size != 1:
            raise ValueError(
                f"patch_size {self.patch_size} is not supported (FLUX.1 packs 2x2 latent "
                "patches before the transformer and has patch_size 1)."
            )
        check_rope_axes(self.axes_dims_rope, self.attention_head_dim, ID_AXES)
        self.check_dtype()
        self.check_runtime()

    def example_inputs(self) -> tuple:
        """One image token, one text token, batch 1: enough to trace the params' shapes."""
        return (
            jnp.zeros((1, 1, self.in_channels), jnp.float32),
            jnp.zeros((1, 1, self.joint_attention_dim), jnp.float32),
            jnp.zeros((1, self.pooled_projection_dim), jnp.float32),
            jnp.zeros((1,), jnp.float32),
            jnp.zeros((1, ID_AXES), jnp.float32),
            jnp.zeros((1, ID_AXES), jnp.float32),
            jnp.ones((1,), jnp.float32) if self.guidance_embeds else None,
        )

    def setup(self):
        self.check()
        dim = self.inner_dim
        layer = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        dense = functools.partial(nn.Dense, **layer)
        block = dict(
            dim=dim,
            heads=self.num_attention_heads,
            head_dim=self.attention_head_dim,
            attention=self.attention,
            **layer,
        )
        self.x_embedder = dense(dim)
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(
            dim=dim, guidance=self.guidance_embeds, **layer
        )
        self.context_embedder = dense(dim)
        self.transformer_blocks = self.block_stack(
            FluxTransformerBlock, [{}] * self.num_layers, block, 2
        )
        self.single_transformer_blocks = self.block_stack(
            FluxSingleTransformerBlock, [{}] * self.num_single_layers, block, 2
        )
        self.norm_out = AdaLayerNormContinuous(**layer)
        self.proj_out = dense(self.patch_size**2 * self.output_channels)

    def __call__(
        self,
        hidden_states,
        encoder_hidden_states,
        pooled_projections,
        timestep,
        img_ids,
        txt_ids,
        guidance=None,
    ):
        chex.assert_rank(
            [hidden_states, encoder_hidden_states, pooled_projections, img_ids, txt_ids],
            [3, 3, 2, 2, 2],
        )
        chex.assert_axis_dimension(hidden_states, 2, self.in_channels)
        self.check_conditioning(hidden_states, encoder_hidden_states, pooled_projections)
        chex.assert_shape(img_ids, (hidden_states.shape[1], ID_AXES))
        chex.assert_shape(txt_ids, (encoder_hidden_states.shape[1], ID_AXES))
        if self.guidance_embeds and guidance is None:
            raise ValueError("This model embeds a guidance scale (guidance_embeds), pass one.")
        if not self.guidance_embeds and guidance is not None:
            raise ValueError("This model has no guidance embedding, so guidance must be None.")
        batch, text_tokens = hidden_states.shape[0], encoder_hidden_states.shape[1]

        temb = self.time_text_embed(
            _scaled(timestep, batch),
            pooled_projections,
            None if guidance is None else _scaled(guidance, batch),
        )
        rope = rope_tables(jnp.concatenate([txt_ids, img_ids], axis=0), self.axes_dims_rope)
        tokens = self.x_embedder(hidden_states)
        context = self.context_embedder(encoder_hidden_states)
        tokens, context = run_stack(self.transformer_blocks, (tokens, context), temb, rope)
        # The single-stream blocks see one sequence, text first, as the attention orders it.
        joined = jnp.concatenate([context, tokens], axis=1)
        (joined,) = run_stack(self.single_transformer_blocks, (joined,), temb, rope)
        return self.proj_out(self.norm_out(joined[:, text_tokens:], temb))


def _scaled(values, batch: int) -> jax.Array:
    """[B] (or a scalar) in [0, 1] -> [B] float32 x1000, as diffusers' forward scales them."""
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    return jnp.broadcast_to(values, (batch,)) * TIMESTEP_SCALE


def transformer_module(config: dict, dtype=jnp.float32, **options) -> FluxTransformer:
    """The FLUX transformer of a diffusers `transformer/config.json` dict; keys starting with
    `_` are metadata and ignored, `options` set the non-config fields (`param_dtype`,
    `attention`, `remat`, `scan_layers`). Raises a one-sentence
    ValueError for keys or values this module does not implement."""
    axes = {"axes_dims_rope": tuple}
    return module_from_config(FluxTransformer, config, dtype, options, axes)
