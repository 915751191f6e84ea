"""CLIP in Flax Linen: the text transformer (with or without its projection), the vision
transformer and the dual model that the preference rewards, the SD/SD3/FLUX text towers and
the tiny model's text encoder run.

Configured from transformers' `CLIPConfig`, `CLIPTextConfig` and `CLIPVisionConfig`, or, for a
text tower built in code (the tiny model's), from `TextConfig`: the fields these modules read,
without importing transformers (seconds of a command's start). The
parameter tree is the one transformers' Flax CLIP modules (removed in transformers 5) built:
the same names, nesting, shapes and initialisers, so the shipped tiny weights, Flax msgpack
files and PyTorch safetensors converted by `weights.convert` load unchanged, and `init_text`
/ `init_clip` draw the same random values from the same key. The computation is theirs op for
op (flax's attention weights, its masks, a float-min bias in the compute dtype), so outputs
are unchanged in float32 and bfloat16 alike; `models.attention` computes scores in float32,
which would move bfloat16 outputs, so it is not used here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.attention import dot_product_attention_weights

from tree_grpo_jax.models.base import ModelLoadError

# the activations transformers' former Flax CLIP offered by name, the `hidden_act`s CLIP ran.
ACTIVATIONS = {
    "gelu": functools.partial(nn.gelu, approximate=False),
    "relu": nn.relu,
    "silu": nn.swish,
    "swish": nn.swish,
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
}
# The pooled token was the largest id while configs said eos_token_id=2 (before
# transformers PR #24773); such configs keep that rule, the rest take the first eos token.
LEGACY_EOS_TOKEN_ID = 2


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """A text tower's settings: the fields of transformers' `CLIPTextConfig` that the text
    modules read, with its defaults."""

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    pad_token_id: int = 1
    bos_token_id: int = 49406
    eos_token_id: int = 49407


class CLIPOutput(NamedTuple):
    """What a tower gives: the last hidden states (text: after the final norm), the pooled
    token (vision: post-normed), each layer's input and the last layer's output when asked
    for (`hidden_states[-2]` is the penultimate layer's output), and the projected pooled
    token for a model with a projection."""

    last_hidden_state: jax.Array
    pooler_output: jax.Array
    hidden_states: tuple[jax.Array, ...] | None = None
    embeds: jax.Array | None = None


def check_activations(config, where, hint: str) -> None:
    """One sentence naming `where` (a config file) when a CLIP config, or one tower's, sets a
    `hidden_act` these modules lack."""
    towers = [config.text_config, config.vision_config] if hasattr(config, "text_config") else []
    unknown = sorted({c.hidden_act for c in towers or [config]} - set(ACTIVATIONS))
    if unknown:
        raise ModelLoadError(
            f"{where} sets hidden_act {unknown[0]!r}, which this package's CLIP lacks (it has "
            f"{', '.join(ACTIVATIONS)}); {hint}."
        )


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(
            f"CLIP's hidden_act {name!r} is not supported; use one of {', '.join(ACTIVATIONS)}."
        )
    return ACTIVATIONS[name]


def _normal(stddev: float = 1e-2):
    return jax.nn.initializers.normal(stddev)


class _Attention(nn.Module):  # `encoder/layers/i/self_attn`
    config: Any
    causal: bool
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        self.head_dim = c.hidden_size // c.num_attention_heads
        if self.head_dim * c.num_attention_heads != c.hidden_size:
            raise ValueError(
                f"CLIP's hidden_size {c.hidden_size} is not a multiple of its "
                f"num_attention_heads {c.num_attention_heads}."
            )
        dense = functools.partial(
            nn.Dense, c.hidden_size, dtype=self.dtype, kernel_init=_normal(0.01)
        )
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = dense(), dense(), dense(), dense()

    def __call__(self, hidden_states, attention_mask=None, deterministic: bool = True):
        heads = (self.config.num_attention_heads, self.head_dim)
        split = lambda x: x.reshape(x.shape[:2] + heads)  # noqa: E731
        query = split(self.q_proj(hidden_states))
        key = split(self.k_proj(hidden_states))
        value = split(self.v_proj(hidden_states))

        mask = None
        if attention_mask is not None:
            mask = jnp.expand_dims(attention_mask, axis=(-3, -2))
        if self.causal:
            causal = nn.make_causal_mask(jnp.ones((1, key.shape[1]), "i4"))
            mask = causal if mask is None else nn.combine_masks(mask, causal, dtype="i4")
        bias = None
        if mask is not None:  # 0 where attended, the compute dtype's lowest elsewhere
            bias = jax.lax.select(
                mask > 0,
                jnp.full(mask.shape, 0.0).astype(self.dtype),
                jnp.full(mask.shape, jnp.finfo(self.dtype).min).astype(self.dtype),
            )
        rate = self.config.attention_dropout
        dropout_rng = None if deterministic or rate <= 0.0 else self.make_rng("dropout")
        weights = dot_product_attention_weights(
            query,
            key,
            bias=bias,
            dropout_rng=dropout_rng,
            dropout_rate=rate,
            deterministic=deterministic,
            dtype=self.dtype,
            precision=None,
        )
        out = jnp.einsum("...hqk,...khd->...qhd", weights, value)
        return self.out_proj(out.reshape(out.shape[:2] + (self.config.hidden_size,)))


class _MLP(nn.Module):  # `encoder/layers/i/mlp`
    config: Any
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        self.activation = _activation(c.hidden_act)
        self.fc1 = nn.Dense(c.intermediate_size, dtype=self.dtype, kernel_init=_normal(0.01))
        self.fc2 = nn.Dense(c.hidden_size, dtype=self.dtype, kernel_init=_normal(0.01))

    def __call__(self, hidden_states):
        return self.fc2(self.activation(self.fc1(hidden_states)))


class _EncoderLayer(nn.Module):  # `encoder/layers/i`
    config: Any
    causal: bool
    dtype: Any = jnp.float32

    def setup(self):
        eps = self.config.layer_norm_eps
        self.self_attn = _Attention(self.config, self.causal, dtype=self.dtype)
        self.layer_norm1 = nn.LayerNorm(epsilon=eps, dtype=self.dtype)
        self.mlp = _MLP(self.config, dtype=self.dtype)
        self.layer_norm2 = nn.LayerNorm(epsilon=eps, dtype=self.dtype)

    def __call__(self, hidden_states, attention_mask=None, deterministic: bool = True):
        attended = self.self_attn(self.layer_norm1(hidden_states), attention_mask, deterministic)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class _Layers(nn.Module):  # `encoder/layers`, the layers named "0", "1", ...
    config: Any
    causal: bool
    dtype: Any = jnp.float32

    def setup(self):
        self.layers = [
            _EncoderLayer(self.config, self.causal, dtype=self.dtype, name=str(i))
            for i in range(self.config.num_hidden_layers)
        ]

    def __call__(self, hidden_states, attention_mask, deterministic, output_hidden_states):
        seen = []
        for layer in self.layers:
            seen.append(hidden_states)
            hidden_states = layer(hidden_states, attention_mask, deterministic)
        seen.append(hidden_states)
        return hidden_states, (tuple(seen) if output_hidden_states else None)


class _Encoder(nn.Module):  # `encoder`
    config: Any
    causal: bool
    dtype: Any = jnp.float32

    def setup(self):
        self.layers = _Layers(self.config, self.causal, dtype=self.dtype)

    def __call__(
        self, hidden_states, attention_mask=None, deterministic=True, output_hidden_states=False
    ):
        return self.layers(hidden_states, attention_mask, deterministic, output_hidden_states)


class _TextEmbeddings(nn.Module):  # `text_model/embeddings`
    config: Any
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        normal = jax.nn.initializers.normal()
        self.token_embedding = nn.Embed(c.vocab_size, c.hidden_size, embedding_init=normal)
        self.position_embedding = nn.Embed(
            c.max_position_embeddings, c.hidden_size, embedding_init=normal
        )

    def __call__(self, input_ids, position_ids):
        tokens = self.token_embedding(input_ids.astype("i4"))
        return tokens + self.position_embedding(position_ids.astype("i4"))


class _VisionEmbeddings(nn.Module):  # `vision_model/embeddings`
    config: Any
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        self.class_embedding = self.param("class_embedding", _normal(0.02), (c.hidden_size,))
        self.patch_embedding = nn.Conv(
            c.hidden_size,
            kernel_size=(c.patch_size, c.patch_size),
            strides=(c.patch_size, c.patch_size),
            padding="VALID",
            use_bias=False,
            dtype=self.dtype,
            kernel_init=jax.nn.initializers.normal(),
        )
        positions = (c.image_size // c.patch_size) ** 2 + 1
        self.position_embedding = nn.Embed(
            positions, c.hidden_size, embedding_init=jax.nn.initializers.normal()
        )
        self.position_ids = jnp.arange(positions, dtype="i4")[None]

    def __call__(self, pixel_values):
        patches = self.patch_embedding(pixel_values)
        batch, height, width, channels = patches.shape
        patches = patches.reshape(batch, height * width, channels)
        cls = jnp.tile(self.class_embedding[None, None], (batch, 1, 1))
        embeddings = jnp.concatenate([cls, patches], axis=1)
        return embeddings + self.position_embedding(self.position_ids)


def _default_text_inputs(input_ids, attention_mask, position_ids):
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
    return attention_mask, position_ids


def pooled_token_index(input_ids, eos_token_id) -> jax.Array:
    """[B, L] ids -> [B] the position transformers pools: the largest id for legacy configs
    (eos_token_id 2), else the first `eos_token_id`."""
    if eos_token_id == LEGACY_EOS_TOKEN_ID:
        return input_ids.argmax(axis=-1)
    return (input_ids == eos_token_id).argmax(axis=-1)


class CLIPTextTransformer(nn.Module):
    """ids [B, L] (and a 1/0 attention mask, position ids) -> `CLIPOutput`: final-normed
    hidden states [B, L, D], the eos token's as pooled [B, D]. Attention is causal; padding
    is masked only where `attention_mask` says so."""

    config: Any  # transformers.CLIPTextConfig or `TextConfig`
    dtype: Any = jnp.float32

    def setup(self):
        self.embeddings = _TextEmbeddings(self.config, dtype=self.dtype)
        self.encoder = _Encoder(self.config, causal=True, dtype=self.dtype)
        self.final_layer_norm = nn.LayerNorm(epsilon=self.config.layer_norm_eps, dtype=self.dtype)

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        deterministic: bool = True,
        output_hidden_states: bool = False,
    ) -> CLIPOutput:
        attention_mask, position_ids = _default_text_inputs(input_ids, attention_mask, position_ids)
        hidden = self.embeddings(input_ids, position_ids)
        hidden, states = self.encoder(hidden, attention_mask, deterministic, output_hidden_states)
        last = self.final_layer_norm(hidden)
        index = pooled_token_index(input_ids, self.config.eos_token_id)
        return CLIPOutput(last, last[jnp.arange(last.shape[0]), index], states)


class CLIPVisionTransformer(nn.Module):
    """pixels [B, H, W, C] -> `CLIPOutput`: hidden states [B, 1 + patches, D] and the class
    token's, post-normed, as pooled [B, D]."""

    config: Any  # transformers.CLIPVisionConfig
    dtype: Any = jnp.float32

    def setup(self):
        eps = self.config.layer_norm_eps
        self.embeddings = _VisionEmbeddings(self.config, dtype=self.dtype)
        self.pre_layrnorm = nn.LayerNorm(epsilon=eps, dtype=self.dtype)  # transformers' name
        self.encoder = _Encoder(self.config, causal=False, dtype=self.dtype)
        self.post_layernorm = nn.LayerNorm(epsilon=eps, dtype=self.dtype)

    def __call__(
        self, pixel_values, deterministic: bool = True, output_hidden_states: bool = False
    ) -> CLIPOutput:
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        hidden, states = self.encoder(hidden, None, deterministic, output_hidden_states)
        return CLIPOutput(hidden, self.post_layernorm(hidden[:, 0, :]), states)


class CLIPTextModel(nn.Module):
    """transformers' `CLIPTextModel`: `text_model` only."""

    config: Any  # transformers.CLIPTextConfig or `TextConfig`
    dtype: Any = jnp.float32

    def setup(self):
        self.text_model = CLIPTextTransformer(self.config, dtype=self.dtype)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, **options):
        return self.text_model(input_ids, attention_mask, position_ids, **options)


