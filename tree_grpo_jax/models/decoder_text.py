"""Decoder-only language models run as prompt encoders, in Flax: the text models of Qwen2 and
Qwen2.5-VL (Qwen-Image's prompt encoder), Qwen3 (Z-Image's, FLUX.2 klein's) and Mistral
(Mistral 3's language model: FLUX.2 dev's), one module told apart by its config.

Every one is a token embedding, blocks of (RMSNorm, grouped-query causal self-attention with
rotary positions, RMSNorm, SwiGLU MLP) and a final RMSNorm. The families differ in biases on
the attention projections, RMSNorm on each head's queries and keys (Qwen3) and a sliding
attention window (Mistral). Run as an encoder, the model takes token ids and a padding mask
and returns the hidden states transformers reports (`hidden_states`): the embeddings, each
block's output, the last of them through the final norm (or the ones a caller picks).

Qwen2.5-VL's rotary positions are multimodal (three position axes, each rotating its own
sections of the channels); for text alone the three axes hold the same positions, which is
the 1D rotary of Qwen2. Positions are 0..L-1 whatever the padding, as transformers counts
them when no position ids are given.

Params are named as transformers' modules (`layers_3/self_attn/q_proj/kernel`); with
`scan_layers` the blocks are one scanned module `layers_0_to_{N-1}` over stacked params
(`weights.stacking`). `params_from_state_dict` converts a transformers state dict.

The `*_prompt_inputs` and `*_prompt_embeds` functions are what the Qwen-Image and Z-Image
pipelines do around their text encoder: the chat template, the tokenizer's padding, which
hidden state they take and which tokens they keep.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.errors import flat
from tree_grpo_jax.models.dit_layers import (
    COMPUTE_DTYPES,
    Attention,
    Layer,
    RMSNorm,
    check_runtime,
    rematerialized,
)
from tree_grpo_jax.weights import convert, stacking

# transformers `model_type`s this module runs; a Qwen2.5-VL or Mistral 3 config is read for its
# text model.
MODEL_TYPES = ("qwen2", "qwen2_5_vl", "qwen2_5_vl_text", "qwen3", "mistral", "mistral3")
# Vision-language configs whose `text_config` is the language model (Mistral 3's a Mistral).
_WRAPPED_TEXT = {"qwen2_5_vl": ("qwen2_5_vl_text",), "mistral3": ("mistral",)}
_QWEN2_TYPES = ("qwen2", "qwen2_5_vl", "qwen2_5_vl_text")
# Rotary types that are the plain 1D rotary for text ("mrope": older Qwen2.5-VL configs).
_ROPE_TYPES = ("default", "mrope")
# Where a checkpoint keeps the text model: transformers' current and older layouts of a
# causal LM, and of Qwen2.5-VL (`model.language_model.*` now, `model.*` in older files).
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_TEXT_MODULES = ("embed_tokens.", "layers.", "norm.")
# Weights an encoder does not use: the LM head, a vision tower and its projector.
IGNORED_PREFIXES = (
    "lm_head.",
    "visual.",
    "model.visual.",
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)

# Qwen-Image (`QwenImagePipeline`): a system turn describing images, the prompt as the user
# turn, then the assistant's header. The first 34 tokens (the system turn and the user
# header) are dropped from the last hidden state, which has been through the final norm.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_DROP = 34
QWEN_IMAGE_MAX_LENGTH = 1024  # prompt tokens kept after the drop
QWEN_IMAGE_LAYER = -1
# Z-Image (`ZImagePipeline`): the tokenizer's own chat template (one user message, the
# generation prompt, thinking enabled), padded to 512 tokens; the output of the
# second-to-last block (no final norm), at the prompt's tokens only.
Z_IMAGE_MAX_LENGTH = 512
Z_IMAGE_LAYER = -2


@dataclasses.dataclass(frozen=True)
class DecoderTextConfig:
    """The fields of a transformers Qwen2 / Qwen2.5-VL text / Qwen3 / Mistral config that the
    encoder reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj (Qwen2)
    out_bias: bool = False  # a bias on o_proj (Qwen3 with attention_bias)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (Qwen3)
    sliding_window: int | None = None  # a query sees this many keys at most (Mistral)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} attention heads do not split into groups of "
                f"{self.num_kv_heads} key/value heads."
            )


