"""Frozen text encoders shared by the families that read diffusers-layout folders: CLIP text
towers (`models.clip`) and T5's encoder (`T5Encoder`, Flax, below), their
tokenizers and their PyTorch safetensors weights, converted in numpy (torch is never imported).

`T5Encoder` has the parameter tree of transformers' `FlaxT5EncoderModule`, which no longer
traces on JAX 0.10 (it calls `jnp.clip(a_max=...)`). Every loader takes `hint`, the ending of
its one-sentence errors (what the user should point `model.path` at). A family joins the
encoders' outputs as its pipeline does, in its own `text.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.errors import echo, first_line, flat
from tree_grpo_jax.models import clip, clip_files
from tree_grpo_jax.models.base import ModelLoadError, cast_floats
from tree_grpo_jax.weights import convert, files

# `T5EncoderModel` ties the encoder's embedding to `shared`; files may carry either name.
_T5_TIED = ("encoder.embed_tokens.weight", "shared.weight")
_T5_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}
T5_MAX_LENGTH = 512  # the pipelines' largest `max_sequence_length`

PyTree = Any


# ---------------------------------------------------------------------------------------------
# T5's encoder in Flax, named as transformers' FlaxT5EncoderModule.


@dataclasses.dataclass(frozen=True)
class T5EncoderConfig:
    """The fields of a transformers `T5Config` that the encoder reads."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    num_buckets: int
    max_distance: int
    layer_norm_epsilon: float
    gated: bool
    activation: str
    # umT5 (`UMT5EncoderModel`): every block owns its relative-position bias table; T5's
    # first block's table serves them all.
    bias_per_block: bool = False


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's bidirectional [length, length] bucket table, in float32 numpy like PyTorch's.

    Computed on the host so that bucket edges (exact integers after the log) round as
    PyTorch rounds them."""
    relative = np.arange(length)[None, :] - np.arange(length)[:, None]
    half = num_buckets // 2
    exact = half // 2
    distance = np.abs(relative)
    log_ratio = np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(exact))
    scaled = log_ratio / np.float32(math.log(max_distance / exact)) * np.float32(half - exact)
    large = np.minimum(exact + scaled.astype(np.int64), half - 1)
    buckets = (relative > 0) * half + np.where(distance < exact, distance, large)
    return buckets.astype(np.int32)


class T5LayerNorm(nn.Module):
    """T5's RMS norm: no mean, no bias; the variance in float32. The parameter is `weight`."""

    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32)) * jax.lax.rsqrt(variance + self.eps)
        return weight.astype(self.dtype) * x.astype(self.dtype)


class T5SelfAttention(nn.Module):
    """Unscaled dot-product attention plus T5's relative-position bias, which only the first
    block owns (`has_relative_bias`) and every block reuses (umT5: each block its own), plus
    the padding mask's additive bias when there is one."""

    config: T5EncoderConfig
    has_relative_bias: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, bias, mask_bias=None):
        c = self.config
        batch, length = x.shape[:2]

        def project(name, features, h):
            return nn.Dense(features, use_bias=False, dtype=self.dtype, name=name)(h)

        def heads(name):
            return project(name, c.num_heads * c.d_kv, x).reshape(
                batch, length, c.num_heads, c.d_kv
            )

        q, k, v = heads("q"), heads("k"), heads("v")
        if self.has_relative_bias:
            table = relative_position_buckets(length, c.num_buckets, c.max_distance)
            embed = nn.Embed(c.num_buckets, c.num_heads, name="relative_attention_bias")
            bias = jnp.transpose(embed(jnp.asarray(table)), (2, 0, 1))[None]  # [1, H, L, L]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        total = bias.astype(jnp.float32)
        if mask_bias is not None:  # added to the bias first, as transformers does
            total = total + mask_bias
        weights = jax.nn.softmax(scores + total, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(self.dtype), v)
        return project("o", c.d_model, out.reshape(batch, length, -1)), bias


