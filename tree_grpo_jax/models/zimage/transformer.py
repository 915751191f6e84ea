"""Z-Image's denoiser in Flax, computing what diffusers' PyTorch `ZImageTransformer2DModel`
computes (its text-to-image mode; the Omni variant's SigLIP inputs are refused).

Latents [B, C, H, W] are cut into p x p patches (values ordered row, column, channel) and
embedded (`all_x_embedder/<p>-1`); the caption's hidden states are RMS-normalised and
embedded (`cap_embedder`). Each sequence is padded to a multiple of 32 tokens with a learned
pad token (`x_pad_token`, `cap_pad_token`), and those pad tokens take part in attention. The
image tokens run through `noise_refiner` (blocks modulated by the timestep), the caption
through `context_refiner` (unmodulated), then the joined [image, caption] sequence through
`layers`; `all_final_layer` maps the image tokens back to patches. Every block is attention
with RMS qk-norm and a 3-axis RoPE, then a SwiGLU feed-forward, each branch RMS-normed on the
way in and out; a modulated block scales the inputs by (1 + scale) and gates the outputs by
tanh(gate), four vectors projected from the timestep embedding.

Positions (`position_ids`): caption token j sits at (1 + j, 0, 0); the image's token at patch
(r, c) at (1 + padded caption length, r, c); image pad tokens at (0, 0, 0). The rotary angle
of each axis is read from a table over `axes_lens` positions, as diffusers builds it (float64
angles rounded to float32).

Captions come as a padded batch [B, L, cap_feat_dim] and a mask [B, L]: row b's valid tokens
(the mask's True entries, in order) are what the pipeline passes as its b-th embedding. They
are gathered to the front; the rest of the row, beyond that caption's 32-multiple, is left
out of every attention, so each row computes what diffusers computes for it alone.

Module and attribute names are diffusers' with list indices merged (`layers_3/attention/to_q`,
`noise_refiner_0/adaLN_modulation_0`, `t_embedder/mlp_2`, `cap_embedder_1`), so
`convert.pytorch_to_flax` maps a diffusers `transformer/` state dict onto these params with no
table (`params_from_state_dict`, which also stacks scanned blocks).

Activations run in `dtype` (float32 or bfloat16) with float32 `param_dtype`; norms, RoPE and
the timestep features are computed in float32 and rounded to `dtype`. Against the PyTorch
model in float32 on CPU (tests/parity/test_zimage_transformer.py: a tiny random model, 8x8
and 6x10 latents, captions of 5 and 37 tokens, outputs of scale ~2.4) the largest difference
is 1.9e-6 of the scale, blocks scanned or not; 3/4 of it comes from the timestep sinusoid,
whose float32 frequencies differ from PyTorch's `exp` by one ulp at 3 of 128 (times t * 1000
in the angle). bfloat16 compute with float32 params is within 1.1% of float32.
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
    DiT,
    Layer,
    RMSNorm,
    layer_norm,
    module_from_config,
    rotate_pairs,
    run_stack,
    timestep_features,
)
from tree_grpo_jax.models.zimage import family

ADALN_WIDTH = 256  # the timestep embedding's width is min(dim, 256)
TIMESTEP_HIDDEN = 1024  # `t_embedder`'s hidden width
SEQUENCE_MULTIPLE = 32  # image and caption sequences are padded to multiples of this
QK_NORM_EPS = 1e-5
FINAL_NORM_EPS = 1e-6
ID_AXES = 3  # (sequence, row, column)
TRAIN_TIMESTEPS = 1000.0  # the scheduler's timesteps are sigma * 1000
# Module lists of this model, for `convert.flax_to_pytorch(params, list_names=MODULE_LISTS)`.
MODULE_LISTS = family.MODULE_LISTS


def timestep_from_sigma(sigma) -> jax.Array:
    """The model's time input of a flow sigma (1 = noise), as ZImagePipeline computes it from
    its scheduler's timestep (sigma * 1000): (1000 - timestep) / 1000, so 1 is clean."""
    timestep = jnp.asarray(sigma, jnp.float32) * TRAIN_TIMESTEPS
    return (TRAIN_TIMESTEPS - timestep) / TRAIN_TIMESTEPS


def velocity(output: jax.Array) -> jax.Array:
    """The flow velocity (noise minus data) of the model's output, which points the other way;
    ZImagePipeline negates it before its scheduler's step."""
    return -output