def config_from_transformers(config) -> DecoderTextConfig:
    """The encoder's config from a transformers config object or its `config.json` dict
    (model_type one of MODEL_TYPES; Qwen2.5-VL's and Mistral 3's text part). ValueError (one
    sentence) for a model or an option the encoder does not implement."""
    if isinstance(config, Mapping):
        config = _config_object(dict(config))
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not a decoder text model this encoder runs; "
            f"choose one of {', '.join(MODEL_TYPES)}."
        )
    if model_type in _WRAPPED_TEXT:
        config = config.text_config
        text_type = getattr(config, "model_type", None)
        if text_type not in _WRAPPED_TEXT[model_type]:
            raise ValueError(
                f"the {model_type} config's text model is {text_type!r}, not "
                f"{' or '.join(_WRAPPED_TEXT[model_type])}."
            )
        model_type = text_type
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu).")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (only the default rotary).")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"the {model_type} config gives no rope_theta.")
    sliding_window = None
    if model_type == "mistral":
        sliding_window = config.sliding_window
    elif "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(f"sliding-window layers of {model_type} are not supported.")
    heads = config.num_attention_heads
    qwen3_bias = model_type == "qwen3" and bool(config.attention_bias)
    return DecoderTextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=config.num_key_value_heads or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(theta),
        qkv_bias=model_type in _QWEN2_TYPES or qwen3_bias,
        out_bias=qwen3_bias,
        qk_norm=model_type == "qwen3",
        sliding_window=sliding_window,
    )


def _config_object(raw: dict):
    """A `config.json` dict as its transformers config class, which reads older files' keys
    (`rope_theta` and `rope_scaling` at the top) into the current ones."""
    from transformers import AutoConfig

    model_type = raw.pop("model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not a decoder text model this encoder runs; "
            f"choose one of {', '.join(MODEL_TYPES)}."
        )
    try:
        return AutoConfig.for_model(model_type, **raw)
    except Exception as e:  # noqa: BLE001 (any invalid value: one sentence)
        raise ValueError(f"the {model_type} config is not valid: {flat(e)}.") from None


# ---------------------------------------------------------------------------------------------
# Positions and masks.


