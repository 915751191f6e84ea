"""The layers of a Stable Diffusion UNet in Flax: the timestep sinusoid, the resnet block, 2x
up/downsampling, the attention, the spatial transformer and the attention-free down/up blocks.

Module and attribute names are those of diffusers' Flax UNet (`resnets_0/conv1/kernel`,
`attn1/to_q/kernel`, `time_embedding/linear_1/kernel`, ...), so a UNet built from these holds
the parameter tree its checkpoints, the shipped tiny weights and `weights.convert` expect, and
`init` draws the same values from the same key. Each layer computes what diffusers' Flax
layer of the same role computes, operation for operation (the same values in float32 and
bfloat16). Two things differ between that Flax UNet and the PyTorch one SD was trained as,
both in the spatial transformer, and are options here: the GELU of GEGLU (PyTorch: exact erf;
Flax: tanh-approximate) and the epsilon of the transformer's input GroupNorm (1e-6; 1e-5).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

SAVED = "attention_out"  # what the "block_save_attention" remat policy keeps
GROUPS = 32  # every GroupNorm of the UNet
NORM_EPS = 1e-5  # every GroupNorm but the spatial transformer's input one
TRANSFORMER_NORM_EPS = 1e-6  # PyTorch's Transformer2DModel input GroupNorm
MAX_TIMESCALE = 1.0e4
# Keys per chunk of the memory-efficient attention: SD's longest sequence (4096 latent tokens
# at 512 px, 16384 at 1024 px) is one chunk.
KEY_CHUNK = 4096 * 4


def timestep_sinusoid(
    timesteps: jax.Array, dim: int, flip_sin_to_cos: bool = True, freq_shift: float = 0
) -> jax.Array:
    """[N] timesteps -> [N, dim] float32 features: sin and cos of t at `dim / 2` frequencies
    falling geometrically from 1 to about 1/MAX_TIMESCALE (cos first with `flip_sin_to_cos`).
    The frequencies are float32 `exp` of float32 exponents, as the Flax UNet computes them."""
    if timesteps.ndim != 1 or dim % 2:
        raise ValueError(f"timesteps must be [N] and dim even, got {timesteps.shape} and {dim}.")
    half = dim // 2
    step = math.log(MAX_TIMESCALE) / (half - freq_shift)
    frequencies = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -step)
    angles = timesteps[:, None] * frequencies[None, :]
    parts = (jnp.cos(angles), jnp.sin(angles))
    return jnp.concatenate(parts if flip_sin_to_cos else parts[::-1], axis=1)


def _conv(features: int, dtype, kernel: int = 3, stride: int = 1) -> nn.Conv:
    """A square convolution, "same"-padded for kernel 3 (a 1x1 one has no padding)."""
    padding = ((1, 1), (1, 1)) if kernel == 3 else "VALID"
    return nn.Conv(
        features,
        kernel_size=(kernel, kernel),
        strides=(stride, stride),
        padding=padding,
        dtype=dtype,
    )


class ResnetBlock2D(nn.Module):
    """GroupNorm, SiLU, 3x3 conv, plus the projected time embedding; GroupNorm, SiLU, dropout,
    3x3 conv; plus the input (through a 1x1 conv when the widths differ). NHWC."""

    in_channels: int
    out_channels: int | None = None  # None: in_channels
    dropout_prob: float = 0.0
    use_nin_shortcut: bool | None = None  # None: when the widths differ
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        width = self.in_channels if self.out_channels is None else self.out_channels
        self.norm1 = nn.GroupNorm(num_groups=GROUPS, epsilon=NORM_EPS)
        self.conv1 = _conv(width, self.dtype)
        self.time_emb_proj = nn.Dense(width, dtype=self.dtype)
        self.norm2 = nn.GroupNorm(num_groups=GROUPS, epsilon=NORM_EPS)
        self.dropout = nn.Dropout(self.dropout_prob)
        self.conv2 = _conv(width, self.dtype)
        shortcut = self.use_nin_shortcut
        if shortcut is None:
            shortcut = self.in_channels != width
        self.conv_shortcut = _conv(width, self.dtype, kernel=1) if shortcut else None

    def __call__(self, hidden_states, temb, deterministic=True):
        residual = hidden_states
        hidden_states = self.conv1(nn.silu(self.norm1(hidden_states)))
        hidden_states = hidden_states + self.time_emb_proj(nn.silu(temb))[:, None, None, :]
        hidden_states = nn.silu(self.norm2(hidden_states))
        hidden_states = self.conv2(self.dropout(hidden_states, deterministic))
        if self.conv_shortcut is not None:
            residual = self.conv_shortcut(residual)
        return hidden_states + residual


class Downsample2D(nn.Module):
    """A 3x3 convolution of stride 2: half the height and width."""

    out_channels: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.conv = _conv(self.out_channels, self.dtype, stride=2)

    def __call__(self, hidden_states):
        return self.conv(hidden_states)


class Upsample2D(nn.Module):
    """Nearest-neighbour 2x resize, then a 3x3 convolution."""

    out_channels: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.conv = _conv(self.out_channels, self.dtype)

    def __call__(self, hidden_states):
        batch, height, width, channels = hidden_states.shape
        larger = (batch, 2 * height, 2 * width, channels)
        return self.conv(jax.image.resize(hidden_states, shape=larger, method="nearest"))


# ---------------------------------------------------------------------------------------------
# Attention.


def _chunk_summary(query, key, value):
    """One key chunk's unnormalised attention: (exp-weighted values [q, h, d], the weights'
    sums [q, h], the scores' row maxima [q, h]), for [q, h, d] query and [k, h, d] keys and
    values (`query` already scaled)."""
    scores = jnp.einsum("qhd,khd->qhk", query, key, precision=jax.lax.Precision.HIGHEST)
    # The maximum only keeps exp in range; it cancels in the result, so no gradient through it.
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    weights = jnp.exp(scores - row_max)
    values = jnp.einsum("khd,qhk->qhd", value, weights, precision=jax.lax.Precision.HIGHEST)
    return values, weights.sum(axis=-1), jnp.einsum("qhk->qh", row_max)


# Recomputed in the backward pass, so the [q, h, k] weights are never kept.
_chunk_summary_remat = jax.checkpoint(_chunk_summary, prevent_cse=False)


def _query_chunk_attention(query, key, value, key_chunk: int):
    """Softmax attention of a [q, h, d] query chunk over all keys, `key_chunk` keys at a time,
    the chunks' partial sums rescaled to their common maximum."""
    length, heads, dim = key.shape
    key_chunk = min(key_chunk, length)
    query = query / jnp.sqrt(dim)

    def summarize(start):
        keys = jax.lax.dynamic_slice(key, (start, 0, 0), (key_chunk, heads, dim))
        values = jax.lax.dynamic_slice(value, (start, 0, 0), (key_chunk, heads, value.shape[-1]))
        return _chunk_summary_remat(query, keys, values)

    values, sums, maxima = jax.lax.map(summarize, jnp.arange(0, length, key_chunk))
    rescale = jnp.exp(maxima - jnp.max(maxima, axis=0, keepdims=True))
    values = values * rescale[..., None]
    sums = sums * rescale
    return values.sum(axis=0) / sums[..., None].sum(axis=0)