class CLIPTextModelWithProjection(nn.Module):
    """transformers' `CLIPTextModelWithProjection`: `text_model` and `text_projection`;
    the output's `embeds` is the projected pooled token [B, projection_dim]."""

    config: Any  # transformers.CLIPTextConfig or `TextConfig`
    dtype: Any = jnp.float32

    def setup(self):
        self.text_model = CLIPTextTransformer(self.config, dtype=self.dtype)
        self.text_projection = nn.Dense(
            self.config.projection_dim, use_bias=False, dtype=self.dtype
        )

    def __call__(self, input_ids, attention_mask=None, position_ids=None, **options):
        out = self.text_model(input_ids, attention_mask, position_ids, **options)
        return out._replace(embeds=self.text_projection(out.pooler_output))


class CLIPModel(nn.Module):
    """transformers' `CLIPModel`: both towers, their projections and `logit_scale`."""

    config: Any  # transformers.CLIPConfig
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        self.text_model = CLIPTextTransformer(c.text_config, dtype=self.dtype)
        self.vision_model = CLIPVisionTransformer(c.vision_config, dtype=self.dtype)
        projection = functools.partial(
            nn.Dense, c.projection_dim, dtype=self.dtype, kernel_init=_normal(0.02), use_bias=False
        )
        self.visual_projection = projection()
        self.text_projection = projection()
        self.logit_scale = self.param(
            "logit_scale", lambda _, shape: jnp.ones(shape) * c.logit_scale_init_value, []
        )

    def get_text_features(
        self, input_ids, attention_mask=None, position_ids=None, deterministic: bool = True
    ) -> jax.Array:
        """[B, L] ids -> [B, projection_dim] projected pooled tokens (not normalised)."""
        out = self.text_model(input_ids, attention_mask, position_ids, deterministic)
        return self.text_projection(out.pooler_output)

    def get_image_features(self, pixel_values, deterministic: bool = True) -> jax.Array:
        """[B, H, W, C] pixels -> [B, projection_dim] projected pooled tokens (not normalised)."""
        return self.visual_projection(self.vision_model(pixel_values, deterministic).pooler_output)

    def __call__(
        self,
        input_ids,
        pixel_values,
        attention_mask=None,
        position_ids=None,
        deterministic: bool = True,
    ) -> tuple[jax.Array, jax.Array]:
        """(logits_per_image [Bi, Bt], logits_per_text [Bt, Bi]): scaled cosines."""
        image = self.get_image_features(pixel_values, deterministic)
        text = self.get_text_features(input_ids, attention_mask, position_ids, deterministic)
        image = image / jnp.linalg.norm(image, axis=-1, keepdims=True)
        text = text / jnp.linalg.norm(text, axis=-1, keepdims=True)
        logits_per_text = jnp.matmul(text, image.T) * jnp.exp(self.logit_scale)
        return logits_per_text.T, logits_per_text