def rotary_tables(length: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [length, head_dim / 2] float32 of positions 0..length-1: float32
    frequencies and angles as PyTorch's float32 computes them, their cos and sin taken in
    float64 and rounded."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inverse = np.float32(1.0) / np.power(np.float32(theta), exponents, dtype=np.float32)
    angles = np.arange(length, dtype=np.float32)[:, None] * inverse[None, :]
    angles = angles.astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotate_halves(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding with the channels' first half as the real parts and the second half
    as the imaginary parts (transformers' `rotate_half` layout; `dit_layers.rotate_pairs`
    is the interleaved one): x [B, S, heads, head_dim], cos and sin [S, head_dim / 2];
    float32, rounded to x's dtype."""
    chex.assert_rank(x, 4)
    chex.assert_shape([cos, sin], (x.shape[1], x.shape[-1] // 2))
    real, imag = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = jnp.concatenate([real * cos - imag * sin, imag * cos + real * sin], axis=-1)
    return rotated.astype(x.dtype)


def causal_mask(
    padding: jax.Array | None, length: int, sliding_window: int | None = None
) -> jax.Array:
    """[B or 1, 1, L, L] bool, True where a query may attend a key: the key is not after the
    query, within `sliding_window` of it when there is one, and not padding (`padding`
    [B, L], nonzero at tokens). A padded query with no token before it (left padding)
    attends nothing; the backends give it a finite state, which no caller keeps."""
    query = jnp.arange(length)[:, None]
    key = jnp.arange(length)[None, :]
    allowed = key <= query
    if sliding_window is not None:
        allowed = allowed & (query - key < sliding_window)
    allowed = allowed[None, None]
    if padding is None:
        return allowed
    chex.assert_shape(padding, (None, length))
    return allowed & (padding != 0)[:, None, None, :]


# ---------------------------------------------------------------------------------------------
# Layers.


class SelfAttention(Attention):
    """Grouped-query self-attention: `num_heads` query heads share `num_kv_heads` key and
    value heads in consecutive groups, keys and queries rotated (after their per-head norm
    when there is one)."""

    num_kv_heads: int = 1
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x, mask, cos, sin):
        batch, length = x.shape[:2]
        kv_width = self.num_kv_heads * self.head_dim
        query = self._heads(self.dense(self.width, use_bias=self.qkv_bias, name="q_proj")(x))
        key = self.dense(kv_width, use_bias=self.qkv_bias, name="k_proj")(x)
        value = self.dense(kv_width, use_bias=self.qkv_bias, name="v_proj")(x)
        key = key.reshape(batch, length, self.num_kv_heads, self.head_dim)
        value = value.reshape(batch, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            query = RMSNorm(eps=self.eps, name="q_norm", **self.dtypes)(query)
            key = RMSNorm(eps=self.eps, name="k_norm", **self.dtypes)(key)
        query, key = rotate_halves(query, cos, sin), rotate_halves(key, cos, sin)
        # Key/value head j serves query heads j * group .. (j + 1) * group - 1; repeated, every
        # backend sees as many heads on each side.
        group = self.heads // self.num_kv_heads
        key, value = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)
        attended = self._attend(query, key, value, mask)
        return self.dense(x.shape[-1], use_bias=self.out_bias, name="o_proj")(attended)


class SwiGLU(Layer):
    """`down_proj(silu(gate_proj x) * up_proj x)`, no biases."""

    intermediate_size: int = 1

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(self.dense, use_bias=False)
        gate = dense(self.intermediate_size, name="gate_proj")(x)
        up = dense(self.intermediate_size, name="up_proj")(x)
        return dense(x.shape[-1], name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(Layer):
    """One block: x + attention(norm x), then + MLP(norm x)."""

    config: DecoderTextConfig | None = None
    attention: str = "xla"  # model.attention: a `models.attention` backend name

    @nn.compact
    def __call__(self, x, mask, cos, sin):
        c = self.config
        norm = functools.partial(RMSNorm, eps=c.rms_norm_eps, **self.dtypes)
        attention = SelfAttention(
            heads=c.num_heads,
            head_dim=c.head_dim,
            attention=self.attention,
            num_kv_heads=c.num_kv_heads,
            qkv_bias=c.qkv_bias,
            out_bias=c.out_bias,
            qk_norm=c.qk_norm,
            eps=c.rms_norm_eps,
            name="self_attn",
            **self.dtypes,
        )
        x = x + attention(norm(name="input_layernorm")(x), mask, cos, sin)
        mlp = SwiGLU(intermediate_size=c.intermediate_size, name="mlp", **self.dtypes)
        return x + mlp(norm(name="post_attention_layernorm")(x))


class _ScannedLayer(DecoderLayer):
    """A block in the call `nn.scan` makes: (x, *inputs) -> (next x, next x), so that the scan
    stacks every block's output."""

    def __call__(self, x, mask, cos, sin):
        out = DecoderLayer.__call__(self, x, mask, cos, sin)
        return out, out


class DecoderTextModel(nn.Module):
    """ids [B, L] (and `attention_mask` [B, L], 1 at tokens, 0 at padding) -> the hidden
    states [B, L, hidden] transformers gives as `hidden_states`: index 0 the embeddings,
    index i the output of block i, the last (index N) through the final norm. `layer` picks
    one of them by that index (negative from the end: -1 the normed last state, -2 the
    second-to-last block's output), or a tuple of such indices picks those states, a tuple
    in that order; without it, all N + 1 come back as a tuple. Unscanned, picked layers run
    only the blocks they need."""

    config: DecoderTextConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    attention: str = "xla"  # model.attention: a `models.attention` backend name
    # Each block recomputes its forward in the backward pass: a REMAT_MODES name.
    remat: str = "none"
    # The blocks as one `nn.scan` over params stacked on a leading layer axis.
    scan_layers: bool = False

    def setup(self):
        self.check()
        c = self.config
        dtypes = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, **dtypes)
        layer = dict(config=c, attention=self.attention, **dtypes)
        if self.scanned:
            scanned = nn.scan(
                self._remat(_ScannedLayer, scanned=True),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast,) * 3,
                length=c.num_layers,
            )
            # Flax names a dict entry `layers_<key>`: `layers_0_to_{N-1}`.
            self.layers = {stacking.stacked_name("", 0, c.num_layers - 1)[1:]: scanned(**layer)}
        else:
            block = self._remat(DecoderLayer, scanned=False)
            self.layers = [block(**layer) for _ in range(c.num_layers)]
        self.norm = RMSNorm(eps=c.rms_norm_eps, **dtypes)

    @property
    def scanned(self) -> bool:
        return self.scan_layers and self.config.num_layers > 1

    def check(self) -> None:
        """The run-time fields' values (one-sentence ValueError)."""
        if jnp.dtype(self.dtype) not in COMPUTE_DTYPES:
            raise ValueError(f"Compute dtype {self.dtype} is not float32 or bfloat16.")
        check_runtime(self.remat, self.attention)

    def _remat(self, block, scanned: bool):
        return rematerialized(block, self.remat, scanned)

    def __call__(self, input_ids, attention_mask=None, *, layer: int | Sequence[int] | None = None):
        c = self.config
        chex.assert_rank(input_ids, 2)
        count = c.num_layers + 1
        picked = None if layer is None else (layer,) if isinstance(layer, int) else tuple(layer)
        for index in picked or ():
            if not -count <= index < count:
                raise ValueError(f"layer {index} is not one of the {count} hidden states.")
        length = input_ids.shape[1]
        mask = causal_mask(attention_mask, length, c.sliding_window)
        cos, sin = (jnp.asarray(t) for t in rotary_tables(length, c.head_dim, c.rope_theta))
        embedded = x = self.embed_tokens(input_ids.astype(jnp.int32))
        if self.scanned:
            (scanned,) = self.layers.values()
            x, outputs = scanned(x, mask, cos, sin)
            states = [outputs[i] for i in range(c.num_layers)]
        else:
            # Blocks past the last one asked for are not run.
            last = c.num_layers if picked is None else max(i % count for i in picked)
            states = []
            for block in self.layers[:last]:
                x = block(x, mask, cos, sin)
                states.append(x)
        hidden = [embedded, *states]
        if len(states) == c.num_layers:
            hidden[-1] = self.norm(x)
        if layer is None:
            return tuple(hidden)
        states = tuple(hidden[i % count] for i in picked)
        return states[0] if isinstance(layer, int) else states


def param_shapes(module: DecoderTextModel):
    """The module's param tree as shape structs (nothing computed)."""
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids)["params"])


