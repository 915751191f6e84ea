"""Stable Diffusion 3 / 3.5's MMDiT in Flax, computing what diffusers' PyTorch
`SD3Transformer2DModel` computes.

The image and text tokens keep separate weights (AdaLN-zero modulation, projections,
feed-forwards) but attend jointly, image tokens first. SD3.5's MMDiT-X blocks (the layers in
`dual_attention_layers`) add a second self-attention over the image tokens alone, modulated
by three more AdaLN chunks; SD3.5 also RMS-normalises every query and key (`qk_norm`).

Module and attribute names are diffusers' PyTorch names with list indices merged
(`transformer_blocks_0/attn/to_out_0`, `.../ff/net_0/proj`), so `convert.pytorch_to_flax`
maps a diffusers `transformer/` safetensors file onto these params with no table, and
`convert.flax_to_pytorch` gives the file's keys back. The one tensor of that file that is
not a parameter, the sincos position table (`BUFFERS`), is recomputed here from the config.

Against the PyTorch model in float32 on CPU (tests/parity/test_sd3_transformer.py: random tiny
SD3 and SD3.5-style models, outputs of scale ~2) the largest difference is 7.2e-7, at JAX's
default matmul precision; bfloat16 compute is within 1% of float32.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.dit_layers import (
    MAX_PERIOD,
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    Attention,
    Block,
    CombinedTimestepTextProjEmbeddings,
    DiT,
    FeedForward,
    RMSNorm,
    gated_feed_forward,
    module_from_config,
    run_stack,
)

# PyTorch state-dict keys that are fixed buffers, not parameters: drop them when loading.
BUFFERS = ("pos_embed.pos_embed",)
QK_NORMS = (None, "rms_norm")


def sincos_position_axes(
    embed_dim: int, grid_size: int, base_size: int, rows: slice, columns: slice
) -> tuple[np.ndarray, np.ndarray]:
    """The two halves of diffusers' `PatchEmbed` sincos table for a crop of its grid:
    ([rows, embed_dim / 2] for the rows, [columns, embed_dim / 2] for the columns), float32.

    A table entry is (column half, row half) concatenated; each half depends on one
    coordinate only, so the crop is built from these without the full table (float64 sincos
    of positions `index / (grid_size / base_size)`, rounded to float32 as diffusers does)."""
    if embed_dim % 4:
        raise ValueError(f"The model width {embed_dim} is not a multiple of 4.")
    coords = np.arange(grid_size, dtype=np.float32) / np.float32(grid_size / base_size)
    half = embed_dim // 2
    return _sincos_1d(half, coords[rows]), _sincos_1d(half, coords[columns])


def sincos_position_table(embed_dim: int, grid_size: int, base_size: int) -> np.ndarray:
    """The whole [grid_size**2, embed_dim] table, row-major over (row, column): the buffer
    diffusers stores as `pos_embed.pos_embed` (without its leading 1)."""
    everything = slice(None)
    row_half, column_half = sincos_position_axes(
        embed_dim, grid_size, base_size, everything, everything
    )
    return _join_axes(np, row_half, column_half)


def _join_axes(xnp, row_half, column_half):
    rows, columns, half = row_half.shape[0], column_half.shape[0], row_half.shape[1]
    grid = (rows, columns, half)
    table = xnp.concatenate(
        [
            xnp.broadcast_to(column_half[None, :, :], grid),
            xnp.broadcast_to(row_half[:, None, :], grid),
        ],
        axis=-1,
    )
    return table.reshape(rows * columns, 2 * half)


def _sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    omega = 1.0 / MAX_PERIOD ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    angles = np.outer(positions.astype(np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


class JointAttention(Attention):
    """Multi-head attention over the image tokens, joined by the text tokens when
    `with_context` (their own projections `add_*_proj`, concatenated after the image tokens,
    one softmax over both). Returns (image output, text output); the text output is None
    without context, and the raw attended text tokens without `context_output`
    (`to_add_out`, absent in the last block, whose text stream is not used again)."""

    qk_norm: bool = False
    with_context: bool = False
    context_output: bool = False

    def setup(self):
        dim = self.width
        self.to_q, self.to_k, self.to_v = self.dense(dim), self.dense(dim), self.dense(dim)
        self.to_out_0 = self.dense(dim)
        if self.qk_norm:
            self.norm_q, self.norm_k = RMSNorm(**self.dtypes), RMSNorm(**self.dtypes)
        if self.with_context:
            self.add_q_proj = self.dense(dim)
            self.add_k_proj = self.dense(dim)
            self.add_v_proj = self.dense(dim)
            if self.qk_norm:
                self.norm_added_q = RMSNorm(**self.dtypes)
                self.norm_added_k = RMSNorm(**self.dtypes)
            if self.context_output:
                self.to_add_out = self.dense(dim)

    def __call__(self, hidden_states, context=None):
        query = self._heads(self.to_q(hidden_states))
        key = self._heads(self.to_k(hidden_states))
        value = self._heads(self.to_v(hidden_states))
        if self.qk_norm:
            query, key = self.norm_q(query), self.norm_k(key)
        if self.with_context:
            context_query = self._heads(self.add_q_proj(context))
            context_key = self._heads(self.add_k_proj(context))
            context_value = self._heads(self.add_v_proj(context))
            if self.qk_norm:
                context_query = self.norm_added_q(context_query)
                context_key = self.norm_added_k(context_key)
            query = jnp.concatenate([query, context_query], axis=1)
            key = jnp.concatenate([key, context_key], axis=1)
            value = jnp.concatenate([value, context_value], axis=1)
        attended = self._attend(query, key, value)
        image_tokens = hidden_states.shape[1]
        image_out = self.to_out_0(attended[:, :image_tokens])
        if not self.with_context:
            return image_out, None
        context_out = attended[:, image_tokens:]
        if self.context_output:
            context_out = self.to_add_out(context_out)
        return image_out, context_out


class JointTransformerBlock(Block):
    """One MMDiT block: joint attention of the image and text streams, then a feed-forward
    per stream, each gated by AdaLN-zero. With `context_pre_only` (the last block) the text
    stream only feeds the attention and None is returned in its place."""

    context_pre_only: bool = False
    qk_norm: bool = False
    dual_attention: bool = False

    def setup(self):
        attention = dict(qk_norm=self.qk_norm, **self.attention_arguments)
        self.norm1 = AdaLayerNormZero(dual=self.dual_attention, dtype=self.dtype)
        if self.context_pre_only:
            self.norm1_context = AdaLayerNormContinuous(dtype=self.dtype)
        else:
            self.norm1_context = AdaLayerNormZero(dtype=self.dtype)
        self.attn = JointAttention(
            with_context=True, context_output=not self.context_pre_only, **attention
        )
        if self.dual_attention:
            self.attn2 = JointAttention(**attention)
        self.ff = FeedForward(dim=self.dim, dtype=self.dtype)
        if not self.context_pre_only:
            self.ff_context = FeedForward(dim=self.dim, dtype=self.dtype)

    def __call__(self, hidden_states, context, temb):
        if self.dual_attention:
            normed, gate, shift_mlp, scale_mlp, gate_mlp, normed2, gate2 = self.norm1(
                hidden_states, temb
            )
        else:
            normed, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, temb)
        if self.context_pre_only:
            context_normed = self.norm1_context(context, temb)
        else:
            context_normed, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
                context, temb
            )

        attn_out, context_attn_out = self.attn(normed, context_normed)
        hidden_states = hidden_states + gate[:, None] * attn_out
        if self.dual_attention:
            attn2_out, _ = self.attn2(normed2)
            hidden_states = hidden_states + gate2[:, None] * attn2_out
        hidden_states = gated_feed_forward(hidden_states, self.ff, shift_mlp, scale_mlp, gate_mlp)

        if self.context_pre_only:
            return hidden_states, None
        context = context + c_gate[:, None] * context_attn_out
        context = gated_feed_forward(context, self.ff_context, c_shift_mlp, c_scale_mlp, c_gate_mlp)
        return hidden_states, context


class PatchEmbed(nn.Module):
    """Non-overlapping patch conv (NHWC) plus the sincos position table's centre crop."""

    patch_size: int
    dim: int
    pos_embed_max_size: int
    base_size: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        patch = (self.patch_size, self.patch_size)
        self.proj = nn.Conv(self.dim, patch, strides=patch, padding="VALID", dtype=self.dtype)

    def cropped_table(self, rows: int, columns: int) -> jax.Array:
        """The [rows * columns, dim] centre of the [max, max] table (diffusers'
        `cropped_pos_embed`)."""
        size = self.pos_embed_max_size
        if rows > size or columns > size:
            raise ValueError(
                f"A {rows}x{columns} patch grid exceeds pos_embed_max_size {size}; "
                "the latents are too large for this model."
            )
        top, left = (size - rows) // 2, (size - columns) // 2
        row_half, column_half = sincos_position_axes(
            self.dim, size, self.base_size, slice(top, top + rows), slice(left, left + columns)
        )
        return _join_axes(jnp, jnp.asarray(row_half), jnp.asarray(column_half))

    def __call__(self, latents_nhwc):
        patches = self.proj(latents_nhwc)
        batch, rows, columns, dim = patches.shape
        tokens = patches.reshape(batch, rows * columns, dim)
        return (tokens + self.cropped_table(rows, columns)).astype(tokens.dtype)


