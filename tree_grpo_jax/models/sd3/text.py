"""Stable Diffusion 3's text side: CLIP-L, CLIP-G and T5-XXL, joined as diffusers joins them.

A diffusers-layout SD3 / SD3.5 folder holds `text_encoder/` and `text_encoder_2/` (transformers
`CLIPTextModelWithProjection`, CLIP-L and CLIP-G), `text_encoder_3/` (a `T5EncoderModel`,
T5-XXL) and a tokenizer folder for each. The weights are PyTorch safetensors (sharded or not),
converted in numpy by `weights.convert`; torch is never imported. The CLIP towers run in
transformers' Flax CLIP module. T5 runs in `T5Encoder` below, a Flax T5 encoder with the
parameter tree of transformers' `FlaxT5EncoderModule`: that module no longer traces on JAX
0.10 (it calls `jnp.clip(a_max=...)`).

`SD3TextEncoders.encode` returns what `StableDiffusion3Pipeline.encode_prompt` returns
(clip_skip None, one image per prompt, no guidance): each CLIP tower's penultimate hidden
states over its tokenizer's 77 padded ids (no attention mask, so padding is part of the
sequence; SD3's `tokenizer_2` pads with "!", `tokenizer` with "<|endoftext|>"), concatenated
on features, zero-padded to T5's width and followed on the sequence axis by T5's last hidden
states over `t5_max_length` padded ids (zeros without T5); the pooled vector is the two
projected CLIP `text_embeds` concatenated.

Embeddings are computed once per distinct prompt and kept on the host, so a training run can
`precompute` its prompts and `drop_t5` to free the 4.7B T5 parameters.

Measured against diffusers' `StableDiffusion3Pipeline.encode_prompt` on a tiny random folder
(tests/test_sd3_text.py, float32 on CPU): max abs difference 2.3e-6 in prompt_embeds (T5's
part, outputs up to 0.75; the CLIP part 6.3e-7) and 1.2e-6 in pooled; without T5, 6.3e-7 and
1.2e-6. T5's part is float32 rounding, about 3e-6 of its magnitude: on the same model,
transformers' Flax T5 (its bucket function repaired) gives `T5Encoder`'s outputs bit for bit.
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

from tree_grpo_jax.models.base import ModelLoadError, cast_floats
from tree_grpo_jax.weights import convert, files

POINT = "point --config.model.path at a local diffusers-layout Stable Diffusion 3 folder"
CLIP_FOLDERS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))
T5_FOLDERS = ("text_encoder_3", "tokenizer_3")
_CLIP_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
# `T5EncoderModel` ties the encoder's embedding to `shared`; files may carry either name.
_T5_TIED = ("encoder.embed_tokens.weight", "shared.weight")
_T5_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}

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
    block owns (`has_relative_bias`) and every block reuses."""

    config: T5EncoderConfig
    has_relative_bias: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, bias):
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
        weights = jax.nn.softmax(scores + bias.astype(jnp.float32), axis=-1)
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
    def __call__(self, x, bias):
        norm = T5LayerNorm(self.config.layer_norm_epsilon, self.dtype, name="layer_norm")
        attention = T5SelfAttention(
            self.config, self.has_relative_bias, self.dtype, name="SelfAttention"
        )
        out, bias = attention(norm(x), bias)
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
    def __call__(self, x, bias):
        x, bias = _T5AttentionSublayer(self.config, self.has_relative_bias, self.dtype, name="0")(
            x, bias
        )
        return _T5FeedForwardSublayer(self.config, self.dtype, name="1")(x), bias


class _T5Blocks(nn.Module):  # `encoder/block`
    config: T5EncoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        bias = None
        for i in range(self.config.num_layers):
            block = _T5Block(self.config, i == 0, self.dtype, name=str(i))
            x, bias = block(x, bias)
        return x


class _T5Block(nn.Module):  # `encoder/block/i`
    config: T5EncoderConfig
    has_relative_bias: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, bias):
        return _T5Sublayers(self.config, self.has_relative_bias, self.dtype, name="layer")(x, bias)


class _T5Stack(nn.Module):  # `encoder`
    config: T5EncoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = _T5Blocks(self.config, self.dtype, name="block")(x)
        return T5LayerNorm(self.config.layer_norm_epsilon, self.dtype, name="final_layer_norm")(x)