def memory_efficient_attention(query, key, value, query_chunk: int, key_chunk: int = KEY_CHUNK):
    """Softmax(q k^T / sqrt(d)) v over [length, heads, dim] arrays, `query_chunk` queries (a
    divisor of the query length) and `key_chunk` keys at a time: no [heads, Lq, Lk] scores
    live at once, forward or backward."""
    length, heads, dim = query.shape

    def step(start, _):
        chunk = jax.lax.dynamic_slice(query, (start, 0, 0), (min(query_chunk, length), heads, dim))
        return start + query_chunk, _query_chunk_attention(chunk, key, value, key_chunk)

    _, chunks = jax.lax.scan(step, 0, None, length=math.ceil(length / query_chunk))
    return chunks.reshape(-1, *chunks.shape[2:])


def _query_chunk_size(length: int) -> int:
    """The memory-efficient attention's query chunk: 1/64, 1/16 or 1/4 of the tokens, the
    first of those that divides them (else all)."""
    for parts in (64, 16, 4):
        if length % parts == 0:
            return length // parts
    return length


class Attention(nn.Module):
    """Multi-head attention of `query_dim`-wide tokens over a context (itself when None):
    bias-free q, k, v projections, softmax(q k^T / sqrt(dim_head)) v, an output projection.

    The heads run folded into the batch, or as their own axis (`split_head_dim`, often faster
    for SD2.x and SDXL), or query-chunked (`use_memory_efficient_attention`: the scores are
    never whole)."""

    query_dim: int
    heads: int = 8
    dim_head: int = 64
    dropout: float = 0.0
    use_memory_efficient_attention: bool = False
    split_head_dim: bool = False
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        inner = self.heads * self.dim_head
        self.to_q = nn.Dense(inner, use_bias=False, dtype=self.dtype)
        self.to_k = nn.Dense(inner, use_bias=False, dtype=self.dtype)
        self.to_v = nn.Dense(inner, use_bias=False, dtype=self.dtype)
        self.to_out_0 = nn.Dense(self.query_dim, dtype=self.dtype)
        self.dropout_layer = nn.Dropout(rate=self.dropout)

    def _heads_into_batch(self, x):  # [B, L, H*D] -> [B*H, L, D]
        batch, length, _ = x.shape
        x = x.reshape(batch, length, self.heads, self.dim_head).transpose(0, 2, 1, 3)
        return x.reshape(batch * self.heads, length, self.dim_head)

    def _heads_out_of_batch(self, x):  # [B*H, L, D] -> [B, L, H*D]
        folded, length, _ = x.shape
        x = x.reshape(folded // self.heads, self.heads, length, self.dim_head)
        return x.transpose(0, 2, 1, 3).reshape(folded // self.heads, length, -1)

    def _attend(self, query, key, value):
        """[B, L, H*D] projections -> [B, Lq, H*D] attended values."""
        scale = self.dim_head**-0.5
        if self.use_memory_efficient_attention:
            # The chunked kernel takes [length, heads, dim]: the folded batch is its heads.
            query, key, value = (
                self._heads_into_batch(x).transpose(1, 0, 2) for x in (query, key, value)
            )
            chunk = _query_chunk_size(query.shape[0])
            attended = memory_efficient_attention(query, key, value, chunk)
            return self._heads_out_of_batch(attended.transpose(1, 0, 2))
        if self.split_head_dim:  # [B, L, H, D]
            query, key, value = (
                x.reshape(x.shape[0], -1, self.heads, self.dim_head) for x in (query, key, value)
            )
            scores = jnp.einsum("bknd,bqnd->bnqk", key, query) * scale
            probs = nn.softmax(scores, axis=-1)
            attended = jnp.einsum("bnqk,bknd->bqnd", probs, value)
            return attended.reshape(attended.shape[0], -1, self.heads * self.dim_head)
        query, key, value = map(self._heads_into_batch, (query, key, value))  # [B*H, L, D]
        scores = jnp.einsum("bqd,bkd->bqk", query, key) * scale
        probs = nn.softmax(scores, axis=2)
        return self._heads_out_of_batch(jnp.einsum("bqk,bkd->bqd", probs, value))

    def __call__(self, hidden_states, context=None, deterministic=True):
        context = hidden_states if context is None else context
        query = self.to_q(hidden_states)
        attended = self._attend(query, self.to_k(context), self.to_v(context))
        return self.dropout_layer(self.to_out_0(attended), deterministic=deterministic)


# ---------------------------------------------------------------------------------------------
# The spatial transformer.


class GEGLU(nn.Module):
    """A dense layer to twice 4x the width, its first half gated by the GELU of its second
    (exact erf GELU, or tanh-approximate with `approximate`)."""

    dim: int
    dropout: float = 0.0
    dtype: jnp.dtype = jnp.float32
    approximate: bool = False

    def setup(self):
        self.proj = nn.Dense(self.dim * 4 * 2, dtype=self.dtype)
        self.dropout_layer = nn.Dropout(rate=self.dropout)

    def __call__(self, hidden_states, deterministic=True):
        hidden_linear, hidden_gelu = jnp.split(self.proj(hidden_states), 2, axis=2)
        gated = hidden_linear * nn.gelu(hidden_gelu, approximate=self.approximate)
        return self.dropout_layer(gated, deterministic=deterministic)


class FeedForward(nn.Module):
    """GEGLU, then a dense layer back to `dim` (`net_2`, as PyTorch's Sequential index)."""

    dim: int
    dropout: float = 0.0
    dtype: jnp.dtype = jnp.float32
    gelu_approximate: bool = False

    def setup(self):
        self.net_0 = GEGLU(self.dim, self.dropout, self.dtype, self.gelu_approximate)
        self.net_2 = nn.Dense(self.dim, dtype=self.dtype)

    def __call__(self, hidden_states, deterministic=True):
        return self.net_2(self.net_0(hidden_states, deterministic=deterministic))


class BasicTransformerBlock(nn.Module):
    """Self-attention, cross-attention to the text, feed-forward; each pre-norm, residual."""

    dim: int
    n_heads: int
    d_head: int
    dropout: float = 0.0
    only_cross_attention: bool = False
    dtype: jnp.dtype = jnp.float32
    use_memory_efficient_attention: bool = False
    split_head_dim: bool = False
    gelu_approximate: bool = False

    def setup(self):
        attention = dict(
            query_dim=self.dim,
            heads=self.n_heads,
            dim_head=self.d_head,
            dropout=self.dropout,
            use_memory_efficient_attention=self.use_memory_efficient_attention,
            split_head_dim=self.split_head_dim,
            dtype=self.dtype,
        )
        self.attn1 = Attention(**attention)
        self.attn2 = Attention(**attention)
        self.ff = FeedForward(self.dim, self.dropout, self.dtype, self.gelu_approximate)
        self.norm1 = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)
        self.norm2 = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)
        self.norm3 = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)
        self.dropout_layer = nn.Dropout(rate=self.dropout)

    def __call__(self, hidden_states, context, deterministic=True):
        self_context = context if self.only_cross_attention else None
        # The attentions' outputs are named for the "block_save_attention" remat policy.
        normed = self.norm1(hidden_states)
        attended = checkpoint_name(self.attn1(normed, self_context, deterministic), SAVED)
        hidden_states = hidden_states + attended
        normed = self.norm2(hidden_states)
        attended = checkpoint_name(self.attn2(normed, context, deterministic), SAVED)
        hidden_states = hidden_states + attended
        normed = self.norm3(hidden_states)
        hidden_states = hidden_states + self.ff(normed, deterministic=deterministic)
        return self.dropout_layer(hidden_states, deterministic=deterministic)