class SD3Transformer(DiT):
    """SD3 / SD3.5's MMDiT: `(hidden_states [B, C, H, W], encoder_hidden_states [B, T,
    joint_attention_dim], pooled_projections [B, pooled_projection_dim], timestep [B] in
    0..1000) -> [B, out_channels, H, W]`, in the compute `dtype` (params stay float32).

    The fields are diffusers' `transformer/config.json` fields; `attention` names
    the `models.attention` backend (model.attention).
    """

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    out_channels: int | None = 16
    pos_embed_max_size: int | None = 96
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None

    @property
    def output_channels(self) -> int:
        return self.in_channels if self.out_channels is None else self.out_channels

    def check(self) -> None:
        """Raises a one-sentence ValueError for field values this module does not implement."""
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r} is not supported (only {QK_NORMS}).")
        if self.pos_embed_max_size is None:
            raise ValueError(
                "pos_embed_max_size None (no position-table cropping) is not supported."
            )
        if self.caption_projection_dim != self.inner_dim:
            raise ValueError(
                f"caption_projection_dim {self.caption_projection_dim} differs from the model "
                f"width num_attention_heads * attention_head_dim = {self.inner_dim}."
            )
        self.check_dtype()
        self.check_runtime()

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def init_weights(self, rng: jax.Array):
        """Random params, from the smallest input (one patch, one text token)."""
        size = self.patch_size
        latents = jnp.zeros((1, self.in_channels, size, size), jnp.float32)
        text = jnp.zeros((1, 1, self.joint_attention_dim), jnp.float32)
        pooled = jnp.zeros((1, self.pooled_projection_dim), jnp.float32)
        return self.init(rng, latents, text, pooled, jnp.zeros((1,), jnp.float32))["params"]

    def setup(self):
        self.check()
        dim = self.inner_dim
        self.pos_embed = PatchEmbed(
            patch_size=self.patch_size,
            dim=dim,
            pos_embed_max_size=self.pos_embed_max_size,
            base_size=self.sample_size // self.patch_size,
            dtype=self.dtype,
        )
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(dim=dim, dtype=self.dtype)
        self.context_embedder = nn.Dense(self.caption_projection_dim, dtype=self.dtype)
        shared = dict(
            dim=dim,
            heads=self.num_attention_heads,
            head_dim=self.attention_head_dim,
            qk_norm=self.qk_norm is not None,
            dtype=self.dtype,
            attention=self.attention,
        )
        # The last block (context_pre_only) and SD3.5's MMDiT-X blocks differ from the rest.
        layers = [
            dict(
                context_pre_only=i == self.num_layers - 1,
                dual_attention=i in self.dual_attention_layers,
            )
            for i in range(self.num_layers)
        ]
        self.transformer_blocks = self.block_stack(JointTransformerBlock, layers, shared, 1)
        self.norm_out = AdaLayerNormContinuous(dtype=self.dtype)
        self.proj_out = nn.Dense(self.patch_size**2 * self.output_channels, dtype=self.dtype)

    def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
        chex.assert_rank([hidden_states, encoder_hidden_states, pooled_projections], [4, 3, 2])
        chex.assert_axis_dimension(hidden_states, 1, self.in_channels)
        self.check_conditioning(hidden_states, encoder_hidden_states, pooled_projections)
        batch, _, height, width = hidden_states.shape
        patch = self.patch_size
        if height % patch or width % patch:
            raise ValueError(f"Latents {height}x{width} are not a multiple of the patch {patch}.")
        timestep = jnp.broadcast_to(jnp.asarray(timestep, jnp.float32).reshape(-1), (batch,))

        tokens = self.pos_embed(jnp.transpose(hidden_states, (0, 2, 3, 1)))
        temb = self.time_text_embed(timestep, pooled_projections)
        context = self.context_embedder(encoder_hidden_states)
        tokens, _ = run_stack(self.transformer_blocks, (tokens, context), temb)
        tokens = self.proj_out(self.norm_out(tokens, temb))

        rows, columns, channels = height // patch, width // patch, self.output_channels
        tokens = tokens.reshape(batch, rows, columns, patch, patch, channels)
        return jnp.einsum("nhwpqc->nchpwq", tokens).reshape(batch, channels, height, width)


def transformer_module(config: dict, dtype=jnp.float32, **options) -> SD3Transformer:
    """The MMDiT of a diffusers `transformer/config.json` dict; keys starting with `_` are
    metadata and ignored, `options` set the non-config fields (`attention`,
    `remat`, `scan_layers`).
    Raises a one-sentence ValueError for keys or values this module does not implement."""
    layers = {"dual_attention_layers": lambda layers: tuple(layers or ())}
    return module_from_config(SD3Transformer, config, dtype, options, layers)