class T5Encoder(nn.Module):
    """ids [B, L] -> T5's last hidden states [B, L, d_model], with no attention mask (SD3
    feeds T5 none: padding tokens are attended to)."""

    config: T5EncoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, ids):
        c = self.config
        embed = nn.Embed(c.vocab_size, c.d_model, dtype=self.dtype, name="shared")
        return _T5Stack(c, self.dtype, name="encoder")(embed(ids))


# ---------------------------------------------------------------------------------------------
# Loading.


def _folder(root: Path, name: str, needed: Sequence[str]) -> Path:
    return files.component_dir(root, name, needed, POINT)


def _read_config(folder: Path, model_type: str, what: str) -> dict:
    config = files.read_json(folder / "config.json", POINT)
    found = config.get("model_type", model_type)
    if found != model_type:
        raise ModelLoadError(
            f"{folder / 'config.json'} has model_type {found!r}, but {folder.name}/ must hold "
            f"{what} (model_type {model_type!r}); {POINT}."
        )
    return config


def _read_weights(folder: Path) -> dict[str, np.ndarray]:
    state = files.read_safetensors_stem(folder, "model", POINT)
    if state is not None:
        return state
    if files.has_pickles(folder):
        raise ModelLoadError(
            f"{folder} holds only PyTorch pickle weights, which need torch to read; save them "
            f"as model.safetensors or {POINT} that has safetensors files."
        )
    raise ModelLoadError(f"{folder} has no model.safetensors (or its index); {POINT}.")


def _convert(folder: Path, state, reference) -> dict:
    try:
        return convert.pytorch_to_flax(state, reference, merge_indices=False)
    except convert.ParamTreeMismatch as e:
        raise ModelLoadError(
            f"the weights in {folder} do not match its config ({e}); {POINT}."
        ) from None


def _untie_t5(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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


def _load_clip_tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    try:
        return CLIPTokenizer.from_pretrained(str(folder))
    except Exception as e:  # a broken tokenizer folder is a load error
        raise ModelLoadError(f"could not read the tokenizer in {folder}: {e}; {POINT}.") from None


def _load_t5_tokenizer(folder: Path):
    from transformers import T5TokenizerFast

    if not (folder / "tokenizer.json").is_file() and not (folder / "spiece.model").is_file():
        raise ModelLoadError(
            f"{folder} has neither tokenizer.json nor spiece.model, so T5's tokenizer cannot "
            f"be read; {POINT}."
        )
    try:  # tokenizer.json needs only `tokenizers`; spiece.model alone needs sentencepiece
        return T5TokenizerFast.from_pretrained(str(folder))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"could not read the T5 tokenizer in {folder} ({reason}); {POINT}."
        ) from None


def _load_clip(root: Path, encoder_name: str, tokenizer_name: str, dtype, max_length: int | None):
    """A `CLIPTextModelWithProjection` folder as a FrozenEncoder returning
    (penultimate hidden states [B, L, hidden], projected pooled `text_embeds` [B, proj])."""
    from transformers import CLIPTextConfig
    from transformers.models.clip.modeling_flax_clip import FlaxCLIPTextModelWithProjectionModule

    folder = _folder(root, encoder_name, ("config.json",))
    tokenizer = _load_clip_tokenizer(_folder(root, tokenizer_name, _CLIP_TOKENIZER_FILES))
    raw = _read_config(folder, "clip_text_model", "a CLIP text encoder with projection")
    try:
        config = CLIPTextConfig.from_dict(raw)
    except Exception as e:
        raise ModelLoadError(
            f"{folder / 'config.json'} is not a valid CLIP text config: {e}; {POINT}."
        ) from None
    if config.num_hidden_layers < 2:
        raise ModelLoadError(
            f"{folder / 'config.json'} has {config.num_hidden_layers} layer, but SD3 reads the "
            f"penultimate hidden states; {POINT}."
        )
    length = max_length or min(tokenizer.model_max_length, config.max_position_embeddings)
    if length > config.max_position_embeddings:
        raise ModelLoadError(
            f"the CLIP prompt length {length} exceeds the {config.max_position_embeddings} "
            f"positions of {folder}; {POINT}."
        )
    module = FlaxCLIPTextModelWithProjectionModule(config=config, dtype=dtype)
    ids = jnp.zeros((1, length), jnp.int32)
    positions = jnp.arange(length)[None]
    shapes = jax.eval_shape(
        lambda: module.init(jax.random.PRNGKey(0), ids, jnp.ones_like(ids), positions)["params"]
    )
    params = _convert(folder, _read_weights(folder), convert.shapes_of(shapes))

    @jax.jit
    def run(params, ids):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        out = module.apply(
            {"params": params},
            ids,
            jnp.ones_like(ids),  # the pipeline passes no mask; CLIP's causal mask still applies
            positions,
            deterministic=True,
            output_hidden_states=True,
        )
        return out.hidden_states[-2], out.text_embeds

    encoder = FrozenEncoder(folder, tokenizer, length, run, cast_floats(params, dtype))
    return encoder, config