class Transformer2D(nn.Module):
    """The spatial transformer: GroupNorm (`norm_eps`), project in, `depth` transformer blocks
    over the H*W tokens, project out, plus the input."""

    in_channels: int
    n_heads: int
    d_head: int
    depth: int = 1
    dropout: float = 0.0
    use_linear_projection: bool = False
    only_cross_attention: bool = False
    dtype: jnp.dtype = jnp.float32
    use_memory_efficient_attention: bool = False
    split_head_dim: bool = False
    gelu_approximate: bool = False
    norm_eps: float = TRANSFORMER_NORM_EPS

    def setup(self):
        self.norm = nn.GroupNorm(num_groups=GROUPS, epsilon=self.norm_eps)
        inner_dim = self.n_heads * self.d_head
        if self.use_linear_projection:
            self.proj_in = nn.Dense(inner_dim, dtype=self.dtype)
            self.proj_out = nn.Dense(inner_dim, dtype=self.dtype)
        else:
            self.proj_in = _conv(inner_dim, self.dtype, kernel=1)
            self.proj_out = _conv(inner_dim, self.dtype, kernel=1)
        self.transformer_blocks = [
            BasicTransformerBlock(
                inner_dim,
                self.n_heads,
                self.d_head,
                dropout=self.dropout,
                only_cross_attention=self.only_cross_attention,
                dtype=self.dtype,
                use_memory_efficient_attention=self.use_memory_efficient_attention,
                split_head_dim=self.split_head_dim,
                gelu_approximate=self.gelu_approximate,
            )
            for _ in range(self.depth)
        ]
        self.dropout_layer = nn.Dropout(rate=self.dropout)

    def __call__(self, hidden_states, context, deterministic=True):
        batch, height, width, channels = hidden_states.shape
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        if self.use_linear_projection:
            hidden_states = self.proj_in(hidden_states.reshape(batch, height * width, channels))
        else:
            hidden_states = self.proj_in(hidden_states).reshape(batch, height * width, channels)
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, context, deterministic=deterministic)
        if self.use_linear_projection:
            hidden_states = self.proj_out(hidden_states).reshape(batch, height, width, channels)
        else:
            hidden_states = self.proj_out(hidden_states.reshape(batch, height, width, channels))
        return self.dropout_layer(hidden_states + residual, deterministic=deterministic)


