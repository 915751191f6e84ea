"""The FLUX.2 transformer in Flax, computing what diffusers' PyTorch `Flux2Transformer2DModel`
computes.

FLUX.2 works on 32-channel latents patchified 2x2 into 128 channels and flattened to tokens
outside the network (`hidden_states` [B, N, in_channels]). The text tokens (stacked hidden
states of the text encoder, `joint_attention_dim` wide) come first, then the image tokens.
Reference images for editing are more image tokens: the pipeline appends their tokens after
the noisy latent's, with their own position ids (time coordinate 10, 20, ...), and keeps only
the first N outputs; the module attends over all of them and returns them all, as diffusers'
does.

`num_layers` double-stream blocks keep separate weights per stream (projections, qk-norms,
SwiGLU feed-forwards) around one joint attention; `num_single_layers` single-stream blocks
then run both streams as one sequence, with the query/key/value and the MLP's input fused in
one projection (`to_qkv_mlp_proj`) and the attention and MLP outputs mixed by one
(`to_out`). Unlike FLUX.1, the AdaLN modulations are shared by all blocks: three dense
layers of the conditioning vector at the top (`double_stream_modulation_img`, `_txt`,
`single_stream_modulation`), handed to every block. No layer has a bias. Every query and key
is RMS-normalised per head and rotated by a 4-axis RoPE (theta 2000) of the token's position
ids (time, row, column, text index). The conditioning vector is the embedded timestep
(sigma * 1000), plus the embedded guidance scale where `guidance_embeds` (FLUX.2-dev); there
is no pooled text input.

Module and attribute names are diffusers' PyTorch names with list indices merged
(`single_transformer_blocks_3/attn/to_qkv_mlp_proj`, `transformer_blocks_0/attn/to_out_0`),
so `params_from_state_dict` maps a diffusers `transformer/` state dict onto these params with
no table (stacked where `scan_layers`), and `state_dict_from_params` gives its keys back.

Activations run in `dtype` (float32 or bfloat16) with float32 `param_dtype`; norms, RoPE and
the timestep features are computed in float32 and rounded to `dtype` (the timestep and
guidance stay float32 where diffusers rounds them to the compute dtype first). The RoPE angles
are float32 here where diffusers takes them in float64: their cosines and sines differ by at
most 3.0e-6 over a 1024-pixel image's ids (positions up to 63) and 2.7e-5 over 512 text
tokens' (the text index reaches 511). Against the PyTorch model in float32 on CPU
(tests/parity/test_flux2_transformer.py: tiny random dev and klein style models, scanned and
unrolled, with and without reference-image tokens, outputs of scale ~3) the largest
difference is 8.3e-7 (2.8e-7 of the scale), at JAX's default matmul precision; bfloat16
compute is within 0.6% of float32.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import dit_layers
from tree_grpo_jax.models.dit_layers import (
    Attention,
    Block,
    DiT,
    Layer,
    RMSNorm,
    layer_norm,
    modulate,
    module_from_config,
    rotate_pairs,
    run_stack,
    timestep_features,
)

ID_AXES = 4  # (time, row, column, text index): FLUX.2's position ids
TIMESTEP_SCALE = 1000.0  # diffusers' forward multiplies sigma (and guidance) by this
REFERENCE_TIME_STEP = 10  # reference image i sits at time 10 * (i + 1) (the pipeline's `scale`)
MODULATION_CHUNKS = 3  # shift, scale, gate per modulated sub-block
# Module lists of this model, for `convert.flax_to_pytorch(params, list_names=MODULE_LISTS)`
# (a single-stream block's `attn/to_out` is one layer, not a list, and keeps its name).
MODULE_LISTS = frozenset({"transformer_blocks", "single_transformer_blocks", "to_out"})


def image_ids(rows: int, columns: int, time: int = 0) -> np.ndarray:
    """[rows * columns, 4] float32 position ids of a rows x columns grid of image tokens in
    row-major order: (time, row, column, 0). The noisy latent sits at time 0 (the pipeline's
    `_prepare_latent_ids`), reference image i at `reference_time(i)` (`_prepare_image_ids`)."""
    grid_rows, grid_columns = np.meshgrid(np.arange(rows), np.arange(columns), indexing="ij")
    ids = np.stack(
        [np.full_like(grid_rows, time), grid_rows, grid_columns, np.zeros_like(grid_rows)],
        axis=-1,
    )
    return ids.reshape(-1, ID_AXES).astype(np.float32)


def reference_time(index: int) -> int:
    """The time coordinate of the `index`-th reference image (0-based): 10, 20, ..."""
    return REFERENCE_TIME_STEP * (index + 1)


def text_ids(num_tokens: int) -> np.ndarray:
    """[T, 4] float32 position ids of T text tokens: (0, 0, 0, token index)."""
    ids = np.zeros((num_tokens, ID_AXES), np.float32)
    ids[:, 3] = np.arange(num_tokens)
    return ids


def rope_tables(ids: jax.Array, axes_dims: tuple[int, ...], theta: float):
    """ids [..., S, axes] -> (cos, sin), each [..., S, head_dim / 2] float32: the angle of the
    i-th (even, odd) channel pair of a head; axis a owns `axes_dims[a] / 2` consecutive
    pairs."""
    positions = jnp.asarray(ids, jnp.float32)
    chex.assert_axis_dimension(positions, -1, len(axes_dims))
    angles = jnp.concatenate(
        [
            positions[..., axis, None] * jnp.asarray(freqs)
            for axis, freqs in enumerate(dit_layers.rope_frequencies(axes_dims, theta))
        ],
        axis=-1,
    )
    return jnp.cos(angles), jnp.sin(angles)


def swiglu(x: jax.Array) -> jax.Array:
    """SiLU of the first half of the last axis times the second half."""
    gate, value = jnp.split(x, 2, axis=-1)
    return nn.silu(gate) * value


class Unbiased(Layer):
    """A layer whose dense layers have no bias (every FLUX.2 linear layer)."""

    @property
    def dense(self):
        return functools.partial(nn.Dense, use_bias=False, **self.dtypes)


class Flux2TimestepEmbedding(Unbiased, dit_layers.TimestepEmbedding):
    """dense, SiLU, dense, without biases."""


class Flux2TimestepGuidanceEmbeddings(Unbiased):
    """The conditioning vector: the embedded sinusoidal features of the timestep, plus those
    of the guidance scale with `guidance`; both already scaled by 1000."""

    dim: int = 1
    channels: int = dit_layers.TIMESTEP_CHANNELS
    guidance: bool = False

    def setup(self):
        self.timestep_embedder = Flux2TimestepEmbedding(dim=self.dim, **self.dtypes)
        if self.guidance:
            self.guidance_embedder = Flux2TimestepEmbedding(dim=self.dim, **self.dtypes)

    def __call__(self, timestep, guidance=None):
        temb = self.timestep_embedder(timestep_features(timestep, self.channels))
        if self.guidance:
            temb = temb + self.guidance_embedder(timestep_features(guidance, self.channels))
        return temb


class Flux2Modulation(Unbiased):
    """SiLU of the conditioning then one dense layer to `sets` x (shift, scale, gate)."""

    sets: int = 1

    @nn.compact
    def __call__(self, temb):
        return self.dense(MODULATION_CHUNKS * self.sets * temb.shape[-1], name="linear")(
            nn.silu(temb)
        )


class Flux2NormOut(Unbiased):
    """LayerNorm modulated by the conditioning, no gate; diffusers' chunk order (scale,
    shift)."""

    eps: float = dit_layers.NORM_EPS

    @nn.compact
    def __call__(self, x, temb):
        emb = self.dense(2 * x.shape[-1], name="linear")(nn.silu(temb))
        scale, shift = jnp.split(emb, 2, axis=-1)
        return modulate(layer_norm(x, self.eps), shift, scale)


class Flux2FeedForward(Unbiased):
    """`linear_in` to twice the hidden width, SwiGLU, `linear_out` back."""

    dim: int = 1
    hidden: int = 1

    def setup(self):
        self.linear_in = self.dense(2 * self.hidden)
        self.linear_out = self.dense(self.dim)

    def __call__(self, x):
        return self.linear_out(swiglu(self.linear_in(x)))


class Flux2Attention(Unbiased, Attention):
    """The double-stream blocks' joint attention: per-stream projections (`to_*` for the
    image, `add_*_proj` for the text), RMS qk-norm per head, RoPE over [text, image], one
    softmax, a per-stream output projection. Returns (image out, text out)."""

    eps: float = dit_layers.NORM_EPS

    def setup(self):
        dim = self.width
        norm = functools.partial(RMSNorm, eps=self.eps, **self.dtypes)
        self.to_q, self.to_k, self.to_v = self.dense(dim), self.dense(dim), self.dense(dim)
        self.norm_q, self.norm_k = norm(), norm()
        self.add_q_proj, self.add_k_proj = self.dense(dim), self.dense(dim)
        self.add_v_proj = self.dense(dim)
        self.norm_added_q, self.norm_added_k = norm(), norm()
        self.to_out_0 = self.dense(dim)
        self.to_add_out = self.dense(dim)

    def __call__(self, hidden_states, context, rope):
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
        attended = self._attend(rotate_pairs(query, *rope), rotate_pairs(key, *rope), value)
        text_tokens = context.shape[1]
        return self.to_out_0(attended[:, text_tokens:]), self.to_add_out(attended[:, :text_tokens])


class Flux2ParallelSelfAttention(Unbiased, Attention):
    """The single-stream blocks' parallel attention and MLP: one projection to query, key,
    value and the SwiGLU input, and one from [attended values, SwiGLU output] back."""

    dim: int = 1
    mlp_hidden: int = 1
    eps: float = dit_layers.NORM_EPS

    def setup(self):
        norm = functools.partial(RMSNorm, eps=self.eps, **self.dtypes)
        self.to_qkv_mlp_proj = self.dense(3 * self.width + 2 * self.mlp_hidden)
        self.norm_q, self.norm_k = norm(), norm()
        self.to_out = self.dense(self.dim)

    def __call__(self, x, rope):
        projected = self.to_qkv_mlp_proj(x)
        query, key, value, mlp = jnp.split(
            projected, [self.width, 2 * self.width, 3 * self.width], axis=-1
        )
        query = rotate_pairs(self.norm_q(self._heads(query)), *rope)
        key = rotate_pairs(self.norm_k(self._heads(key)), *rope)
        attended = self._attend(query, key, self._heads(value))
        return self.to_out(jnp.concatenate([attended, swiglu(mlp)], axis=-1))


class Flux2TransformerBlock(Block):
    """A double-stream block: joint attention of the image and text streams, then a SwiGLU
    feed-forward per stream, each residual gated; the modulations come from outside.
    Returns (image, text)."""

    mlp_hidden: int = 1
    eps: float = dit_layers.NORM_EPS

    def setup(self):
        self.attn = Flux2Attention(eps=self.eps, **self.attention_arguments)
        feed_forward = dict(dim=self.dim, hidden=self.mlp_hidden, **self.dtypes)
        self.ff = Flux2FeedForward(**feed_forward)
        self.ff_context = Flux2FeedForward(**feed_forward)

    def _norm(self, x, shift, scale):
        return modulate(layer_norm(x, self.eps), shift, scale)

    def __call__(self, hidden_states, context, mod_img, mod_txt, rope):
        img = jnp.split(mod_img, 2 * MODULATION_CHUNKS, axis=-1)
        txt = jnp.split(mod_txt, 2 * MODULATION_CHUNKS, axis=-1)
        attn_out, context_attn_out = self.attn(
            self._norm(hidden_states, img[0], img[1]), self._norm(context, txt[0], txt[1]), rope
        )
        hidden_states = hidden_states + img[2][:, None] * attn_out
        ff_out = self.ff(self._norm(hidden_states, img[3], img[4]))
        hidden_states = hidden_states + img[5][:, None] * ff_out
        context = context + txt[2][:, None] * context_attn_out
        context_ff_out = self.ff_context(self._norm(context, txt[3], txt[4]))
        context = context + txt[5][:, None] * context_ff_out
        return hidden_states, context


class Flux2SingleTransformerBlock(Block):
    """A single-stream block over the joined [text, image] sequence: the parallel attention
    and MLP of the modulated norm, one gated residual."""

    mlp_hidden: int = 1
    eps: float = dit_layers.NORM_EPS

    def setup(self):
        self.attn = Flux2ParallelSelfAttention(
            dim=self.dim, mlp_hidden=self.mlp_hidden, eps=self.eps, **self.attention_arguments
        )

    def __call__(self, tokens, mod, rope):
        shift, scale, gate = jnp.split(mod, MODULATION_CHUNKS, axis=-1)
        normed = modulate(layer_norm(tokens, self.eps), shift, scale)
        return tokens + gate[:, None] * self.attn(normed, rope)


class Flux2Transformer(DiT):
    """FLUX.2's transformer: `(hidden_states [B, N_img, in_channels], encoder_hidden_states
    [B, N_txt, joint_attention_dim], timestep [B] (sigma in [0, 1]), img_ids [N_img, 4] or
    [B, N_img, 4], txt_ids [N_txt, 4] or [B, N_txt, 4], guidance [B] or None) ->
    [B, N_img, patch_size^2 * out_channels]`, diffusers' forward arguments, in the compute
    `dtype`. N_img counts every image token: the noisy latent's and any reference images'.

    Batched ids ([B, S, 4], as the pipeline passes them) rotate each row by its own ids;
    diffusers takes the first row's for all (the pipeline's rows are equal). `guidance` (the
    distilled guidance scale, e.g. 4.0) is required with `guidance_embeds` (FLUX.2-dev) and
    refused without it (klein). Timestep and guidance are scaled by 1000 in float32. The
    fields are diffusers' `transformer/config.json` fields; `attention` names the
    `models.attention` backend (model.attention).
    """

    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = dit_layers.TIMESTEP_CHANNELS
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: int = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True
    param_dtype: jnp.dtype = jnp.float32

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels

    @property
    def mlp_hidden(self) -> int:
        """The feed-forward's hidden width, rounded down as diffusers rounds it."""
        return int(self.inner_dim * self.mlp_ratio)

    def check(self) -> None:
        """Raises a one-sentence ValueError for field values this module does not implement."""
        if self.timestep_guidance_channels % 2:
            raise ValueError(
                f"timestep_guidance_channels {self.timestep_guidance_channels} is odd; the "
                "sinusoidal features take an even count."
            )
        dit_layers.check_rope_axes(self.axes_dims_rope, self.attention_head_dim, ID_AXES)
        self.check_dtype()
        self.check_runtime()

    def example_inputs(self) -> tuple:
        """One image token, one text token, batch 1: enough to trace the params' shapes."""
        return (
            jnp.zeros((1, 1, self.in_channels), jnp.float32),
            jnp.zeros((1, 1, self.joint_attention_dim), jnp.float32),
            jnp.zeros((1,), jnp.float32),
            jnp.zeros((1, ID_AXES), jnp.float32),
            jnp.zeros((1, ID_AXES), jnp.float32),
            jnp.ones((1,), jnp.float32) if self.guidance_embeds else None,
        )

    def setup(self):
        self.check()
        dim = self.inner_dim
        layer = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        dense = functools.partial(nn.Dense, use_bias=False, **layer)
        block = dict(
            dim=dim,
            heads=self.num_attention_heads,
            head_dim=self.attention_head_dim,
            attention=self.attention,
            mlp_hidden=self.mlp_hidden,
            eps=self.eps,
            **layer,
        )
        self.time_guidance_embed = Flux2TimestepGuidanceEmbeddings(
            dim=dim,
            channels=self.timestep_guidance_channels,
            guidance=self.guidance_embeds,
            **layer,
        )
        self.double_stream_modulation_img = Flux2Modulation(sets=2, **layer)
        self.double_stream_modulation_txt = Flux2Modulation(sets=2, **layer)
        self.single_stream_modulation = Flux2Modulation(sets=1, **layer)
        self.x_embedder = dense(dim)
        self.context_embedder = dense(dim)
        self.transformer_blocks = self.block_stack(
            Flux2TransformerBlock, [{}] * self.num_layers, block, 3
        )
        self.single_transformer_blocks = self.block_stack(
            Flux2SingleTransformerBlock, [{}] * self.num_single_layers, block, 2
        )
        self.norm_out = Flux2NormOut(eps=self.eps, **layer)
        self.proj_out = dense(self.patch_size**2 * self.output_channels)

    def __call__(
        self,
        hidden_states,
        encoder_hidden_states,
        timestep,
        img_ids,
        txt_ids,
        guidance=None,
    ):
        chex.assert_rank([hidden_states, encoder_hidden_states], 3)
        chex.assert_axis_dimension(hidden_states, 2, self.in_channels)
        chex.assert_axis_dimension(encoder_hidden_states, 2, self.joint_attention_dim)
        chex.assert_equal_shape_prefix([hidden_states, encoder_hidden_states], prefix_len=1)
        batch, image_tokens = hidden_states.shape[:2]
        text_tokens = encoder_hidden_states.shape[1]
        img_ids, txt_ids = _batched_ids(img_ids, batch), _batched_ids(txt_ids, batch)
        chex.assert_shape(img_ids, (batch, image_tokens, ID_AXES))
        chex.assert_shape(txt_ids, (batch, text_tokens, ID_AXES))
        if self.guidance_embeds and guidance is None:
            raise ValueError("This model embeds a guidance scale (guidance_embeds), pass one.")
        if not self.guidance_embeds and guidance is not None:
            raise ValueError("This model has no guidance embedding, so guidance must be None.")

        temb = self.time_guidance_embed(
            _scaled(timestep, batch), None if guidance is None else _scaled(guidance, batch)
        )
        mod_img = self.double_stream_modulation_img(temb)
        mod_txt = self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)
        ids = jnp.concatenate([txt_ids, img_ids], axis=1)
        rope = rope_tables(ids, self.axes_dims_rope, self.rope_theta)
        tokens = self.x_embedder(hidden_states)
        context = self.context_embedder(encoder_hidden_states)
        tokens, context = run_stack(
            self.transformer_blocks, (tokens, context), mod_img, mod_txt, rope
        )
        # The single-stream blocks see one sequence, text first, as the attention orders it.
        joined = jnp.concatenate([context, tokens], axis=1)
        (joined,) = run_stack(self.single_transformer_blocks, (joined,), mod_single, rope)
        return self.proj_out(self.norm_out(joined[:, text_tokens:], temb))


def _batched_ids(ids, batch: int) -> jax.Array:
    """[S, 4] or [B, S, 4] ids -> [B, S, 4] float32."""
    ids = jnp.asarray(ids, jnp.float32)
    chex.assert_rank(ids, {2, 3})
    return jnp.broadcast_to(ids, (batch, *ids.shape[-2:])) if ids.ndim == 2 else ids


def _scaled(values, batch: int) -> jax.Array:
    """[B] (or a scalar) in [0, 1] -> [B] float32 x1000, as diffusers' forward scales them."""
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    return jnp.broadcast_to(values, (batch,)) * TIMESTEP_SCALE


def transformer_module(config: dict, dtype=jnp.float32, **options) -> Flux2Transformer:
    """The FLUX.2 transformer of a diffusers `transformer/config.json` dict; keys starting with
    `_` are metadata and ignored, `options` set the non-config fields (`param_dtype`,
    `attention`, `remat`, `scan_layers`). Raises a one-sentence ValueError for keys or values
    this module does not implement."""
    axes = {"axes_dims_rope": tuple}
    return module_from_config(Flux2Transformer, config, dtype, options, axes)


def params_from_state_dict(module: Flux2Transformer, state: Mapping[str, np.ndarray]) -> dict:
    """The params of `module` from a diffusers `Flux2Transformer2DModel` state dict of numpy
    arrays, stacked where the module scans its blocks; ParamTreeMismatch (one sentence naming
    the missing, unexpected and mis-shaped keys) when the dict does not fit the config."""
    return dit_layers.params_from_state_dict(module, state)


def state_dict_from_params(params: Mapping) -> dict[str, np.ndarray]:
    """The diffusers state dict (PyTorch names and layouts, numpy) of the params, scanned or
    not."""
    return dit_layers.state_dict_from_params(params, MODULE_LISTS)


# The released `transformer/config.json` values, as diffusers' converter writes them
# (huggingface/diffusers, scripts/convert_flux2_to_diffusers.py, `get_flux2_transformer_config`:
# "flux2-dev" for black-forest-labs/FLUX.2-dev, "klein-4b" and "klein-9b" for
# black-forest-labs/FLUX.2-klein-4B and -9B). The converter's FLUX.2-dev dict leaves
# `guidance_embeds` at the class default, True. Parameters: 32.2B, 3.88B and 9.08B.
_COMMON = {
    "_class_name": "Flux2Transformer2DModel",
    "patch_size": 1,
    "in_channels": 128,
    "out_channels": None,
    "attention_head_dim": 128,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],
    "rope_theta": 2000,
    "eps": 1e-6,
}
RELEASED_CONFIGS = {
    "flux2-dev": {
        **_COMMON,
        "num_layers": 8,
        "num_single_layers": 48,
        "num_attention_heads": 48,
        "joint_attention_dim": 15360,
        "guidance_embeds": True,
    },
    "flux2-klein-4b": {
        **_COMMON,
        "num_layers": 5,
        "num_single_layers": 20,
        "num_attention_heads": 24,
        "joint_attention_dim": 7680,
        "guidance_embeds": False,
    },
    "flux2-klein-9b": {
        **_COMMON,
        "num_layers": 8,
        "num_single_layers": 24,
        "num_attention_heads": 32,
        "joint_attention_dim": 12288,
        "guidance_embeds": False,
    },
}


def builtin_config(name: str) -> dict:
    """A copy of the released `transformer/config.json` of `name` (a RELEASED_CONFIGS key);
    a one-sentence ValueError names the known ones otherwise."""
    if name not in RELEASED_CONFIGS:
        raise ValueError(
            f"No released FLUX.2 transformer config {name!r}; known: "
            f"{', '.join(sorted(RELEASED_CONFIGS))}."
        )
    return {k: list(v) if isinstance(v, list) else v for k, v in RELEASED_CONFIGS[name].items()}
