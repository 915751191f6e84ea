"""The Wan2.1 text-to-video transformer in Flax, computing what diffusers' PyTorch
`WanTransformer3DModel` computes.

A video's latents [B, F, h, w, C] (channels last) are cut into (p_t, p_h, p_w) patches by a
strided 3D convolution (`patch_embedding`), one token per patch, frame-major. Every block
runs self-attention over all of the video's tokens, then cross-attention to the text
tokens, then a GELU-tanh feed-forward. Queries and keys are RMS-normalised across all heads
at once (`norm_q`/`norm_k` over the whole inner width), and the self-attention's are turned
by a rotary embedding split over frames, rows and columns (`rope_tables`). The timestep's
sinusoid goes through `time_embedder` to `temb`, and `time_proj` makes six modulation
vectors from it, which each block adds to its own `scale_shift_table` [1, 6, dim]: shift,
scale and gate of the self-attention and of the feed-forward (the cross-attention has no
modulation, only the affine `norm2`). The output head modulates with `temb` plus its
`scale_shift_table` [1, 2, dim], projects to a patch's values and unpatchifies.

Module and attribute names are diffusers' PyTorch names with list indices merged
(`blocks_3/attn1/norm_q`, `blocks_0/ffn/net_0/proj`, `blocks_0/attn2/to_out_0`), so
`convert.pytorch_to_flax` maps a diffusers `transformer/` safetensors file onto these params
with no table, and `transformer_weights` converts both ways, the blocks scanned or not. The
file has no buffers (diffusers' rotary tables are not saved).

For Wan2.2-TI2V's image to video, `clean_first_frame` gives the first latent frame's tokens
timestep 0 and the others the row's timestep, as diffusers' per-token timesteps
(`expand_timesteps`) do: the modulations are computed for both timesteps and each token takes
its own (`per_token`), not one set per token.

Activations run in `dtype` (float32 or bfloat16) with float32 `param_dtype`. As diffusers
keeps them in float32 (`_keep_in_fp32_modules`), the norms, modulations, residual sums of
the gated branches, the timestep embedding and the rotations are computed in float32; the
rotary angles are taken in float64, as diffusers takes them, and rounded once.

Against the PyTorch model in float32 on CPU (tests/parity/test_wan_transformer.py: a tiny
random model, 3 frames of 4x6 latents, outputs of scale ~2.5) the largest difference is
1.9e-7 of the scale, blocks scanned or not, at JAX's default matmul precision; bfloat16
compute with float32 params is within 0.7%. The released configs (`builtin_config`) hold
1,418,996,800 (1.3B) and 14,288,491,584 (14B) parameters, diffusers' trees name for name.
"""

from __future__ import annotations

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.dit_layers import (
    Attention,
    Block,
    DiT,
    FeedForward,
    Layer,
    RMSNorm,
    TimestepEmbedding,
    layer_norm,
    module_from_config,
    rotate_pairs,
    run_stack,
    timestep_features,
)

ROPE_THETA = 10000.0
PATCH_AXES = 3  # (frames, rows, columns)
MODULATIONS = 6  # a block's shift, scale, gate of the self-attention, then of the FFN
QK_NORM = "rms_norm_across_heads"
# Module lists of this model, for `convert.flax_to_pytorch(params, list_names=MODULE_LISTS)`.
MODULE_LISTS = frozenset({"blocks", "to_out", "net"})
# The image-to-video fields of diffusers' config, which this text-to-video model refuses.
I2V_FIELDS = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")