def padded_length(length):
    """`length` rounded up to a multiple of `SEQUENCE_MULTIPLE` (ints or int arrays)."""
    return length + (-length) % SEQUENCE_MULTIPLE


def patchify(latents: jax.Array, patch: int) -> jax.Array:
    """[B, C, H, W] -> [B, (H/p)(W/p), p p C]: tokens row-major, each patch's values ordered
    (row, column, channel), as diffusers cuts a one-frame image."""
    batch, channels, height, width = latents.shape
    rows, columns = height // patch, width // patch
    x = latents.reshape(batch, channels, rows, patch, columns, patch)
    x = jnp.transpose(x, (0, 2, 4, 3, 5, 1))
    return x.reshape(batch, rows * columns, patch * patch * channels)


def unpatchify(tokens: jax.Array, height: int, width: int, patch: int) -> jax.Array:
    """[B, (H/p)(W/p), p p C] -> [B, C, H, W], the inverse of `patchify`."""
    batch, _, features = tokens.shape
    channels = features // (patch * patch)
    x = tokens.reshape(batch, height // patch, width // patch, patch, patch, channels)
    x = jnp.transpose(x, (0, 5, 1, 3, 2, 4))
    return x.reshape(batch, channels, height, width)


@functools.cache
def rope_angle_tables(axes_dims: tuple, axes_lens: tuple, theta: float) -> tuple:
    """Per position axis, (cos, sin) [axes_lens[a], axes_dims[a] / 2] float32: the angle of
    each channel pair at each position, taken in float64 and rounded to float32 (diffusers'
    `RopeEmbedder` table)."""
    tables = []
    for dim, length in zip(axes_dims, axes_lens):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        angles = np.outer(np.arange(length, dtype=np.float64), freqs).astype(np.float32)
        angles = angles.astype(np.float64)
        tables.append((np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)))
    return tuple(tables)


def rope_lookup(ids: jax.Array, axes_dims, axes_lens, theta: float):
    """Integer position ids [..., 3] -> (cos, sin), each [..., head_dim / 2] float32. Ids past
    a table are clipped to its end (only masked caption places get there; a NaN fill would
    reach the attended tokens through their zero weights)."""
    tables = rope_angle_tables(tuple(axes_dims), tuple(axes_lens), float(theta))

    def read(table, axis):
        return jnp.take(jnp.asarray(table), ids[..., axis], axis=0, mode="clip")

    cos = [read(c, a) for a, (c, _) in enumerate(tables)]
    sin = [read(s, a) for a, (_, s) in enumerate(tables)]
    return jnp.concatenate(cos, axis=-1), jnp.concatenate(sin, axis=-1)


def caption_front(features: jax.Array, mask: jax.Array):
    """(features with each row's valid tokens gathered to the front, in order; the valid
    counts [B] int32): the padded batch laid out as the pipeline's list of embeddings."""
    order = jnp.argsort(~mask, axis=1, stable=True)
    gathered = jnp.take_along_axis(features, order[..., None], axis=1)
    return gathered, mask.sum(axis=1).astype(jnp.int32)


def position_ids(caption_lengths: jax.Array, caption_slots: int, rows: int, columns: int):
    """(image ids [B, N', 3], caption ids [caption_slots, 3]) int32 for image tokens padded to
    N' = `padded_length(rows * columns)` and `caption_slots` caption places, given each row's
    caption length: the image starts one past the caption's padded length."""
    tokens = rows * columns
    grid_rows, grid_columns = np.meshgrid(np.arange(rows), np.arange(columns), indexing="ij")
    grid = np.stack([np.zeros(tokens), grid_rows.ravel(), grid_columns.ravel()], axis=-1)
    grid = np.concatenate([grid, np.zeros((padded_length(tokens) - tokens, ID_AXES))])
    real = np.arange(len(grid)) < tokens
    start = (padded_length(caption_lengths) + 1)[:, None] * real[None]
    image = jnp.asarray(grid, jnp.int32)[None] + jnp.stack(
        [start, jnp.zeros_like(start), jnp.zeros_like(start)], axis=-1
    )
    caption = np.zeros((caption_slots, ID_AXES), np.int32)
    caption[:, 0] = 1 + np.arange(caption_slots)
    return image.astype(jnp.int32), jnp.asarray(caption)