# ---------------------------------------------------------------------------------------------
# Weights.


def text_state_dict(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The text model's tensors of a transformers state dict, named from the text model down
    (`layers.0.self_attn.q_proj.weight`): the prefixes of TEXT_PREFIXES removed, the LM head
    and vision tower (IGNORED_PREFIXES) left out; any other key is kept as it is (it then
    shows as unexpected)."""
    out = {}
    for key, value in state.items():
        if key.startswith(IGNORED_PREFIXES):
            continue
        name = key
        for prefix in TEXT_PREFIXES:
            if key.startswith(prefix) and key[len(prefix) :].startswith(_TEXT_MODULES):
                name = key[len(prefix) :]
                break
        out[name] = value
    return out


def params_from_state_dict(state: Mapping[str, np.ndarray], module: DecoderTextModel) -> dict:
    """A transformers state dict (numpy arrays) as `module`'s params: linear weights
    transposed into kernels, norm weights as scales, stacked for a scanned module.
    `convert.ParamTreeMismatch` names missing, unexpected and mis-shaped tensors."""
    shapes = param_shapes(module)
    per_block = convert.shapes_of(stacking.unstack(dict(shapes)))
    tree = convert.pytorch_to_flax(text_state_dict(state), per_block, merge_indices=True)
    return stacking.stack(tree, shapes)


# ---------------------------------------------------------------------------------------------
# The pipelines' prompts.


def _tokenize(tokenizer, texts: list[str], **options) -> tuple[np.ndarray, np.ndarray]:
    tokens = tokenizer(texts, truncation=True, return_tensors="np", **options)
    return np.asarray(tokens.input_ids, np.int32), np.asarray(tokens.attention_mask, np.int32)


def qwen_image_prompt_inputs(
    tokenizer,
    prompts: Sequence[str],
    max_length: int = QWEN_IMAGE_MAX_LENGTH,
    drop: int = QWEN_IMAGE_DROP,
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask) [B, L] int32 of Qwen-Image's prompts: each in the template,
    padded to the longest, at most `max_length + drop` tokens."""
    texts = [QWEN_IMAGE_TEMPLATE.format(p) for p in _prompt_list(prompts)]
    return _tokenize(tokenizer, texts, padding=True, max_length=max_length + drop)


def qwen_image_prompt_embeds(
    hidden: jax.Array, attention_mask: jax.Array, drop: int = QWEN_IMAGE_DROP
) -> tuple[jax.Array, jax.Array]:
    """Qwen-Image's prompt embeddings from the normed last hidden states [B, L, D]: each
    row's tokens (padding on either side skipped) after its first `drop`, moved to the front
    and zero-padded: ([B, L - drop, D], mask [B, L - drop] int32). With the tokenizer's
    padding to the longest prompt, L - drop is the pipeline's length; padded longer, the
    extra columns are zeros with mask 0."""
    chex.assert_rank(hidden, 3)
    chex.assert_shape(attention_mask, hidden.shape[:2])
    valid = attention_mask != 0
    # Stable: the tokens first, in order, then the padding.
    order = jnp.argsort(~valid, axis=1, stable=True)[:, drop:]
    kept = jnp.sum(valid, axis=1, keepdims=True) - drop
    mask = jnp.arange(order.shape[1])[None, :] < kept
    embeds = jnp.take_along_axis(hidden, order[..., None], axis=1)
    embeds = jnp.where(mask[..., None], embeds, jnp.zeros((), hidden.dtype))
    return embeds, mask.astype(jnp.int32)


def z_image_prompt_inputs(
    tokenizer, prompts: Sequence[str], max_length: int = Z_IMAGE_MAX_LENGTH
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask) [B, max_length] int32 of Z-Image's prompts: each as one user
    message in the tokenizer's chat template with the generation prompt (thinking enabled),
    padded (and truncated) to `max_length`."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )
        for p in _prompt_list(prompts)
    ]
    return _tokenize(tokenizer, texts, padding="max_length", max_length=max_length)


def z_image_prompt_embeds(hidden, attention_mask) -> list[np.ndarray]:
    """Z-Image's prompt embeddings from the second-to-last block's output [B, L, D]: each
    row's states at its tokens, [tokens_i, D] (host arrays, one per prompt)."""
    hidden, valid = np.asarray(hidden), np.asarray(attention_mask) != 0
    chex.assert_shape(valid, hidden.shape[:2])
    return [row[keep] for row, keep in zip(hidden, valid)]


def _prompt_list(prompts) -> list[str]:
    return [prompts] if isinstance(prompts, str) else list(prompts)