def _init_rngs(rng):
    # transformers' init_weights split the key so; keeping it keeps the random values.
    params_rng, dropout_rng = jax.random.split(rng)
    return {"params": params_rng, "dropout": dropout_rng}


def init_text(module: nn.Module, rng: jax.Array, length: int = 1) -> dict:
    """Random params of a text model (`CLIPTextModel`, `...WithProjection`): the values
    transformers' Flax CLIP text models drew in `init_weights(rng, (1, length))`."""
    ids = jnp.zeros((1, length), "i4")
    mask, positions = _default_text_inputs(ids, None, None)
    return module.init(_init_rngs(rng), ids, mask, positions)["params"]


def init_clip(module: CLIPModel, rng: jax.Array) -> dict:
    """Random params of a `CLIPModel`: the values transformers' Flax CLIP drew in
    `init_weights`."""
    vision = module.config.vision_config
    ids = jnp.zeros((1, 1), "i4")
    pixels = jnp.zeros((1, vision.image_size, vision.image_size, vision.num_channels))
    return module.init(_init_rngs(rng), ids, pixels, jnp.ones_like(ids), ids)["params"]


def param_shapes(init, module: nn.Module) -> dict:
    """`init(module, key)`'s param tree as shapes, nothing computed."""
    return jax.eval_shape(lambda: init(module, jax.random.PRNGKey(0)))


__all__ = [
    "ACTIVATIONS",
    "CLIPModel",
    "CLIPOutput",
    "CLIPTextModel",
    "CLIPTextModelWithProjection",
    "CLIPTextTransformer",
    "CLIPVisionTransformer",
    "check_activations",
    "init_clip",
    "init_text",
    "param_shapes",
    "pooled_token_index",
]