class ZImageAttention(Attention):
    """Self-attention without biases, RMS qk-norm per head (`qk_norm`), RoPE on queries and
    keys, and an optional key mask."""

    qk_norm: bool = True

    def setup(self):
        width = self.width
        dense = functools.partial(self.dense, use_bias=False)
        self.to_q, self.to_k, self.to_v = dense(width), dense(width), dense(width)
        if self.qk_norm:
            self.norm_q = RMSNorm(eps=QK_NORM_EPS, **self.dtypes)
            self.norm_k = RMSNorm(eps=QK_NORM_EPS, **self.dtypes)
        self.to_out_0 = dense(width)

    def __call__(self, x, rope, mask=None):
        query, key = self._heads(self.to_q(x)), self._heads(self.to_k(x))
        value = self._heads(self.to_v(x))
        if self.qk_norm:
            query, key = self.norm_q(query), self.norm_k(key)
        query, key = rotate_pairs(query, *rope), rotate_pairs(key, *rope)
        return self.to_out_0(self._attend(query, key, value, mask))


class SwiGLUFeedForward(Layer):
    """w2(silu(w1 x) * w3 x), without biases."""

    dim: int = 1
    hidden: int = 1

    def setup(self):
        dense = functools.partial(self.dense, use_bias=False)
        self.w1, self.w3, self.w2 = dense(self.hidden), dense(self.hidden), dense(self.dim)

    def __call__(self, x):
        return self.w2(nn.silu(self.w1(x)) * self.w3(x))


class ZImageTransformerBlock(Layer):
    """Attention then feed-forward, each between two RMSNorms; with `modulation`, the inputs
    scaled by (1 + scale) and the residuals gated by tanh(gate), from the timestep
    embedding. Called (x, rope, mask[, adaln]) -> x. (Not a `Block`: diffusers names the
    attention sub-module `attention`, the field a `Block` holds the backend's name in.)"""

    dim: int = 1
    heads: int = 1
    head_dim: int = 1
    backend: str = "xla"  # model.attention: a `models.attention` backend name
    modulation: bool = True
    norm_eps: float = 1e-5
    qk_norm: bool = True

    def setup(self):
        norm = functools.partial(RMSNorm, eps=self.norm_eps, **self.dtypes)
        self.attention = ZImageAttention(
            heads=self.heads,
            head_dim=self.head_dim,
            attention=self.backend,
            qk_norm=self.qk_norm,
            **self.dtypes,
        )
        self.feed_forward = SwiGLUFeedForward(
            dim=self.dim, hidden=int(self.dim / 3 * 8), **self.dtypes
        )
        self.attention_norm1, self.attention_norm2 = norm(), norm()
        self.ffn_norm1, self.ffn_norm2 = norm(), norm()
        if self.modulation:
            self.adaLN_modulation_0 = self.dense(4 * self.dim)

    def __call__(self, x, rope, mask, adaln=None):
        if not self.modulation:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), rope, mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_msa, gate_msa, scale_mlp, gate_mlp = jnp.split(
            self.adaLN_modulation_0(adaln)[:, None], 4, axis=-1
        )
        attended = self.attention(self.attention_norm1(x) * (1 + scale_msa), rope, mask)
        x = x + jnp.tanh(gate_msa) * self.attention_norm2(attended)
        fed = self.feed_forward(self.ffn_norm1(x) * (1 + scale_mlp))
        return x + jnp.tanh(gate_mlp) * self.ffn_norm2(fed)


class TimestepEmbedder(Layer):
    """Sinusoidal features (256, cos then sin) -> dense, SiLU, dense (`mlp.0`, `mlp.2`)."""

    width: int = 1

    def setup(self):
        self.mlp_0 = self.dense(TIMESTEP_HIDDEN)
        self.mlp_2 = self.dense(self.width)

    def __call__(self, values):
        return self.mlp_2(nn.silu(self.mlp_0(timestep_features(values).astype(self.dtype))))


class FinalLayer(Layer):
    """LayerNorm without affine, scaled by (1 + SiLU-dense of the timestep embedding), then
    `linear` to a patch's values."""

    features: int = 1

    @nn.compact
    def __call__(self, x, adaln):
        scale = self.dense(x.shape[-1], name="adaLN_modulation_1")(nn.silu(adaln))
        return self.dense(self.features, name="linear")(
            layer_norm(x, FINAL_NORM_EPS) * (1 + scale[:, None])
        )