class T5FeedForward(nn.Module):
    """`wo(act(wi_0 x) * wi_1 x)` when gated (T5 v1.1, T5-XXL), else `wo(act(wi x))`."""

    config: T5EncoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.config

        def dense(name, features, h):
            return nn.Dense(features, use_bias=False, dtype=self.dtype, name=name)(h)

        act = _T5_ACTIVATIONS[c.activation]
        if c.gated:
            hidden = act(dense("wi_0", c.d_ff, x)) * dense("wi_1", c.d_ff, x)
        else:
            hidden = act(dense("wi", c.d_ff, x))
        return dense("wo", c.d_model, hidden)


class _T5AttentionSublayer(nn.Module):  # `layer/0`
    config: T5EncoderConfig
    has_relative_bias: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, bias, mask_bias=None):
        norm = T5LayerNorm(self.config.layer_norm_epsilon, self.dtype, name="layer_norm")
        attention = T5SelfAttention(
            self.config, self.has_relative_bias, self.dtype, name="SelfAttention"
        )
        out, bias = attention(norm(x), bias, mask_bias)
        return x + out, bias


class _T5FeedForwardSublayer(nn.Module):  # `layer/1`
    config: T5EncoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        norm = T5LayerNorm(self.config.layer_norm_epsilon, self.dtype, name="layer_norm")
        return x + T5FeedForward(self.config, self.dtype, name="DenseReluDense")(norm(x))


class _T5Sublayers(nn.Module):  # `block/i/layer`
    config: T5EncoderConfig
    has_relative_bias: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, bias, mask_bias=None):
        x, bias = _T5AttentionSublayer(self.config, self.has_relative_bias, self.dtype, name="0")(
            x, bias, mask_bias
        )
        return _T5FeedForwardSublayer(self.config, self.dtype, name="1")(x), bias


class _T5Blocks(nn.Module):  # `encoder/block`
    config: T5EncoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask_bias=None):
        bias = None
        for i in range(self.config.num_layers):
            owns_bias = i == 0 or self.config.bias_per_block
            x, bias = _T5Block(self.config, owns_bias, self.dtype, name=str(i))(x, bias, mask_bias)
        return x


class _T5Block(nn.Module):  # `encoder/block/i`
    config: T5EncoderConfig
    has_relative_bias: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, bias, mask_bias=None):
        sublayers = _T5Sublayers(self.config, self.has_relative_bias, self.dtype, name="layer")
        return sublayers(x, bias, mask_bias)


class _T5Stack(nn.Module):  # `encoder`
    config: T5EncoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask_bias=None):
        x = _T5Blocks(self.config, self.dtype, name="block")(x, mask_bias)
        return T5LayerNorm(self.config.layer_norm_epsilon, self.dtype, name="final_layer_norm")(x)


class T5Encoder(nn.Module):
    """ids [B, L] -> T5's last hidden states [B, L, d_model]. Without `mask` (what the SD3 and
    FLUX pipelines feed T5) padding tokens are attended to; with `mask` [B, L] (1: a token,
    0: padding; WanPipeline's umT5) no token attends to padding, which keeps its states."""

    config: T5EncoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, ids, mask=None):
        c = self.config
        embed = nn.Embed(c.vocab_size, c.d_model, dtype=self.dtype, name="shared")
        mask_bias = None
        if mask is not None:  # transformers' extended mask: 0 or float32's lowest
            keep = mask.astype(jnp.float32)[:, None, None, :]
            mask_bias = (1.0 - keep) * jnp.finfo(jnp.float32).min
        return _T5Stack(c, self.dtype, name="encoder")(embed(ids), mask_bias)


# ---------------------------------------------------------------------------------------------
# Loading.