_COMMON = dict(
    _class_name="WanTransformer3DModel",
    patch_size=[1, 2, 2],
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm=QK_NORM,
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)
# The released Wan2.1-T2V checkpoints' `transformer/config.json` (Wan-AI/*-Diffusers).
BUILTIN_CONFIGS = {
    "1.3b": dict(_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "14b": dict(_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40),
}


def builtin_config(size: str) -> dict:
    """The diffusers `transformer/config.json` dict of Wan2.1-T2V-1.3B ("1.3b") or -14B
    ("14b")."""
    if size not in BUILTIN_CONFIGS:
        raise ValueError(
            f"Wan2.1 size {size!r} is unknown; choose one of {', '.join(BUILTIN_CONFIGS)}."
        )
    return {k: list(v) if isinstance(v, list) else v for k, v in BUILTIN_CONFIGS[size].items()}


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """(frame, row, column) channels of a head the rotary embedding gives each axis:
    rows and columns `2 * (head_dim // 6)` each, frames the rest (44, 42, 42 for 128)."""
    side = 2 * (head_dim // 6)
    return head_dim - 2 * side, side, side


def rope_tables(grid: tuple[int, int, int], head_dim: int, theta: float = ROPE_THETA):
    """(cos, sin), each [F' * h' * w', head_dim / 2] float32: the angle of each (even, odd)
    channel pair of a head at each token of a (frames, rows, columns) token grid, tokens
    frame-major. The first pairs turn with the frame index, then the row, then the column,
    at frequencies theta^(-2i / d) of the axis' d channels. Angles in float64 (numpy, as
    diffusers' `WanRotaryPosEmbed` takes them), their cosines and sines rounded to float32;
    each axis' table is small and broadcast over the grid here."""
    cos, sin = [], []
    for axis, (count, dim) in enumerate(zip(grid, rope_axes(head_dim))):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        angles = np.outer(np.arange(count, dtype=np.float64), freqs)
        shape = [1, 1, 1, dim // 2]
        shape[axis] = count
        for tables, values in ((cos, np.cos(angles)), (sin, np.sin(angles))):
            table = jnp.asarray(values.astype(np.float32).reshape(shape))
            tables.append(jnp.broadcast_to(table, (*grid, dim // 2)))
    tokens = math.prod(grid)
    return (
        jnp.concatenate(cos, axis=-1).reshape(tokens, head_dim // 2),
        jnp.concatenate(sin, axis=-1).reshape(tokens, head_dim // 2),
    )


class AffineLayerNorm(Layer):
    """LayerNorm with a learned scale and bias (diffusers' `FP32LayerNorm` with
    `elementwise_affine`), computed in float32 and rounded to `dtype`."""

    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (width,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (width,), self.param_dtype)
        normed = layer_norm(x.astype(jnp.float32), self.eps)
        return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


class TextProjection(Layer):
    """dense, GELU-tanh, dense (diffusers' `PixArtAlphaTextProjection(act_fn="gelu_tanh")`)."""

    dim: int = 1

    def setup(self):
        self.linear_1 = self.dense(self.dim)
        self.linear_2 = self.dense(self.dim)

    def __call__(self, x):
        return self.linear_2(nn.gelu(self.linear_1(x), approximate=True))


class ConditionEmbedder(Layer):
    """`condition_embedder`: timestep [B] (0..1000) -> (temb [B, dim] in `dtype`, the six
    modulations [B, 6, dim] float32); text states [B, L, text_dim] -> [B, L, dim]. The time
    embedder runs in float32 whatever `dtype` is, as diffusers keeps it."""

    dim: int = 1
    freq_dim: int = 256

    def setup(self):
        self.time_embedder = TimestepEmbedding(
            dim=self.dim, dtype=jnp.float32, param_dtype=self.param_dtype
        )
        self.time_proj = self.dense(MODULATIONS * self.dim)
        self.text_embedder = TextProjection(dim=self.dim, **self.dtypes)

    def __call__(self, timestep, text):
        temb = self.time_embedder(timestep_features(timestep, self.freq_dim)).astype(self.dtype)
        modulation = self.time_proj(nn.silu(temb)).astype(jnp.float32)
        modulation = modulation.reshape(-1, MODULATIONS, self.dim)
        return temb, modulation, self.text_embedder(text)


class WanAttention(Attention):
    """Attention with RMS qk-norm across heads (over the whole inner width, before the head
    split). Self-attention (no `context`) turns queries and keys by the rotary tables;
    cross-attention takes keys and values from `context` and has no rotation."""

    eps: float = 1e-6

    def setup(self):
        width = self.width
        self.to_q, self.to_k, self.to_v = self.dense(width), self.dense(width), self.dense(width)
        self.to_out_0 = self.dense(width)
        self.norm_q = RMSNorm(eps=self.eps, **self.dtypes)
        self.norm_k = RMSNorm(eps=self.eps, **self.dtypes)

    def __call__(self, hidden_states, rope=None, context=None):
        source = hidden_states if context is None else context
        query = self._heads(self.norm_q(self.to_q(hidden_states)))
        key = self._heads(self.norm_k(self.to_k(source)))
        value = self._heads(self.to_v(source))
        if rope is not None:
            query, key = rotate_pairs(query, *rope), rotate_pairs(key, *rope)
        return self.to_out_0(self._attend(query, key, value))


class WanTransformerBlock(Block):
    """Self-attention (AdaLN-modulated, gated), cross-attention to the text (after `norm2`,
    ungated), feed-forward (modulated, gated); the modulations are the block's
    `scale_shift_table` plus the conditioning's six vectors."""

    ffn_dim: int = 1
    eps: float = 1e-6
    cross_attn_norm: bool = True

    def setup(self):
        self.scale_shift_table = self.param(
            "scale_shift_table",
            nn.initializers.normal(self.dim**-0.5),
            (1, MODULATIONS, self.dim),
            self.param_dtype,
        )
        attention = dict(self.attention_arguments, eps=self.eps)
        self.attn1 = WanAttention(**attention)
        self.attn2 = WanAttention(**attention)
        if self.cross_attn_norm:
            self.norm2 = AffineLayerNorm(eps=self.eps, **self.dtypes)
        self.ffn = FeedForward(dim=self.dim, inner_dim=self.ffn_dim, **self.dtypes)

    def __call__(self, hidden_states, context, modulation, rope):
        shift, scale, gate, c_shift, c_scale, c_gate = per_token(
            self.scale_shift_table.astype(jnp.float32), modulation
        )
        x32 = hidden_states.astype(jnp.float32)
        normed = layer_norm(x32, self.eps) * (1 + scale) + shift
        attended = self.attn1(normed.astype(self.dtype), rope)
        hidden_states = (x32 + attended * gate).astype(self.dtype)

        normed = self.norm2(hidden_states) if self.cross_attn_norm else hidden_states
        hidden_states = hidden_states + self.attn2(normed, context=context)

        x32 = hidden_states.astype(jnp.float32)
        normed = layer_norm(x32, self.eps) * (1 + c_scale) + c_shift
        fed = self.ffn(normed.astype(self.dtype)).astype(jnp.float32)
        return (x32 + fed * c_gate).astype(self.dtype)


def per_token(table, modulation):
    """The modulation vectors `table + modulation` split along axis 1, [B, 1, dim] each; or,
    for `modulation = (at_t, at_zero, clean)` (the first frame's tokens at timestep 0),
    [B, N, dim] each: token n takes `at_zero`'s where `clean` [B, N, 1] is set. Two rows of
    vectors and a mask instead of N rows: the same values as a timestep per token."""
    if not isinstance(modulation, tuple):
        return jnp.split(table + modulation, table.shape[1], axis=1)
    at_t, at_zero, clean = modulation
    pieces = zip(
        jnp.split(table + at_t, table.shape[1], axis=1),
        jnp.split(table + at_zero, table.shape[1], axis=1),
    )
    return [jnp.where(clean, zero, t) for t, zero in pieces]


class WanTransformer(DiT):
    """Wan2.1's text-to-video transformer: `(hidden_states [B, F, h, w, in_channels],
    timestep [B], encoder_hidden_states [B, L, text_dim]) -> [B, F, h, w, out_channels]`,
    diffusers' forward arguments in the library's channels-last layout, in the compute
    `dtype`.

    `timestep` is in the model's 0..1000 scale: the caller passes 1000 * sigma (a scalar is
    broadcast over the batch), as WanPipeline passes its scheduler's timesteps. The output
    is the velocity (noise minus data) of the flow. F, h and w must be multiples of the
    patch's sides. The fields are diffusers' `transformer/config.json` fields; the
    image-to-video ones (`image_dim`, `added_kv_proj_dim`, `pos_embed_seq_len`) must be
    null.
    """

    patch_size: tuple[int, ...] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = QK_NORM
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None
    param_dtype: jnp.dtype = jnp.float32

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels

    def check(self) -> None:
        """Raises a one-sentence ValueError for field values this module does not implement."""
        for field in I2V_FIELDS:
            value = getattr(self, field)
            if value is not None:
                raise ValueError(
                    f"{field} {value} belongs to Wan's image-to-video model; this transformer "
                    f"is text-to-video only, so {field} must be null."
                )
        patch = tuple(self.patch_size)
        if len(patch) != PATCH_AXES or any(not isinstance(p, int) or p < 1 for p in patch):
            raise ValueError(
                f"patch_size {list(patch)} must be {PATCH_AXES} positive integers (frames, "
                "rows, columns)."
            )
        if self.qk_norm != QK_NORM:
            raise ValueError(
                f"qk_norm {self.qk_norm!r} is not supported; Wan2.1 normalises queries and "
                f"keys with RMSNorm across heads ({QK_NORM!r})."
            )
        frames, side, _ = rope_axes(self.attention_head_dim)
        if side < 2 or frames < 2 or frames % 2:
            raise ValueError(
                f"attention_head_dim {self.attention_head_dim} is too small or odd for the "
                "rotary embedding's three axes (at least 6, and even)."
            )
        self.check_dtype()
        self.check_runtime()

    def example_inputs(self) -> tuple:
        """One patch of latents, one timestep, one text token, batch 1: enough to trace the
        params' shapes."""
        return (
            jnp.zeros((1, *self.patch_size, self.in_channels), jnp.float32),
            jnp.zeros((1,), jnp.float32),
            jnp.zeros((1, 1, self.text_dim), jnp.float32),
        )

    def setup(self):
        self.check()
        dim = self.inner_dim
        layer = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        patch = tuple(self.patch_size)
        self.patch_embedding = nn.Conv(
            dim, kernel_size=patch, strides=patch, padding="VALID", **layer
        )
        self.condition_embedder = ConditionEmbedder(dim=dim, freq_dim=self.freq_dim, **layer)
        block = dict(
            dim=dim,
            heads=self.num_attention_heads,
            head_dim=self.attention_head_dim,
            attention=self.attention,
            ffn_dim=self.ffn_dim,
            eps=self.eps,
            cross_attn_norm=self.cross_attn_norm,
            **layer,
        )
        self.blocks = self.block_stack(WanTransformerBlock, [{}] * self.num_layers, block, 3)
        self.proj_out = nn.Dense(math.prod(patch) * self.output_channels, **layer)
        self.scale_shift_table = self.param(
            "scale_shift_table",
            nn.initializers.normal(dim**-0.5),
            (1, 2, dim),
            self.param_dtype,
        )

    def token_grid(self, latent_shape) -> tuple[int, int, int]:
        """(frames, rows, columns) of tokens of latents [B, F, h, w, C]; a ValueError
        sentence when the patches do not tile them or the rotary tables are too short."""
        sides = latent_shape[1:4]
        if any(s % p for s, p in zip(sides, self.patch_size)):
            raise ValueError(
                f"Latents of {sides[0]} frames of {sides[1]}x{sides[2]} do not tile into "
                f"patches of {'x'.join(map(str, self.patch_size))}."
            )
        grid = tuple(s // p for s, p in zip(sides, self.patch_size))
        if max(grid) > self.rope_max_seq_len:
            raise ValueError(
                f"A token grid of {grid} is longer on one axis than rope_max_seq_len "
                f"{self.rope_max_seq_len}."
            )
        return grid

    def __call__(self, hidden_states, timestep, encoder_hidden_states, clean_first_frame=None):
        """`clean_first_frame` [B] bool (None: no row): in those rows the tokens of the first
        latent frame get timestep 0 and the others `timestep`, as Wan2.2-TI2V-5B's
        image-to-video pipeline (`expand_timesteps`) gives the frame it was handed."""
        chex.assert_rank([hidden_states, encoder_hidden_states], [5, 3])
        chex.assert_axis_dimension(hidden_states, 4, self.in_channels)
        chex.assert_axis_dimension(encoder_hidden_states, 2, self.text_dim)
        chex.assert_equal_shape_prefix([hidden_states, encoder_hidden_states], prefix_len=1)
        batch = hidden_states.shape[0]
        grid = self.token_grid(hidden_states.shape)
        timestep = jnp.broadcast_to(jnp.asarray(timestep, jnp.float32).reshape(-1), (batch,))

        rope = rope_tables(grid, self.attention_head_dim)
        tokens = self.patch_embedding(hidden_states.astype(self.dtype))
        tokens = tokens.reshape(batch, math.prod(grid), self.inner_dim)
        temb, modulation, context = self.condition_embedder(
            timestep, encoder_hidden_states.astype(self.dtype)
        )
        out_modulation = temb.astype(jnp.float32)[:, None]
        if clean_first_frame is not None:
            if self.patch_size[0] != 1:
                raise ValueError(
                    "a clean first frame needs one latent frame per token frame (patch_size "
                    f"[1, ...]), not {list(self.patch_size)}."
                )
            zero_temb, zero_modulation, _ = self.condition_embedder(
                jnp.zeros_like(timestep), encoder_hidden_states[:, :1].astype(self.dtype)
            )
            first = jnp.arange(math.prod(grid)) < grid[1] * grid[2]
            clean = (jnp.asarray(clean_first_frame, bool).reshape(batch, 1) & first)[..., None]
            modulation = (modulation, zero_modulation, clean)
            out_modulation = (out_modulation, zero_temb.astype(jnp.float32)[:, None], clean)
        (tokens,) = run_stack(self.blocks, (tokens,), context, modulation, rope)

        shift, scale = per_token(self.scale_shift_table.astype(jnp.float32), out_modulation)
        normed = layer_norm(tokens.astype(jnp.float32), self.eps) * (1 + scale) + shift
        out = self.proj_out(normed.astype(self.dtype))
        return unpatchify(out, grid, tuple(self.patch_size))


def unpatchify(tokens: jax.Array, grid, patch) -> jax.Array:
    """[B, F' h' w', p_t p_h p_w C] -> [B, F' p_t, h' p_h, w' p_w, C]: each token's values
    ordered (p_t, p_h, p_w, channel), as diffusers reshapes `proj_out`'s output."""
    batch, channels = tokens.shape[0], tokens.shape[-1] // math.prod(patch)
    x = tokens.reshape(batch, *grid, *patch, channels)
    x = jnp.transpose(x, (0, 1, 4, 2, 5, 3, 6, 7))
    return x.reshape(batch, *(g * p for g, p in zip(grid, patch)), channels)


def transformer_module(config: dict, dtype=jnp.float32, **options) -> WanTransformer:
    """The Wan transformer of a diffusers `transformer/config.json` dict; keys starting with
    `_` are metadata and ignored, `options` set the non-config fields (`param_dtype`,
    `attention`, `remat`, `scan_layers`, default True here). Raises a
    one-sentence ValueError for keys or values this module does not implement."""
    options = {"scan_layers": True, **options}
    return module_from_config(WanTransformer, config, dtype, options, {"patch_size": tuple})