class PatchKeyed(Layer):
    """diffusers' ModuleDicts keyed by "<patch>-<frame patch>": the one sub-module under
    `key`, a dense (`final=False`) or a `FinalLayer`."""

    key: str = "2-1"
    features: int = 1
    final: bool = False

    @nn.compact
    def __call__(self, x, adaln=None):
        if self.final:
            return FinalLayer(features=self.features, name=self.key, **self.dtypes)(x, adaln)
        return self.dense(self.features, name=self.key)(x)


class ZImageTransformer(DiT):
    """Z-Image's transformer: `(latents [B, C, H, W], timestep [B] (diffusers' t: 1 - sigma,
    see `timestep_from_sigma`), caption_features [B, L, cap_feat_dim], caption_mask [B, L]
    bool (None: all valid)) -> [B, C, H, W]`, in the compute `dtype`; `velocity` turns the
    output into the flow's velocity. Every row needs at least one valid caption token. The
    fields are diffusers' `transformer/config.json` fields (`n_kv_heads` is unused there too).
    """

    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    siglip_feat_dim: int | None = None
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1024, 512, 512)
    param_dtype: jnp.dtype = jnp.float32

    @property
    def patch(self) -> int:
        return self.all_patch_size[0]

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check(self) -> None:
        """Raises a one-sentence ValueError for field values this module does not implement."""
        if self.siglip_feat_dim is not None:
            raise ValueError("siglip_feat_dim is set (Z-Image Omni), which is not supported.")
        if tuple(self.all_patch_size) != (self.patch,) or tuple(self.all_f_patch_size) != (1,):
            raise ValueError(
                f"all_patch_size {list(self.all_patch_size)} and all_f_patch_size "
                f"{list(self.all_f_patch_size)} must be one patch size with frame patch 1."
            )
        axes, lens = tuple(self.axes_dims), tuple(self.axes_lens)
        if len(axes) != ID_AXES or len(lens) != ID_AXES or any(d <= 0 or d % 2 for d in axes):
            raise ValueError(
                f"axes_dims {list(axes)} must be {ID_AXES} positive even sizes, with "
                f"{ID_AXES} axes_lens."
            )
        if self.dim % self.n_heads or sum(axes) != self.head_dim:
            raise ValueError(
                f"axes_dims {list(axes)} add up to {sum(axes)}, not the head width "
                f"dim / n_heads ({self.dim} / {self.n_heads})."
            )
        self.check_dtype()
        self.check_runtime()

    def example_inputs(self) -> tuple:
        p = self.patch
        return (
            jnp.zeros((1, self.in_channels, p, p), jnp.float32),
            jnp.zeros((1,), jnp.float32),
            jnp.zeros((1, 1, self.cap_feat_dim), jnp.float32),
            jnp.ones((1, 1), bool),
        )

    def setup(self):
        self.check()
        dim, layer = self.dim, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        key = f"{self.patch}-1"
        self.all_x_embedder = PatchKeyed(key=key, features=dim, **layer)
        self.all_final_layer = PatchKeyed(
            key=key, features=self.patch**2 * self.in_channels, final=True, **layer
        )
        self.t_embedder = TimestepEmbedder(width=min(dim, ADALN_WIDTH), **layer)
        self.cap_embedder_0 = RMSNorm(eps=self.norm_eps, **layer)
        self.cap_embedder_1 = nn.Dense(dim, **layer)
        self.x_pad_token = self.param("x_pad_token", nn.initializers.zeros, (1, dim))
        self.cap_pad_token = self.param("cap_pad_token", nn.initializers.zeros, (1, dim))
        block = dict(
            dim=dim,
            heads=self.n_heads,
            head_dim=self.head_dim,
            backend=self.attention,
            norm_eps=self.norm_eps,
            qk_norm=self.qk_norm,
            **layer,
        )
        refiners = [{}] * self.n_refiner_layers
        stack = functools.partial(self.block_stack, ZImageTransformerBlock)
        self.noise_refiner = stack(refiners, dict(block, modulation=True), 3)
        self.context_refiner = stack(refiners, dict(block, modulation=False), 2)
        self.layers = stack([{}] * self.n_layers, dict(block, modulation=True), 3)

    def __call__(self, latents, timestep, caption_features, caption_mask=None):
        chex.assert_rank([latents, caption_features], [4, 3])
        chex.assert_axis_dimension(latents, 1, self.in_channels)
        chex.assert_axis_dimension(caption_features, 2, self.cap_feat_dim)
        chex.assert_equal_shape_prefix([latents, caption_features], prefix_len=1)
        batch, _, height, width = latents.shape
        if height % self.patch or width % self.patch:
            raise ValueError(
                f"Latents {height}x{width} do not tile into {self.patch}x{self.patch} patches."
            )
        if caption_mask is None:
            caption_mask = jnp.ones(caption_features.shape[:2], bool)
        chex.assert_shape(caption_mask, caption_features.shape[:2])
        timestep = jnp.broadcast_to(jnp.asarray(timestep, jnp.float32).reshape(-1), (batch,))
        adaln = self.t_embedder(timestep * jnp.float32(self.t_scale))

        # Caption: valid tokens first, then the pad token up to its 32-multiple; the places
        # past that multiple are left out of attention.
        features, lengths = caption_front(jnp.asarray(caption_features), caption_mask)
        slots = padded_length(features.shape[1])
        features = jnp.pad(features, ((0, 0), (0, slots - features.shape[1]), (0, 0)))
        place = jnp.arange(slots)[None]
        caption = self.cap_embedder_1(self.cap_embedder_0(features))
        caption = jnp.where((place < lengths[:, None])[..., None], caption, self.cap_pad_token)
        caption = caption.astype(self.dtype)
        caption_keys = (place < padded_length(lengths)[:, None])[:, None, None, :]

        # Image: patches then the pad token up to its 32-multiple, all attended.
        rows, columns = height // self.patch, width // self.patch
        tokens = self.all_x_embedder(patchify(latents.astype(self.dtype), self.patch))
        pads = padded_length(rows * columns) - rows * columns
        pad_tokens = jnp.broadcast_to(self.x_pad_token.astype(self.dtype), (batch, pads, self.dim))
        image = jnp.concatenate([tokens, pad_tokens], axis=1)

        image_ids, caption_ids = position_ids(lengths, slots, rows, columns)
        rope = functools.partial(
            rope_lookup, axes_dims=self.axes_dims, axes_lens=self.axes_lens, theta=self.rope_theta
        )
        image_rope = rope(image_ids)
        caption_rope = tuple(
            jnp.broadcast_to(t[None], (batch, *t.shape)) for t in rope(caption_ids)
        )

        (image,) = run_stack(self.noise_refiner, (image,), image_rope, None, adaln)
        (caption,) = run_stack(self.context_refiner, (caption,), caption_rope, caption_keys)

        joined = jnp.concatenate([image, caption], axis=1)
        joined_rope = tuple(jnp.concatenate(pair, axis=1) for pair in zip(image_rope, caption_rope))
        image_keys = jnp.ones((batch, 1, 1, image.shape[1]), bool)
        joined_keys = jnp.concatenate([image_keys, caption_keys], axis=-1)
        (joined,) = run_stack(self.layers, (joined,), joined_rope, joined_keys, adaln)

        out = self.all_final_layer(joined[:, : rows * columns], adaln)
        return unpatchify(out, height, width, self.patch)


def transformer_module(config: dict, dtype=jnp.float32, **options) -> ZImageTransformer:
    """The Z-Image transformer of a diffusers `transformer/config.json` dict; keys starting
    with `_` are metadata and ignored, `options` set the non-config fields (`param_dtype`,
    `attention`, `remat`, `scan_layers`). Raises a one-sentence ValueError for keys or values
    this module does not implement."""
    lists = {k: tuple for k in ("all_patch_size", "all_f_patch_size", "axes_dims", "axes_lens")}
    return module_from_config(ZImageTransformer, config, dtype, options, lists)


def params_from_state_dict(module: ZImageTransformer, state: Mapping[str, np.ndarray]) -> dict:
    """The params of `module` from a diffusers state dict of numpy arrays, blocks stacked
    where the module scans them (`dit_layers.params_from_state_dict`)."""
    return dit_layers.params_from_state_dict(module, state)


def state_dict_from_params(params: Mapping) -> dict[str, np.ndarray]:
    """The diffusers state dict (PyTorch names and layouts, numpy) of params, scanned or
    not."""
    return dit_layers.state_dict_from_params(params, MODULE_LISTS)