# ---------------------------------------------------------------------------------------------
# The attention-free blocks.


class DownBlock2D(nn.Module):
    """`num_layers` resnets, then an optional 2x downsample; returns (output, every resnet's
    and the downsample's output for the up path's skips)."""

    in_channels: int
    out_channels: int
    dropout: float = 0.0
    num_layers: int = 1
    add_downsample: bool = True
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.resnets = [
            ResnetBlock2D(
                self.in_channels if i == 0 else self.out_channels,
                self.out_channels,
                dropout_prob=self.dropout,
                dtype=self.dtype,
            )
            for i in range(self.num_layers)
        ]
        if self.add_downsample:
            self.downsamplers_0 = Downsample2D(self.out_channels, dtype=self.dtype)

    def __call__(self, hidden_states, temb, deterministic=True):
        skips = ()
        for resnet in self.resnets:
            hidden_states = resnet(hidden_states, temb, deterministic=deterministic)
            skips += (hidden_states,)
        if self.add_downsample:
            hidden_states = self.downsamplers_0(hidden_states)
            skips += (hidden_states,)
        return hidden_states, skips


def up_resnet_inputs(block) -> list[int]:
    """The input width of each resnet of an up block: the previous layer's output (the
    block below's for the first) plus the skip it concatenates (the down path's, last first)."""
    widths = []
    for i in range(block.num_layers):
        skip = block.in_channels if i == block.num_layers - 1 else block.out_channels
        below = block.prev_output_channel if i == 0 else block.out_channels
        widths.append(below + skip)
    return widths


class UpBlock2D(nn.Module):
    """`num_layers` x (concatenate a skip, resnet), then an optional 2x upsample."""

    in_channels: int
    out_channels: int
    prev_output_channel: int
    dropout: float = 0.0
    num_layers: int = 1
    add_upsample: bool = True
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.resnets = [
            ResnetBlock2D(width, self.out_channels, dropout_prob=self.dropout, dtype=self.dtype)
            for width in up_resnet_inputs(self)
        ]
        if self.add_upsample:
            self.upsamplers_0 = Upsample2D(self.out_channels, dtype=self.dtype)

    def __call__(self, hidden_states, res_hidden_states_tuple, temb, deterministic=True):
        skips = res_hidden_states_tuple
        for resnet in self.resnets:
            hidden_states = jnp.concatenate((hidden_states, skips[-1]), axis=-1)
            skips = skips[:-1]
            hidden_states = resnet(hidden_states, temb, deterministic=deterministic)
        if self.add_upsample:
            hidden_states = self.upsamplers_0(hidden_states)
        return hidden_states
