"""ImageReward's network in Flax: BLIP's ViT, BLIP's BERT with cross-attention, the MLP head.

Module and parameter names follow the release's PyTorch modules (`blip.visual_encoder`,
`blip.text_encoder`, `mlp.layers.N`), so its state dict maps onto the parameter tree by name
(`weights.convert.pytorch_to_flax`); `reference_shapes` gives that tree's shapes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.weights import convert

NAME = "imagereward"
HINT = (
    f"convert the ImageReward release with `python -m tree_grpo_jax.rewards.convert {NAME}` "
    f"and point --config.reward_models.{NAME} at the output folder"
)
# The release's normalisation of the head's output.
SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
MAX_LENGTH = 35  # `ImageReward.score` pads and truncates prompts to 35 tokens
HEAD_LINEARS = (0, 2, 4, 6, 7)  # the head's nn.Sequential: Linear/Dropout, ..., Linear, Linear
_SELF_MASK = -10000.0  # BERT's additive mask for padding tokens, as the release applies it


@dataclasses.dataclass(frozen=True)
class ImageRewardConfig:
    """The sizes of one ImageReward (the defaults are the release's)."""

    image_size: int = 224
    patch_size: int = 16
    vision_width: int = 1024
    vision_layers: int = 24
    vision_heads: int = 16
    vision_mlp_width: int = 4096
    vision_eps: float = 1e-6
    vocab_size: int = 30524
    text_width: int = 768
    text_layers: int = 12
    text_heads: int = 12
    text_mlp_width: int = 3072
    max_positions: int = 512
    text_eps: float = 1e-12
    mlp_widths: tuple[int, ...] = (768, 1024, 128, 64, 16, 1)
    max_length: int = MAX_LENGTH
    score_mean: float = SCORE_MEAN
    score_std: float = SCORE_STD

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def to_dict(self) -> dict:
        return {"model_type": NAME, **dataclasses.asdict(self), "mlp_widths": list(self.mlp_widths)}

    @classmethod
    def from_dict(cls, raw: dict, where: str = "the config") -> ImageRewardConfig:
        """Checks every field; a bad one is one ModelLoadError sentence."""
        if raw.get("model_type") != NAME:
            raise ModelLoadError(
                f"{where} describes a {raw.get('model_type')!r} model, not {NAME!r}; {HINT}."
            )
        values = {}
        for field in dataclasses.fields(cls):
            value = raw.get(field.name, field.default)
            if field.name == "mlp_widths":
                ok = isinstance(value, (list, tuple)) and len(value) == len(HEAD_LINEARS) + 1
                ok = ok and all(isinstance(v, int) and v > 0 for v in value)
                value = tuple(value) if ok else value
            elif field.type == "int":
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok = ok and math.isfinite(value) and (value > 0 or field.name == "score_mean")
            if not ok:
                raise ModelLoadError(f"{where} has an invalid {field.name} ({value!r}); {HINT}.")
            values[field.name] = value
        config = cls(**values)
        problem = config._inconsistency()
        if problem:
            raise ModelLoadError(f"{where}: {problem}; {HINT}.")
        return config

    def _inconsistency(self) -> str | None:
        if self.image_size % self.patch_size:
            return f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
        for tower in ("vision", "text"):
            width, heads = getattr(self, f"{tower}_width"), getattr(self, f"{tower}_heads")
            if width % heads:
                return f"{tower}_width {width} does not split into {heads} heads"
        if self.max_length > self.max_positions:
            return f"max_length {self.max_length} exceeds max_positions {self.max_positions}"
        if self.mlp_widths[0] != self.text_width or self.mlp_widths[-1] != 1:
            return (
                f"the head's widths {list(self.mlp_widths)} do not run from text_width "
                f"{self.text_width} to one score"
            )
        return None


def _attention(q, k, v, heads: int, bias=None):
    """Multi-head softmax attention of [B, T, W] queries over [B, S, W] keys, in float32."""
    b, t, w = q.shape
    d = w // heads
    q = q.reshape(b, t, heads, d)
    k = k.reshape(b, k.shape[1], heads, d)
    v = v.reshape(b, v.shape[1], heads, d)
    logits = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / math.sqrt(d)
    if bias is not None:
        logits = logits + bias
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, w)