def _t5_config(folder: Path) -> T5EncoderConfig:
    from transformers import T5Config

    raw = _read_config(folder, "t5", "a T5 encoder")
    try:
        config = T5Config.from_dict(raw)
    except Exception as e:  # e.g. an unknown feed_forward_proj
        raise ModelLoadError(
            f"{folder / 'config.json'} is not a valid T5 config: {e}; {POINT}."
        ) from None
    if config.dense_act_fn not in _T5_ACTIVATIONS:
        raise ModelLoadError(
            f"{folder / 'config.json'} uses the activation {config.dense_act_fn!r}, but only "
            f"{', '.join(_T5_ACTIVATIONS)} are supported; {POINT}."
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
    )


def _load_t5(root: Path, dtype, max_length: int, width: int) -> FrozenEncoder:
    """A `T5EncoderModel` folder as a FrozenEncoder returning last hidden states [B, L, D]."""
    encoder_name, tokenizer_name = T5_FOLDERS
    folder = _folder(root, encoder_name, ("config.json",))
    tokenizer = _load_t5_tokenizer(_folder(root, tokenizer_name, ()))
    config = _t5_config(folder)
    if config.d_model != width:
        raise ModelLoadError(
            f"{folder / 'config.json'} has d_model {config.d_model}, but the transformer's "
            f"joint_attention_dim is {width}; {POINT}."
        )
    module = T5Encoder(config, dtype)
    ids = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids)["params"])
    state = _untie_t5(_read_weights(folder))
    params = _convert(folder, state, convert.shapes_of(shapes))

    @jax.jit
    def run(params, ids):
        return module.apply({"params": params}, ids)

    return FrozenEncoder(folder, tokenizer, max_length, run, cast_floats(params, dtype))


# ---------------------------------------------------------------------------------------------
# The three encoders together.


