"""The Qwen-Image transformer in Flax, computing what diffusers' PyTorch
`QwenImageTransformer2DModel` computes.

Qwen-Image works on 16-channel latents packed into 2x2 patches outside the network
(`patches.pack_latents`: [B, 16, H, W] -> [B, H/2 * W/2, 64] tokens; the VAE's single
frame axis is left to the caller). The text tokens are Qwen2.5-VL hidden states, RMS-normalised
(`txt_norm`) then projected (`txt_in`); padding tokens are masked out of every attention
(`encoder_hidden_states_mask`). `num_layers` dual-stream blocks keep separate weights per
stream (modulation, projections, feed-forwards) around one joint attention over [text, image];
there are no single-stream blocks. Every query and key is RMS-normalised per head and rotated by
a 3-axis RoPE: an image token at (frame, row, column) with rows and columns centred on the
image (`image_ids`: a grid of R rows takes rows -(R - R//2) .. R//2 - 1), a text token at
(p, p, p) where p counts on from the image's largest row or column index (max(R//2, C//2), as
diffusers' `QwenEmbedRope` with `scale_rope`). The conditioning vector is the embedded
timestep alone (the pipeline's sigma in [0, 1], times 1000 inside the sinusoidal features).

Module and attribute names are diffusers' PyTorch names with list indices merged
(`transformer_blocks_0/img_mod_1`, `transformer_blocks_0/attn/to_out_0`,
`transformer_blocks_0/img_mlp/net_0/proj`), so `convert.pytorch_to_flax` maps a diffusers
`transformer/` safetensors file onto these params with no table, and
`convert.flax_to_pytorch(params, list_names=MODULE_LISTS)` gives the file's keys back.

Activations run in `dtype` (float32 or bfloat16) with float32 `param_dtype`; norms, RoPE and
the timestep features are computed in float32 and rounded to `dtype` (the timestep stays
float32 where diffusers rounds it to the compute dtype first). The RoPE frequencies are
computed in float32 as diffusers computes them; the angles and their cosines and sines are
float32 in both. Against the PyTorch model in float32 on CPU
(tests/parity/test_qwenimage_transformer.py: a tiny random model, 4x4 and 3x5 token grids,
5 and 7 text tokens with one prompt padded, outputs of scale ~2.5) the largest difference is
1.2e-6 (4.8e-7 of the scale), at JAX's default matmul precision; bfloat16 compute is within
1.2% of float32.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.dit_layers import (
    AdaLayerNormContinuous,
    Attention,
    Block,
    DiT,
    FeedForward,
    Layer,
    RMSNorm,
    TimestepEmbedding,
    check_rope_axes,
    gated_feed_forward,
    layer_norm,
    modulate,
    module_from_config,
    rotate_pairs,
    run_stack,
    timestep_features,
)
from tree_grpo_jax.models.patches import LATENT_PATCH, check_even
from tree_grpo_jax.models.qwenimage import family

ROPE_THETA = 10000
ID_AXES = 3  # (frame, row, column)
TIMESTEP_SCALE = 1000.0  # the timestep features' `scale`: sigma in [0, 1] -> [0, 1000]
MODULATION_CHUNKS = 6  # shift, scale, gate of the attention, then of the feed-forward
# Module lists of this model, for `convert.flax_to_pytorch(params, list_names=MODULE_LISTS)`.
MODULE_LISTS = family.MODULE_LISTS


def _centred(count: int) -> np.ndarray:
    """Positions of `count` rows (or columns) centred as `scale_rope` centres them: the
    first half negative, ending at -1, then 0, 1, ..."""
    return np.arange(count) - (count - count // 2)


def image_ids(height: int, width: int) -> np.ndarray:
    """[(H/2)(W/2), 3] float32 position ids of the packed tokens of H x W latents, in
    `pack_latents`' order: (0, centred patch row, centred patch column), as the pipeline's
    `img_shapes` entry (1, H/2, W/2) makes `QwenEmbedRope` place them."""
    check_even(height, width)
    rows, columns = np.meshgrid(
        _centred(height // LATENT_PATCH), _centred(width // LATENT_PATCH), indexing="ij"
    )
    ids = np.stack([np.zeros_like(rows), rows, columns], axis=-1)
    return ids.reshape(-1, ID_AXES).astype(np.float32)


def text_positions(img_ids: jax.Array, num_tokens: int) -> jax.Array:
    """[T] float32 positions of the text tokens: on from one past the image's largest row or
    column id (for centred ids that is max(R//2, C//2), where diffusers starts them)."""
    start = jnp.max(img_ids[:, 1:]) + 1
    return start + jnp.arange(num_tokens, dtype=jnp.float32)


def rope_frequencies(axes_dims: tuple[int, ...], theta: int = ROPE_THETA) -> list[np.ndarray]:
    """Per id axis, the [d / 2] float32 rotation frequencies theta^(-2i / d), computed in
    float32 as diffusers' `QwenEmbedRope.rope_params` computes them."""
    return [
        np.float32(1.0) / np.power(np.float32(theta), np.arange(0, d, 2, dtype=np.float32) / d)
        for d in axes_dims
    ]


def rope_tables(ids: jax.Array, axes_dims: tuple[int, ...]):
    """ids [S, 3] -> (cos, sin), each [S, head_dim / 2] float32: the angle of the i-th
    (even, odd) channel pair of a head; axis a owns `axes_dims[a] / 2` consecutive pairs."""
    chex.assert_rank(ids, 2)
    chex.assert_axis_dimension(ids, 1, len(axes_dims))
    positions = jnp.asarray(ids, jnp.float32)
    angles = jnp.concatenate(
        [
            positions[:, axis, None] * jnp.asarray(freqs)[None, :]
            for axis, freqs in enumerate(rope_frequencies(axes_dims))
        ],
        axis=-1,
    )
    return jnp.cos(angles), jnp.sin(angles)


def joint_mask(text_mask: jax.Array | None, image_tokens: int) -> jax.Array | None:
    """[B, T] text mask (nonzero: a real token) -> [B, 1, 1, T + N] bool over the joint
    [text, image] keys, every image token valid; None stays None (nothing padded)."""
    if text_mask is None:
        return None
    chex.assert_rank(text_mask, 2)
    valid = jnp.asarray(text_mask) != 0
    image = jnp.ones((valid.shape[0], image_tokens), bool)
    return jnp.concatenate([valid, image], axis=1)[:, None, None, :]


class QwenDoubleStreamAttention(Attention):
    """Joint attention of the two streams: per-stream projections (`to_*` for the image,
    `add_*_proj` for the text), RMS qk-norm per head, RoPE, one softmax over [text, image]
    keys (padding text keys masked), and a per-stream output projection. Returns
    (image out, text out)."""

    def setup(self):
        dim = self.width
        norm = functools.partial(RMSNorm, **self.dtypes)
        self.to_q, self.to_k, self.to_v = self.dense(dim), self.dense(dim), self.dense(dim)
        self.add_q_proj, self.add_k_proj = self.dense(dim), self.dense(dim)
        self.add_v_proj = self.dense(dim)
        self.norm_q, self.norm_k = norm(), norm()
        self.norm_added_q, self.norm_added_k = norm(), norm()
        self.to_out_0 = self.dense(dim)
        self.to_add_out = self.dense(dim)

    def __call__(self, hidden_states, context, rope, mask):
        query = jnp.concatenate(
            [
                self.norm_added_q(self._heads(self.add_q_proj(context))),
                self.norm_q(self._heads(self.to_q(hidden_states))),
            ],
            axis=1,
        )
        key = jnp.concatenate(
            [
                self.norm_added_k(self._heads(self.add_k_proj(context))),
                self.norm_k(self._heads(self.to_k(hidden_states))),
            ],
            axis=1,
        )
        value = jnp.concatenate(
            [self._heads(self.add_v_proj(context)), self._heads(self.to_v(hidden_states))], axis=1
        )
        attended = self._attend(
            rotate_pairs(query, *rope), rotate_pairs(key, *rope), value, mask=mask
        )
        text_tokens = context.shape[1]
        return self.to_out_0(attended[:, text_tokens:]), self.to_add_out(attended[:, :text_tokens])


class QwenImageTransformerBlock(Block):
    """A dual-stream block: per stream, a modulation (SiLU then one dense layer to six
    chunks), the joint attention and a GELU-tanh feed-forward, each residual gated. Returns
    (image, text)."""

    def setup(self):
        self.img_mod_1 = self.dense(MODULATION_CHUNKS * self.dim)
        self.txt_mod_1 = self.dense(MODULATION_CHUNKS * self.dim)
        self.attn = QwenDoubleStreamAttention(**self.attention_arguments)
        self.img_mlp = FeedForward(dim=self.dim, **self.dtypes)
        self.txt_mlp = FeedForward(dim=self.dim, **self.dtypes)

    def __call__(self, hidden_states, context, temb, rope, mask):
        conditioning = nn.silu(temb)
        img = jnp.split(self.img_mod_1(conditioning), MODULATION_CHUNKS, axis=-1)
        txt = jnp.split(self.txt_mod_1(conditioning), MODULATION_CHUNKS, axis=-1)
        attn_out, context_attn_out = self.attn(
            modulate(layer_norm(hidden_states), img[0], img[1]),
            modulate(layer_norm(context), txt[0], txt[1]),
            rope,
            mask,
        )
        hidden_states = hidden_states + img[2][:, None] * attn_out
        hidden_states = gated_feed_forward(hidden_states, self.img_mlp, *img[3:])
        context = context + txt[2][:, None] * context_attn_out
        context = gated_feed_forward(context, self.txt_mlp, *txt[3:])
        return hidden_states, context


class QwenTimestepProjEmbeddings(Layer):
    """The conditioning vector: the embedded sinusoidal features of sigma x 1000."""

    dim: int = 1

    def setup(self):
        self.timestep_embedder = TimestepEmbedding(dim=self.dim, **self.dtypes)

    def __call__(self, sigma):
        return self.timestep_embedder(timestep_features(sigma, scale=TIMESTEP_SCALE))


class QwenImageTransformer(DiT):
    """Qwen-Image's transformer: `(hidden_states [B, N_img, in_channels],
    encoder_hidden_states [B, N_txt, joint_attention_dim], encoder_hidden_states_mask
    [B, N_txt] (nonzero for real tokens) or None, timestep [B] (sigma in [0, 1], the
    pipeline's timestep / 1000), img_ids [N_img, 3]) -> [B, N_img, patch_size^2 *
    out_channels]`, in the compute `dtype`.

    `img_ids` (`image_ids(H, W)` for H x W latents) stands for the pipeline's `img_shapes`;
    the text tokens' rotary positions follow from it (`text_positions`). The fields are
    diffusers' `transformer/config.json` fields; `attention` names the `models.attention`
    backend (model.attention; with a mask, one that takes masks: xla, blockwise, cudnn).
    """

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False
    # Written in Qwen-Image's first config.json; the model has no pooled input (diffusers
    # ignores the key).
    pooled_projection_dim: int | None = None
    param_dtype: jnp.dtype = jnp.float32

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels

    def check(self) -> None:
        """Raises a one-sentence ValueError for field values this module does not implement."""
        for field in (
            "guidance_embeds",
            "zero_cond_t",
            "use_additional_t_cond",
            "use_layer3d_rope",
        ):
            if getattr(self, field):
                raise ValueError(
                    f"{field} is not supported (Qwen-Image's text-to-image transformer has it off)."
                )
        check_rope_axes(self.axes_dims_rope, self.attention_head_dim, ID_AXES)
        self.check_dtype()
        self.check_runtime()

    def example_inputs(self) -> tuple:
        """One image token, one text token, batch 1, no mask: enough to trace the params'
        shapes."""
        return (
            jnp.zeros((1, 1, self.in_channels), jnp.float32),
            jnp.zeros((1, 1, self.joint_attention_dim), jnp.float32),
            None,
            jnp.zeros((1,), jnp.float32),
            jnp.zeros((1, ID_AXES), jnp.float32),
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
        self.img_in = dense(dim)
        self.txt_norm = RMSNorm(**layer)
        self.txt_in = dense(dim)
        self.time_text_embed = QwenTimestepProjEmbeddings(dim=dim, **layer)
        self.transformer_blocks = self.block_stack(
            QwenImageTransformerBlock, [{}] * self.num_layers, block, 3
        )
        self.norm_out = AdaLayerNormContinuous(**layer)
        self.proj_out = dense(self.patch_size**2 * self.output_channels)

    def __call__(
        self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_ids
    ):
        chex.assert_rank([hidden_states, encoder_hidden_states, img_ids], [3, 3, 2])
        chex.assert_axis_dimension(hidden_states, 2, self.in_channels)
        chex.assert_axis_dimension(encoder_hidden_states, 2, self.joint_attention_dim)
        chex.assert_equal_shape_prefix([hidden_states, encoder_hidden_states], prefix_len=1)
        chex.assert_shape(img_ids, (hidden_states.shape[1], ID_AXES))
        if encoder_hidden_states_mask is not None:
            chex.assert_shape(encoder_hidden_states_mask, encoder_hidden_states.shape[:2])
        batch, image_tokens = hidden_states.shape[:2]
        text_tokens = encoder_hidden_states.shape[1]

        sigma = jnp.broadcast_to(jnp.asarray(timestep, jnp.float32).reshape(-1), (batch,))
        temb = self.time_text_embed(sigma)
        text = jnp.repeat(text_positions(img_ids, text_tokens)[:, None], ID_AXES, axis=1)
        rope = rope_tables(jnp.concatenate([text, img_ids], axis=0), self.axes_dims_rope)
        mask = joint_mask(encoder_hidden_states_mask, image_tokens)
        tokens = self.img_in(hidden_states)
        context = self.txt_in(self.txt_norm(encoder_hidden_states))
        tokens, _ = run_stack(self.transformer_blocks, (tokens, context), temb, rope, mask)
        return self.proj_out(self.norm_out(tokens, temb))


def transformer_module(config: dict, dtype=jnp.float32, **options) -> QwenImageTransformer:
    """The Qwen-Image transformer of a diffusers `transformer/config.json` dict; keys
    starting with `_` are metadata and ignored, `options` set the non-config fields
    (`param_dtype`, `attention`, `remat`, `scan_layers`). Raises a one-sentence ValueError
    for keys or values this module does not implement."""
    axes = {"axes_dims_rope": tuple}
    return module_from_config(QwenImageTransformer, config, dtype, options, axes)