def _layer_norm(eps: float, dtype, name: str) -> nn.LayerNorm:
    # Two-pass variance, as torch computes it.
    return nn.LayerNorm(epsilon=eps, dtype=dtype, use_fast_variance=False, name=name)


class _PatchEmbed(nn.Module):
    width: int
    patch: int
    dtype: Any

    @nn.compact
    def __call__(self, pixels):
        p = (self.patch, self.patch)
        x = nn.Conv(self.width, p, strides=p, padding="VALID", dtype=self.dtype, name="proj")(
            pixels
        )
        return x.reshape(x.shape[0], -1, self.width)  # row-major patches, as torch flattens


class _ViTAttention(nn.Module):
    width: int
    heads: int
    dtype: Any

    @nn.compact
    def __call__(self, x):
        qkv = nn.Dense(3 * self.width, dtype=self.dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        return nn.Dense(self.width, dtype=self.dtype, name="proj")(_attention(q, k, v, self.heads))


class _ViTMlp(nn.Module):
    width: int
    hidden: int
    dtype: Any

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.hidden, dtype=self.dtype, name="fc1")(x)
        return nn.Dense(self.width, dtype=self.dtype, name="fc2")(nn.gelu(x, approximate=False))


class _ViTBlock(nn.Module):
    config: ImageRewardConfig
    dtype: Any

    @nn.compact
    def __call__(self, x):
        c = self.config
        h = _layer_norm(c.vision_eps, self.dtype, "norm1")(x)
        x = x + _ViTAttention(c.vision_width, c.vision_heads, self.dtype, name="attn")(h)
        h = _layer_norm(c.vision_eps, self.dtype, "norm2")(x)
        return x + _ViTMlp(c.vision_width, c.vision_mlp_width, self.dtype, name="mlp")(h)


class VisionTransformer(nn.Module):
    """BLIP's ViT: pixels [B, S, S, 3] (normalised, NHWC) -> tokens [B, 1 + patches, width]."""

    config: ImageRewardConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels):
        c = self.config
        x = _PatchEmbed(c.vision_width, c.patch_size, self.dtype, name="patch_embed")(pixels)
        cls = self.param("cls_token", nn.initializers.zeros, (1, 1, c.vision_width))
        pos = self.param("pos_embed", nn.initializers.zeros, (1, c.num_patches + 1, c.vision_width))
        cls = jnp.broadcast_to(cls.astype(x.dtype), (x.shape[0], 1, c.vision_width))
        x = jnp.concatenate([cls, x], axis=1) + pos.astype(x.dtype)
        for i in range(c.vision_layers):
            x = _ViTBlock(c, self.dtype, name=f"blocks_{i}")(x)
        return _layer_norm(c.vision_eps, self.dtype, "norm")(x)


class _BertSelfAttention(nn.Module):
    width: int
    heads: int
    dtype: Any

    @nn.compact
    def __call__(self, x, context, bias):
        dense = lambda name: nn.Dense(self.width, dtype=self.dtype, name=name)  # noqa: E731
        q, k, v = dense("query")(x), dense("key")(context), dense("value")(context)
        return _attention(q, k, v, self.heads, bias)


class _DenseNorm(nn.Module):
    """BERT's output sub-layers: LayerNorm(dense(x) + residual)."""

    width: int
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x, residual):
        x = nn.Dense(self.width, dtype=self.dtype, name="dense")(x)
        return _layer_norm(self.eps, self.dtype, "LayerNorm")(x + residual)