def read_config(folder: Path, model_type: str, what: str, hint: str) -> dict:
    """`folder/config.json`, which must have `model_type` (when it names one)."""
    config = files.read_json(folder / "config.json", hint)
    found = config.get("model_type", model_type)
    if found != model_type:
        raise ModelLoadError(
            f"{folder / 'config.json'} has model_type {found!r}, but {folder.name}/ must hold "
            f"{what} (model_type {model_type!r}); {hint}."
        )
    return config


def untie_t5(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One embedding under `shared.weight`: the encoder reads its tokens from `shared`, so
    `shared.weight` wins and `encoder.embed_tokens.weight` is used only in its absence."""
    state = dict(state)
    tied, shared = _T5_TIED
    embed_tokens = state.pop(tied, None)
    if shared not in state and embed_tokens is not None:
        state[shared] = embed_tokens
    return state


@dataclasses.dataclass(frozen=True, eq=False)
class FrozenEncoder:
    """One frozen text encoder: its tokenizer, its jitted `run(params, ids)` and its params."""

    folder: Path
    tokenizer: Any
    max_length: int  # every prompt is padded or truncated to this many tokens
    run: Callable  # (params, ids [B, max_length] int32) -> outputs in the params' dtype
    params: PyTree

    def __call__(self, prompts: Sequence[str]):
        ids = self.tokenizer(
            list(prompts),
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            return_tensors="np",
        ).input_ids
        chex.assert_shape(ids, (len(prompts), self.max_length))
        return self.run(self.params, jnp.asarray(ids, jnp.int32))


def clip_tokenizer_dir(root: Path, name: str, hint: str) -> Path:
    """`root/name`, which must hold a CLIP tokenizer (`clip_files`) and its
    `tokenizer_config.json`; else one sentence naming the first file it lacks."""
    files.component_dir(root, name, (), hint)
    clip_files.check_tokenizer(root, name, hint)
    return files.component_dir(root, name, ("tokenizer_config.json",), hint)


def load_t5_tokenizer(folder: Path, hint: str):
    from transformers import T5TokenizerFast

    if not (folder / "tokenizer.json").is_file() and not (folder / "spiece.model").is_file():
        raise ModelLoadError(
            f"{folder} has neither tokenizer.json nor spiece.model, so T5's tokenizer cannot "
            f"be read; {hint}."
        )
    try:  # tokenizer.json needs only `tokenizers`; spiece.model alone needs sentencepiece
        return T5TokenizerFast.from_pretrained(str(folder))
    except Exception as e:
        raise ModelLoadError(
            f"could not read the T5 tokenizer in {folder} ({first_line(e)}); {hint}."
        ) from None


def load_clip(
    root: Path,
    encoder_name: str,
    tokenizer_name: str,
    dtype,
    hint: str,
    *,
    projection: bool,
    max_length: int | None = None,
):
    """`(FrozenEncoder, CLIPTextConfig)` of a CLIP text tower's folder. The encoder returns
    (penultimate hidden states [B, L, hidden], pooled [B, D]): with `projection` (a
    `CLIPTextModelWithProjection`) the projected `text_embeds`, else (a `CLIPTextModel`)
    the unprojected `pooler_output`. Prompts are padded to `max_length` (default: the
    tokenizer's, at most the tower's positions)."""
    from transformers import CLIPTextConfig

    folder = files.component_dir(root, encoder_name, ("config.json",), hint)
    tokenizer = clip_files.load_tokenizer(clip_tokenizer_dir(root, tokenizer_name, hint), hint)
    what = "a CLIP text encoder with projection" if projection else "a CLIP text encoder"
    raw = read_config(folder, "clip_text_model", what, hint)
    try:
        config = CLIPTextConfig.from_dict(raw)
    except Exception as e:
        raise ModelLoadError(
            f"{folder / 'config.json'} is not a valid CLIP text config: {flat(e)}; {hint}."
        ) from None
    clip.check_activations(config, folder / "config.json", hint)
    length = max_length or min(tokenizer.model_max_length, config.max_position_embeddings)
    if length > config.max_position_embeddings:
        raise ModelLoadError(
            f"the CLIP prompt length {length} exceeds the {config.max_position_embeddings} "
            f"positions of {folder}; {hint}."
        )
    module_class = clip.CLIPTextModelWithProjection if projection else clip.CLIPTextModel
    module = module_class(config, dtype=dtype)
    shapes = clip.param_shapes(clip.init_text, module)
    params = convert.folder_to_flax(
        folder,
        clip_files.with_text_prefix(files.read_weights(folder, "model", hint)),
        convert.shapes_of(shapes),
        hint,
        merge_indices=False,
    )

    @jax.jit
    def run(params, ids):
        # The pipelines pass no mask (all ones); CLIP's causal mask still applies.
        out = module.apply({"params": params}, ids, output_hidden_states=True)
        return out.hidden_states[-2], out.embeds if projection else out.pooler_output

    encoder = FrozenEncoder(folder, tokenizer, length, run, cast_floats(params, dtype))
    return encoder, config


def t5_encoder_config(
    raw: dict, where: Path | str, hint: str, umt5: bool = False
) -> T5EncoderConfig:
    """The encoder's settings from a transformers `T5Config` dict, or with `umt5` a
    `UMT5Config` one (every block then owns its position bias); one sentence naming `where`
    for a config it cannot build or an activation it lacks."""
    import transformers

    kind, name = ("UMT5Config", "umT5") if umt5 else ("T5Config", "T5")
    try:
        config = getattr(transformers, kind).from_dict(raw)
    except Exception as e:  # e.g. an unknown feed_forward_proj
        raise ModelLoadError(f"{where} is not a valid {name} config: {flat(e)}; {hint}.") from None
    if config.dense_act_fn not in _T5_ACTIVATIONS:
        raise ModelLoadError(
            f"{where} uses the activation {config.dense_act_fn!r}, but only "
            f"{', '.join(_T5_ACTIVATIONS)} are supported; {hint}."
        )
    return T5EncoderConfig(
        vocab_size=config.vocab_size,
        d_model=config.d_model,
        d_kv=config.d_kv,
        d_ff=config.d_ff,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
        layer_norm_epsilon=config.layer_norm_epsilon,
        gated=config.is_gated_act,
        activation=config.dense_act_fn,
        bias_per_block=umt5,
    )


def t5_config(folder: Path, hint: str) -> T5EncoderConfig:
    raw = read_config(folder, "t5", "a T5 encoder", hint)
    return t5_encoder_config(raw, folder / "config.json", hint)


def load_t5(
    root: Path,
    encoder_name: str,
    tokenizer_name: str,
    dtype,
    hint: str,
    *,
    max_length: int,
    width: int,
) -> FrozenEncoder:
    """A `T5EncoderModel` folder as a FrozenEncoder returning last hidden states [B, L, D];
    D (T5's d_model) must be `width`, the transformer's joint_attention_dim."""
    folder = files.component_dir(root, encoder_name, ("config.json",), hint)
    tokenizer = load_t5_tokenizer(files.component_dir(root, tokenizer_name, (), hint), hint)
    config = t5_config(folder, hint)
    if config.d_model != width:
        raise ModelLoadError(
            f"{folder / 'config.json'} has d_model {config.d_model}, but the transformer's "
            f"joint_attention_dim is {width}; {hint}."
        )
    module = T5Encoder(config, dtype)
    ids = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids)["params"])
    state = untie_t5(files.read_weights(folder, "model", hint))
    params = convert.folder_to_flax(
        folder, state, convert.shapes_of(shapes), hint, merge_indices=False
    )

    @jax.jit
    def run(params, ids):
        return module.apply({"params": params}, ids)

    return FrozenEncoder(folder, tokenizer, max_length, run, cast_floats(params, dtype))


def check_t5_max_length(t5_max_length: int) -> None:
    """The pipelines' `max_sequence_length` must be in [1, 512]; else one sentence."""
    if not 1 <= t5_max_length <= T5_MAX_LENGTH:
        raise ValueError(f"t5_max_length must be in [1, {T5_MAX_LENGTH}], got {t5_max_length}.")


def pack_conditioning(prompt_embeds, pooled) -> jax.Array:
    """[P, T, D] and [P, Q] -> [P, T + 1, max(D, Q)]: a pooled text vector carried as one last
    token, zero-padded, so that a prompt's conditioning is one array (SD3: D = 4096 >
    Q = 2048; FLUX.1: 4096 > 768). The denoisers take it apart again."""
    width = max(prompt_embeds.shape[-1], pooled.shape[-1])
    prompt_embeds = jnp.pad(prompt_embeds, ((0, 0), (0, 0), (0, width - prompt_embeds.shape[-1])))
    pooled = jnp.pad(pooled, ((0, 0), (0, width - pooled.shape[-1])))
    return jnp.concatenate([prompt_embeds, pooled[:, None, :]], axis=1)


def unpack_conditioning(cond, width: int, pooled_width: int) -> tuple[jax.Array, jax.Array]:
    """[P, T + 1, D] -> ([P, T, width], [P, pooled_width]): what `pack_conditioning` packed."""
    return cond[:, :-1, :width], cond[:, -1, :pooled_width]


class PromptCache:
    """What the text encoders of the T5 families share: a host `cache` of every prompt
    encoded so far, filled by their `_compute(prompts)` a `batch_size` at a time, and a
    releasable `t5`."""

    @property
    def needs_t5(self) -> bool:
        """Whether encoding a prompt runs T5 (an encoder may be built without it)."""
        return True

    def precompute(self, prompts: Sequence[str]) -> None:
        """Encodes and caches every prompt not cached yet."""
        if isinstance(prompts, str):
            raise TypeError("precompute takes a list of prompts, not one string.")
        self._compute([p for p in dict.fromkeys(prompts) if p not in self.cache])

    def drop_t5(self) -> None:
        """Releases T5's parameters; only prompts cached so far can be encoded afterwards."""
        self.t5 = None

    def _batches(self, prompts: list[str]):
        """(prompts, the same padded with "" to `batch_size`) per batch of new prompts; one
        sentence when T5 is needed but dropped."""
        if prompts and self.needs_t5 and self.t5 is None:
            more = f" (and {len(prompts) - 1} more)" if len(prompts) > 1 else ""
            raise ValueError(
                f"the prompt {echo(prompts[0])}{more} is not cached and T5 was dropped, so it "
                "cannot be encoded; precompute every prompt before calling drop_t5()."
            )
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            yield chunk, chunk + [""] * (self.batch_size - len(chunk))

    def _cached(self, prompts: Sequence[str]) -> list[str]:
        """`prompts` as a list, every one of them encoded and cached."""
        if isinstance(prompts, str):
            raise TypeError("encode takes a list of prompts, not one string.")
        prompts = list(prompts)
        self.precompute(prompts)
        return prompts

    def conditioning(self, prompts: Sequence[str]) -> jax.Array:
        """The prompts' `pack_conditioning` of their `encode` (a model's `encode_prompts`)."""
        embeds, pooled = self.encode(list(prompts))
        return pack_conditioning(jnp.asarray(embeds), jnp.asarray(pooled))

    def encode_ahead(self, prompts: Sequence[str], limit: int) -> str:
        """Encodes up to `limit` distinct prompts and releases T5 (a model's
        `prepare_prompts`); says what it did."""
        unique = list(dict.fromkeys(prompts))
        if len(unique) > limit:
            return (
                f"{len(unique)} prompts are more than the {limit} encoded ahead, "
                "so T5 stays loaded and encodes prompts as they come"
            )
        self.precompute(unique)
        self.drop_t5()
        return f"{len(unique)} prompts encoded ahead; T5 released"
