"""The layers diffusion transformers (DiTs) share, in Flax, computing what diffusers' PyTorch
layers of the same names compute: LayerNorm without affine parameters, AdaLN(-zero)
modulation, RMSNorm, the GELU-tanh feed-forward, the sinusoidal timestep features and their
embedding, and the parts every attention layer has (the head split, the fused product).

Attribute names are diffusers' with list indices merged (`ff/net_0/proj`), so a family's
model built from these keeps the param tree its weight conversion expects. Norms and the
timestep features are computed in float32 and rounded to the compute `dtype`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from tree_grpo_jax.models import attention as attention_backends
from tree_grpo_jax.models.base import (  # noqa: F401 (REMAT_MODES re-exported)
    REMAT_MODES,
    constrain_rows,
    remat_mode,
)
from tree_grpo_jax.weights import convert, low_rank, stacking

NORM_EPS = 1e-6
TIMESTEP_CHANNELS = 256
FF_MULT = 4
MAX_PERIOD = 10000
COMPUTE_DTYPES = (jnp.float32, jnp.bfloat16)
# Module fields that are run-time choices, not diffusers `config.json` keys.
RUNTIME_FIELDS = (
    "dtype",
    "param_dtype",
    "attention",
    "remat",
    "scan_layers",
)
ATTENTION_SAVED = ("attention_query", "attention_key", "attention_value", "attention_out")


def timestep_frequencies(channels: int = TIMESTEP_CHANNELS) -> np.ndarray:
    """[channels / 2] float32 frequencies of diffusers' `Timesteps` (no frequency shift):
    PyTorch's float32 exponents, exponentiated in float64 and rounded, which lands on
    PyTorch's float32 `exp` more often than XLA's float32 `exp` does."""
    half = channels // 2
    exponents = np.float32(-math.log(MAX_PERIOD)) * np.arange(half, dtype=np.float32)
    exponents = exponents / np.float32(half)
    return np.exp(exponents.astype(np.float64)).astype(np.float32)


def timestep_features(
    values: jax.Array, channels: int = TIMESTEP_CHANNELS, scale: float = 1.0
) -> jax.Array:
    """[B] -> [B, channels] float32 sinusoidal features: cos then sin (`flip_sin_to_cos`);
    `scale` multiplies the angles after the frequencies, in PyTorch's order (`Timesteps`'
    `scale`)."""
    angles = values.astype(jnp.float32)[:, None] * jnp.asarray(timestep_frequencies(channels))
    angles = angles * scale
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def layer_norm(x: jax.Array, eps: float = NORM_EPS) -> jax.Array:
    """LayerNorm without affine parameters; statistics in float32 (two-pass variance)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def modulate(normed: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    return normed * (1 + scale[:, None]) + shift[:, None]


def gated_feed_forward(x, feed_forward: Callable, shift, scale, gate) -> jax.Array:
    """The MLP half of an AdaLN-zero block: x plus the gated feed-forward of its modulated
    norm."""
    return x + gate[:, None] * feed_forward(modulate(layer_norm(x), shift, scale))


def rope_frequencies(axes_dims, theta: float) -> list[np.ndarray]:
    """Per position-id axis, the [d / 2] float32 rotation frequencies theta^(-2i / d), taken in
    float64 as diffusers' FLUX position embeddings take them, then rounded (FLUX.1, FLUX.2)."""
    return [
        (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(np.float32)
        for dim in axes_dims
    ]


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding: each (even, odd) channel pair of x [B, S, heads, head_dim] turned by
    its angle, given as cos and sin [S, head_dim / 2] (or [B, S, head_dim / 2] where each
    row has its own positions), in float32 (diffusers' rotary embeddings with interleaved
    real and imaginary parts)."""
    chex.assert_rank(x, 4)
    chex.assert_equal_shape([cos, sin])
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    chex.assert_shape([cos, sin], (None, x.shape[1], x.shape[-1] // 2))
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


class Layer(nn.Module):
    """Base of the layers below: the compute and parameter dtypes, and a Dense using them."""

    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @property
    def dense(self):
        return functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype)

    @property
    def dtypes(self) -> dict:
        """This layer's dtypes, as keyword arguments for its sub-layers."""
        return dict(dtype=self.dtype, param_dtype=self.param_dtype)


class RMSNorm(Layer):
    """RMSNorm over the last axis with a learned scale (diffusers' `RMSNorm` weight)."""

    eps: float = NORM_EPS

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (x32 * scale.astype(jnp.float32)).astype(self.dtype)


class AdaLayerNormZero(Layer):
    """LayerNorm modulated by the conditioning: `chunks` of it, (shift, scale) then the rest
    in diffusers' order (6 for a joint block's gate, shift_mlp, scale_mlp, gate_mlp; 3 for a
    gate alone). Returns (modulated x, *rest).

    `dual` (SD3.5's `SD35AdaLayerNormZeroX`) takes 9 chunks: the last three (shift, scale,
    gate) modulate a second copy of the norm, returned in their place."""

    chunks: int = 6
    dual: bool = False

    @nn.compact
    def __call__(self, x, emb):
        chunks = 9 if self.dual else self.chunks
        emb = self.dense(chunks * x.shape[-1], name="linear")(nn.silu(emb))
        shift, scale, *rest = jnp.split(emb, chunks, axis=-1)
        normed = layer_norm(x)
        if not self.dual:
            return (modulate(normed, shift, scale), *rest)
        *rest, shift2, scale2, gate2 = rest
        return (modulate(normed, shift, scale), *rest, modulate(normed, shift2, scale2), gate2)


class AdaLayerNormContinuous(Layer):
    """LayerNorm modulated by the conditioning, with no gates; diffusers' chunk order is
    (scale, shift), the reverse of the AdaLN-zero layers'."""

    @nn.compact
    def __call__(self, x, emb):
        emb = self.dense(2 * x.shape[-1], name="linear")(nn.silu(emb))
        scale, shift = jnp.split(emb, 2, axis=-1)
        return modulate(layer_norm(x), shift, scale)


class Attention(Layer):
    """Base of the attention layers: the head split and the fused product, computed by the
    `models.attention` backend `attention` names."""

    heads: int = 1
    head_dim: int = 1
    attention: str = "xla"  # model.attention: a `models.attention` backend name

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def _heads(self, x):
        return x.reshape(*x.shape[:2], self.heads, self.head_dim)

    def _attend(self, query, key, value, mask=None):
        """[B, S, heads, head_dim] each -> [B, S, heads * head_dim]; `mask` (broadcasting to
        [B, heads, S_query, S_key], True where a query may attend a key) or None."""
        # The names let a remat policy keep these four (they are identities otherwise).
        query, key, value = (
            checkpoint_name(x, name) for x, name in zip((query, key, value), ATTENTION_SAVED)
        )
        attended = attention_backends.attention(
            query, key, value, backend=self.attention, mask=mask
        )
        attended = checkpoint_name(attended, ATTENTION_SAVED[-1])
        return attended.reshape(*attended.shape[:2], self.width)


class GELUProjection(Layer):
    """A dense layer then tanh-approximate GELU (diffusers' `GELU(approximate="tanh")`)."""

    features: int = 1

    @nn.compact
    def __call__(self, x):
        return nn.gelu(self.dense(self.features, name="proj")(x), approximate=True)


class FeedForward(Layer):
    """`net_0` (dense to `inner_dim`, default 4x, GELU-tanh) then `net_2` back, as diffusers'
    Sequential indices."""

    dim: int = 1
    inner_dim: int | None = None  # None: dim * FF_MULT (diffusers' `mult=4`)

    def setup(self):
        inner = self.inner_dim or self.dim * FF_MULT
        self.net_0 = GELUProjection(features=inner, **self.dtypes)
        self.net_2 = self.dense(self.dim)

    def __call__(self, x):
        return self.net_2(self.net_0(x))


class TimestepEmbedding(Layer):
    """dense, SiLU, dense (diffusers' `TimestepEmbedding`, and `PixArtAlphaTextProjection`
    with `act_fn="silu"`: the same two layers)."""

    dim: int = 1

    def setup(self):
        self.linear_1 = self.dense(self.dim)
        self.linear_2 = self.dense(self.dim)

    def __call__(self, x):
        return self.linear_2(nn.silu(self.linear_1(x)))


class CombinedTimestepTextProjEmbeddings(Layer):
    """The conditioning vector: embedded timestep (+ embedded guidance with `guidance`) plus
    the projected pooled text embedding; timestep and guidance as the model's forward scales
    them."""

    dim: int = 1
    guidance: bool = False

    def setup(self):
        self.timestep_embedder = TimestepEmbedding(dim=self.dim, **self.dtypes)
        if self.guidance:
            self.guidance_embedder = TimestepEmbedding(dim=self.dim, **self.dtypes)
        self.text_embedder = TimestepEmbedding(dim=self.dim, **self.dtypes)

    def __call__(self, timestep, pooled_projections, guidance=None):
        temb = self.timestep_embedder(timestep_features(timestep))
        if self.guidance:
            temb = temb + self.guidance_embedder(timestep_features(guidance))
        return temb + self.text_embedder(pooled_projections)


class Block(Layer):
    """Base of the transformer blocks: width and heads, and their attention's options."""

    dim: int = 1
    heads: int = 1
    head_dim: int = 1
    attention: str = "xla"  # model.attention: a `models.attention` backend name

    @property
    def attention_arguments(self) -> dict:
        """The keyword arguments of this block's `Attention` layers."""
        return dict(
            heads=self.heads,
            head_dim=self.head_dim,
            attention=self.attention,
            **self.dtypes,
        )


class DiT(nn.Module):
    """Base of a whole diffusion transformer: its run-time fields (not `config.json` keys)
    and what the families' configs share (`num_attention_heads`, `attention_head_dim`,
    `in_channels`, `joint_attention_dim`, `pooled_projection_dim`)."""

    dtype: jnp.dtype = jnp.float32
    attention: str = "xla"  # model.attention: a `models.attention` backend name
    # Each block recomputes its forward in the backward pass, so a train step holds one
    # block's activations and the blocks' inputs, not every block's activations: a
    # REMAT_MODES name (model.remat).
    remat: str = "none"
    # Runs of identical blocks as one `nn.scan` over params stacked on a leading layer axis
    # (named `stacking.stacked_name`): one block's program, compiled once per run.
    scan_layers: bool = False

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def example_inputs(self) -> tuple:
        """The smallest input the transformer takes (batch 1, one patch, one text token),
        as `__call__`'s positional arguments: enough to trace the params' shapes."""
        raise NotImplementedError

    def init_weights(self, rng: jax.Array):
        """Random params, traced from `example_inputs()`."""
        return self.init(rng, *self.example_inputs())["params"]

    def check_dtype(self) -> None:
        if jnp.dtype(self.dtype) not in COMPUTE_DTYPES:
            raise ValueError(f"Compute dtype {self.dtype} is not float32 or bfloat16.")

    def check_conditioning(self, hidden_states, encoder_hidden_states, pooled_projections):
        """The text inputs' widths, and one batch for all three inputs."""
        chex.assert_axis_dimension(encoder_hidden_states, 2, self.joint_attention_dim)
        chex.assert_axis_dimension(pooled_projections, 1, self.pooled_projection_dim)
        chex.assert_equal_shape_prefix(
            [hidden_states, encoder_hidden_states, pooled_projections], prefix_len=1
        )

    def check_runtime(self) -> None:
        """The run-time fields' values (one-sentence ValueError)."""
        check_runtime(self.remat, self.attention)

    def _remat(self, block, scanned: bool):
        return rematerialized(block, self.remat, scanned)

    def block_class(self, block):
        """`block`, recomputed in the backward pass as `remat` says."""
        return self._remat(block, scanned=False)

    def block_stack(self, block, layers: list[dict], shared: dict, broadcast: int) -> dict:
        """The blocks of one module list, as a dict for `setup` to assign (Flax names its
        entries `<list>_<key>`): block `i` built from `shared` and `layers[i]`, under key
        `i`; with `scan_layers`, each run of two or more consecutive blocks with equal
        `layers` entries is one scanned module under key `<first>_to_<last>`, its params
        stacked. A scanned module is called `(carry tuple, *broadcast inputs)` (`broadcast`
        of them) and returns the carry tuple; `run_stack` calls either kind."""
        runs = _runs(layers) if self.scan_layers else [(i, i) for i in range(len(layers))]
        blocks = {}
        for first, last in runs:
            if first == last:
                blocks[str(first)] = self.block_class(block)(**shared, **layers[first])
                continue
            # LoRA factors attached to the stacked kernels (`weights.low_rank`) are merged into
            # each block's slice as the scan reaches it: one block's merged kernels at a time.
            body = nn.map_variables(
                _scan_body(block), "params", _merge_factors, init=self.is_initializing()
            )
            scanned = nn.scan(
                self._remat(body, scanned=True),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast,) * broadcast,
                length=last - first + 1,
            )
            name = stacking.stacked_name("", first, last)[1:]
            blocks[name] = scanned(**shared, **layers[first])
        return blocks


def check_runtime(remat, attention: str) -> None:
    """A model's run-time choices: its `remat` mode and attention backend (one-sentence
    ValueError)."""
    remat_mode(remat)
    if attention not in attention_backends.BACKENDS:
        raise ValueError(
            f"attention backend {attention!r} is unknown; choose one of "
            f"{', '.join(attention_backends.BACKENDS)}."
        )


def rematerialized(block, remat, scanned: bool):
    """A block class recomputed in the backward pass as the `remat` mode says (itself for
    "none"); `scanned`: the block runs inside a scan."""
    mode = remat_mode(remat)
    if mode == "none":
        return block
    policy = None
    if mode == "block_save_attention":
        policy = jax.checkpoint_policies.save_only_these_names(*ATTENTION_SAVED)
    # Inside a scan the loop already keeps XLA from merging the recomputation away.
    return nn.remat(block, policy=policy, prevent_cse=not scanned)


def check_rope_axes(axes_dims_rope, head_dim: int, id_axes: int) -> None:
    """A rotary embedding's split of the head over the position-id axes: `id_axes` positive
    even sizes adding up to the head's (one-sentence ValueError)."""
    axes = tuple(axes_dims_rope)
    if len(axes) != id_axes or any(d <= 0 or d % 2 for d in axes):
        raise ValueError(
            f"axes_dims_rope {list(axes)} must be {id_axes} positive even sizes, one per "
            "position-id axis."
        )
    if sum(axes) != head_dim:
        raise ValueError(
            f"axes_dims_rope {list(axes)} add up to {sum(axes)}, not attention_head_dim {head_dim}."
        )


def run_stack(blocks: Mapping, carry: tuple, *inputs) -> tuple:
    """The carry through the blocks `DiT.block_stack` built, in layer order; a block takes
    `(*carry, *inputs)` and returns the next carry (an array or a tuple)."""
    for key in sorted(blocks, key=lambda k: int(k.split("_")[0])):
        block = blocks[key]
        if "_to_" in key:
            carry, _ = block(carry, *inputs)
        else:
            out = block(*carry, *inputs)
            # as a scanned run's carry: the run's row layout between blocks (`row_layout`);
            # a stream a block ends (SD3's last block returns no text) stays None
            outs = out if isinstance(out, tuple) else (out,)
            carry = tuple(o if o is None else constrain_rows(o) for o in outs)
    return carry


def _runs(layers: list[dict]) -> list[tuple[int, int]]:
    """(first, last) of each run of consecutive equal entries."""
    runs = []
    for i, layer in enumerate(layers):
        if runs and layers[runs[-1][0]] == layer:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _merge_factors(variables: dict) -> dict:
    return {name: low_rank.merge_attached(tree) for name, tree in variables.items()}


@functools.cache
def _scan_body(block):
    """`block` with the call `nn.scan` makes: (carry tuple, *inputs) -> (carry tuple, None)."""

    class Scanned(block):
        def __call__(self, carry, *inputs):
            out = block.__call__(self, *carry, *inputs)
            # between blocks the activations keep the run's row layout (`row_layout`)
            out = out if isinstance(out, tuple) else (out,)
            return tuple(constrain_rows(o) for o in out), None

    Scanned.__name__ = Scanned.__qualname__ = block.__name__
    return Scanned


def config_fields(module_class) -> frozenset:
    """The fields of a model class that are `config.json` keys."""
    skip = ("parent", "name", *RUNTIME_FIELDS)
    return frozenset(f.name for f in dataclasses.fields(module_class) if f.name not in skip)


def module_from_config(
    module_class,
    config: dict,
    dtype,
    options: Mapping,
    converters: Mapping[str, Callable] | None = None,
):
    """`module_class` built from a diffusers `config.json` dict (keys starting with `_` are
    metadata and ignored; `converters` turn JSON lists into the fields' tuples) and the
    run-time `options`, then checked. Raises a one-sentence ValueError for keys or values
    the module does not implement."""
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    unknown = sorted(set(fields) - config_fields(module_class))
    if unknown:
        raise ValueError(f"Transformer config keys {unknown} are not supported.")
    for key, to_field in (converters or {}).items():
        if key in fields:
            fields[key] = to_field(fields[key])
    module = module_class(**fields, dtype=dtype, **options)
    module.check()
    return module


def params_from_state_dict(module: DiT, state: Mapping[str, np.ndarray]) -> dict:
    """The params of `module` from a diffusers state dict of numpy arrays (names mapped
    without a table, `weights.convert`), blocks stacked where the module scans them;
    ParamTreeMismatch (one sentence naming the keys) when the dict does not fit its config."""
    return stacking.module_params(
        module,
        lambda shapes: convert.pytorch_to_flax(
            state, convert.shapes_of(shapes), merge_indices=True
        ),
    )


def state_dict_from_params(params: Mapping, module_lists: frozenset) -> dict[str, np.ndarray]:
    """The diffusers state dict (PyTorch names and layouts, numpy) of a DiT's params, scanned
    or not; `module_lists`: the model's module lists (whose names take an index)."""
    return convert.flax_to_pytorch(stacking.unstack(dict(params)), list_names=module_lists)