class _BertAttention(nn.Module):
    config: ImageRewardConfig
    dtype: Any

    @nn.compact
    def __call__(self, x, context, bias):
        c = self.config
        h = _BertSelfAttention(c.text_width, c.text_heads, self.dtype, name="self")(
            x, context, bias
        )
        return _DenseNorm(c.text_width, c.text_eps, self.dtype, name="output")(h, x)


class _Intermediate(nn.Module):
    width: int
    dtype: Any

    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(self.width, dtype=self.dtype, name="dense")(x), approximate=False)


class _BertLayer(nn.Module):
    config: ImageRewardConfig
    dtype: Any

    @nn.compact
    def __call__(self, x, self_bias, image):
        c = self.config
        x = _BertAttention(c, self.dtype, name="attention")(x, x, self_bias)
        x = _BertAttention(c, self.dtype, name="crossattention")(x, image, None)  # all tokens
        h = _Intermediate(c.text_mlp_width, self.dtype, name="intermediate")(x)
        return _DenseNorm(c.text_width, c.text_eps, self.dtype, name="output")(h, x)


class _BertLayers(nn.Module):
    config: ImageRewardConfig
    dtype: Any

    @nn.compact
    def __call__(self, x, self_bias, image):
        for i in range(self.config.text_layers):
            x = _BertLayer(self.config, self.dtype, name=f"layer_{i}")(x, self_bias, image)
        return x


class _BertEmbeddings(nn.Module):
    config: ImageRewardConfig
    dtype: Any

    @nn.compact
    def __call__(self, ids):
        c = self.config
        x = nn.Embed(c.vocab_size, c.text_width, dtype=self.dtype, name="word_embeddings")(ids)
        positions = nn.Embed(
            c.max_positions, c.text_width, dtype=self.dtype, name="position_embeddings"
        )(jnp.arange(ids.shape[1]))
        return _layer_norm(c.text_eps, self.dtype, "LayerNorm")(x + positions[None])


class TextEncoder(nn.Module):
    """BLIP's BERT: token ids and mask [B, T] with image tokens -> hidden states [B, T, W]."""

    config: ImageRewardConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, ids, mask, image):
        x = _BertEmbeddings(self.config, self.dtype, name="embeddings")(ids)
        bias = (1.0 - mask[:, None, None, :].astype(jnp.float32)) * _SELF_MASK
        return _BertLayers(self.config, self.dtype, name="encoder")(x, bias, image.astype(x.dtype))


class _BLIP(nn.Module):
    config: ImageRewardConfig
    dtype: Any

    def setup(self):
        self.visual_encoder = VisionTransformer(self.config, self.dtype)
        self.text_encoder = TextEncoder(self.config, self.dtype)


class _Head(nn.Module):
    """The five linear layers (no activation: a chain of affine maps), in float32."""

    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for i, width in zip(HEAD_LINEARS, self.widths[1:], strict=True):
            layer = nn.Dense(width, precision=jax.lax.Precision.HIGHEST, name=f"layers_{i}")
            x = layer(x.astype(jnp.float32))
        return x[:, 0]


class ImageRewardModel(nn.Module):
    """pixels [B, S, S, 3], ids and mask [B, T] -> image tokens, text features, rewards [B]."""

    config: ImageRewardConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.blip = _BLIP(self.config, self.dtype)
        self.mlp = _Head(self.config.mlp_widths)

    def __call__(self, pixels, ids, mask):
        image = self.blip.visual_encoder(pixels.astype(self.dtype))
        text = self.blip.text_encoder(ids, mask, image)[:, 0].astype(jnp.float32)
        rewards = (self.mlp(text) - self.config.score_mean) / self.config.score_std
        return image, text, rewards


def reference_shapes(config: ImageRewardConfig) -> dict:
    """The Flax parameter tree's flat {path: shape}, without allocating it."""
    module = ImageRewardModel(config)
    size = config.image_size
    pixels = jnp.zeros((1, size, size, 3))
    ids = jnp.zeros((1, 2), jnp.int32)
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), pixels, ids, ids))
    return convert.shapes_of(shapes["params"])
