"""Wan2.1's text side: the umT5 encoder (transformers' `UMT5EncoderModel`, umt5-xxl in the
release) in Flax, its tokenizer, and the prompt encoding of WanPipeline.

umT5 is T5's encoder (`models.text_encoders.T5Encoder`, gated-GELU feed-forward) with one
difference: every block owns its relative-position bias table. Unlike the SD3 and FLUX
pipelines, WanPipeline passes the padding mask to the encoder and then zeroes every state past
each prompt's length, so `encode(ids, mask)` gives [B, L, d_model] with zeros from each
prompt's end to L. Prompts are cleaned first as the pipeline cleans them (HTML entities
unescaped, runs of whitespace made one space; `ftfy`'s repairs too when it is installed, as
there).
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.base import ModelLoadError, cast_floats
from tree_grpo_jax.models.text_encoders import (
    T5_MAX_LENGTH,
    T5Encoder,
    T5EncoderConfig,
    load_t5_tokenizer,
    read_config,
    t5_encoder_config,
    untie_t5,
)
from tree_grpo_jax.weights import convert, files

WAN_MAX_LENGTH = 512  # WanPipeline's default max_sequence_length


def prompt_clean(text: str) -> str:
    """WanPipeline's `prompt_clean`: ftfy's fixes (when installed), HTML entities unescaped
    twice, whitespace runs as one space, stripped."""
    try:
        import ftfy
    except ImportError:
        pass
    else:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def umt5_config(raw: dict, where: Path | str, hint: str) -> T5EncoderConfig:
    """The encoder's settings from a `UMT5Config` dict (a `text_encoder/config.json`)."""
    return t5_encoder_config(raw, where, hint, umt5=True)


def umt5_module(config: T5EncoderConfig, dtype=jnp.float32) -> T5Encoder:
    return T5Encoder(dataclasses.replace(config, bias_per_block=True), dtype)


def umt5_shapes(module: T5Encoder) -> dict:
    """The encoder's params as ShapeDtypeStructs (nothing is computed)."""
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids, ids)["params"])


def convert_umt5(state: dict[str, np.ndarray], config: T5EncoderConfig) -> dict:
    """`UMT5EncoderModel` weights -> the encoder's Flax params (numpy, their dtype). The
    embedding may be under `shared.weight`, `encoder.embed_tokens.weight` or both; a missing,
    extra or mis-shaped weight is a ParamTreeMismatch naming it."""
    reference = convert.shapes_of(umt5_shapes(umt5_module(config)))
    return convert.pytorch_to_flax(untie_t5(state), reference, merge_indices=False)


def encode_fn(module: T5Encoder) -> Callable:
    """`encode(params, ids [B, L] int, mask [B, L] 0/1) -> states [B, L, d_model]`, jitted:
    the masked encoder's last hidden states, zero from each prompt's length (its mask's sum)
    on, as WanPipeline pads `prompt_embeds[:length]` with zeros."""

    @jax.jit
    def encode(params, ids, mask):
        states = module.apply({"params": params}, ids, mask)
        length = jnp.sum(mask > 0, axis=1)
        inside = jnp.arange(ids.shape[1])[None, :] < length[:, None]
        return jnp.where(inside[..., None], states, jnp.zeros((), states.dtype))

    return encode


@dataclasses.dataclass(frozen=True, eq=False)
class UMT5Encoder:
    """umT5 loaded: its tokenizer, `encode(params, ids, mask)` and params; called on prompts,
    gives WanPipeline's `prompt_embeds` [P, max_length, d_model]."""

    folder: Path
    tokenizer: Any
    max_length: int  # every prompt is padded or truncated to this many tokens
    encode: Callable
    params: Any
    clean: Callable[[str], str] = prompt_clean  # applied to each prompt before tokenizing

    def tokenize(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask), each [P, max_length] int32, of the cleaned prompts."""
        if isinstance(prompts, str):
            raise TypeError("tokenize takes a list of prompts, not one string.")
        tokens = self.tokenizer(
            [self.clean(p) for p in prompts],
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="np",
        )
        return tokens.input_ids.astype(np.int32), tokens.attention_mask.astype(np.int32)

    def __call__(self, prompts: Sequence[str]) -> jax.Array:
        ids, mask = self.tokenize(prompts)
        return self.encode(self.params, jnp.asarray(ids), jnp.asarray(mask))


def load_umt5(
    root: Path,
    dtype,
    hint: str,
    *,
    max_length: int = WAN_MAX_LENGTH,
    encoder_name: str = "text_encoder",
    tokenizer_name: str = "tokenizer",
    width: int | None = None,
    clean: Callable[[str], str] = prompt_clean,
) -> UMT5Encoder:
    """The umT5 encoder and tokenizer of a Wan diffusers folder (`text_encoder/` with its
    config.json and safetensors, sharded or not; `tokenizer/`), without torch; one sentence
    (ModelLoadError ending in `hint`) for a folder that does not fit, or whose d_model is not
    `width` (the transformer's text_dim) when given."""
    if not 1 <= max_length <= T5_MAX_LENGTH:
        raise ValueError(f"t5_max_length must be in [1, {T5_MAX_LENGTH}], got {max_length}.")
    folder = files.component_dir(root, encoder_name, ("config.json",), hint)
    tokenizer = load_t5_tokenizer(files.component_dir(root, tokenizer_name, (), hint), hint)
    raw = read_config(folder, "umt5", "a umT5 encoder", hint)
    config = umt5_config(raw, folder / "config.json", hint)
    if width is not None and config.d_model != width:
        raise ModelLoadError(
            f"{folder / 'config.json'} has d_model {config.d_model}, but the transformer's "
            f"text_dim is {width}; {hint}."
        )
    state = files.read_weights(folder, "model", hint)
    with convert.weights_of(folder, hint):
        params = convert_umt5(state, config)
    module = umt5_module(config, dtype)
    params = cast_floats(params, dtype)
    return UMT5Encoder(folder, tokenizer, max_length, encode_fn(module), params, clean)


def load_prompt_encoder(
    root: Path,
    dtype,
    hint: str,
    *,
    max_length: int,
    width: int,
    clean: Callable[[str], str] = prompt_clean,
) -> UMT5Encoder:
    """`load_umt5` of a Wan folder's `text_encoder/` and `tokenizer/`, its d_model checked
    against `width`: called on a list of prompts, gives their states [P, max_length, width]."""
    return load_umt5(root, dtype, hint, max_length=max_length, width=width, clean=clean)