@dataclasses.dataclass(eq=False, kw_only=True)
class SD3TextEncoders:
    """CLIP-L, CLIP-G and (optionally) T5, with a host cache of every prompt encoded so far.

    `encode` runs the encoders only on prompts not yet cached, `batch_size` at a time (the
    last batch padded with empty prompts, so each encoder compiles once). The cache keeps the
    encoders' outputs in their own dtype, which loses nothing: in bfloat16 a prompt takes
    about 2.4 MB with T5 at 256 tokens, 0.3 MB without. `drop_t5` releases T5's parameters;
    from then on only cached prompts can be encoded.
    """

    clip_l: FrozenEncoder
    clip_g: FrozenEncoder
    t5: FrozenEncoder | None  # None without T5, or after drop_t5
    use_t5: bool
    t5_max_length: int
    width: int  # SD3's joint_attention_dim (T5's d_model): the features of every token
    pooled_dim: int  # CLIP-L's plus CLIP-G's projection_dim
    batch_size: int = 8
    cache: dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray]] = dataclasses.field(
        default_factory=dict
    )

    @property
    def sequence_length(self) -> int:
        return self.clip_l.max_length + self.t5_max_length

    def _compute(self, prompts: list[str]) -> None:
        if prompts and self.use_t5 and self.t5 is None:
            more = f" (and {len(prompts) - 1} more)" if len(prompts) > 1 else ""
            raise ValueError(
                f"the prompt {prompts[0]!r}{more} is not cached and T5 was dropped, so it "
                "cannot be encoded; precompute every prompt before calling drop_t5()."
            )
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            padded = chunk + [""] * (self.batch_size - len(chunk))
            hidden_l, pooled_l = self.clip_l(padded)
            hidden_g, pooled_g = self.clip_g(padded)
            clip = np.concatenate([np.asarray(hidden_l), np.asarray(hidden_g)], axis=-1)
            pooled = np.concatenate([np.asarray(pooled_l), np.asarray(pooled_g)], axis=-1)
            t5 = np.asarray(self.t5(padded)) if self.t5 is not None else None
            for i, prompt in enumerate(chunk):
                self.cache[prompt] = (clip[i], None if t5 is None else t5[i], pooled[i])

    def precompute(self, prompts: Sequence[str]) -> None:
        """Encodes and caches every prompt not cached yet."""
        if isinstance(prompts, str):
            raise TypeError("precompute takes a list of prompts, not one string.")
        self._compute([p for p in dict.fromkeys(prompts) if p not in self.cache])

    def drop_t5(self) -> None:
        """Releases T5's parameters; only prompts cached so far can be encoded afterwards."""
        self.t5 = None

    def encode(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """prompts -> (prompt_embeds [B, 77 + t5_max_length, width], pooled [B, pooled_dim]),
        float32 numpy, as `StableDiffusion3Pipeline.encode_prompt` computes them."""
        if isinstance(prompts, str):
            raise TypeError("encode takes a list of prompts, not one string.")
        prompts = list(prompts)
        self.precompute(prompts)
        embeds = np.zeros((len(prompts), self.sequence_length, self.width), np.float32)
        pooled = np.zeros((len(prompts), self.pooled_dim), np.float32)
        clip_length = self.clip_l.max_length
        for i, prompt in enumerate(prompts):
            clip, t5, pooled[i] = self.cache[prompt]
            embeds[i, :clip_length, : clip.shape[-1]] = clip
            if t5 is not None:
                embeds[i, clip_length:] = t5
        return embeds, pooled


def check_t5_max_length(t5_max_length: int) -> None:
    """The pipeline's `max_sequence_length` must be in [1, 512]; else one sentence."""
    if not 1 <= t5_max_length <= 512:
        raise ValueError(f"t5_max_length must be in [1, 512], got {t5_max_length}.")


def load_text_encoders(
    root: Path,
    dtype=jnp.float32,
    *,
    use_t5: bool = True,
    t5_max_length: int = 256,
    joint_attention_dim: int = 4096,
    batch_size: int = 8,
) -> SD3TextEncoders:
    """The text side of a diffusers-layout SD3 folder at `root`.

    `dtype` is the encoders' param and compute dtype (outputs are float32). With
    `use_t5=False` nothing under `text_encoder_3/` or `tokenizer_3/` is read and T5's part of
    the sequence is zeros. Every token has `joint_attention_dim` features (the transformer's;
    T5's d_model must equal it). `t5_max_length` is the pipeline's `max_sequence_length` (at
    most 512); `batch_size` bounds how many new prompts each encoder runs on at once.
    """
    root = Path(root)
    check_t5_max_length(t5_max_length)
    (l_encoder, l_tokenizer), (g_encoder, g_tokenizer) = CLIP_FOLDERS
    clip_l, config_l = _load_clip(root, l_encoder, l_tokenizer, dtype, None)
    # The pipeline pads both CLIP prompts to the first tokenizer's length.
    clip_g, config_g = _load_clip(root, g_encoder, g_tokenizer, dtype, clip_l.max_length)
    clip_width = config_l.hidden_size + config_g.hidden_size
    if clip_width > joint_attention_dim:
        raise ModelLoadError(
            f"the CLIP encoders in {root} have {clip_width} features together, more than the "
            f"transformer's joint_attention_dim {joint_attention_dim}; {POINT}."
        )
    t5 = _load_t5(root, dtype, t5_max_length, joint_attention_dim) if use_t5 else None
    return SD3TextEncoders(
        clip_l=clip_l,
        clip_g=clip_g,
        t5=t5,
        use_t5=use_t5,
        t5_max_length=t5_max_length,
        width=joint_attention_dim,
        batch_size=batch_size,
        pooled_dim=config_l.projection_dim + config_g.projection_dim,
    )
