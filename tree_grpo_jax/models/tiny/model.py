"""The tiny model as a `TextToImageModel`: its two twins, shipped or random weights.

`ddim` predicts epsilon on SD's scaled_linear schedule and samples with DDIM; `flow` is a
rectified-flow model that predicts velocity. Both share the networks and the prompt grammar.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from tree_grpo_jax.models.abstract import AbstractModel
from tree_grpo_jax.models.base import (
    DDIMScheduleConfig,
    FlowScheduleConfig,
    TextToImageModel,
    cast_floats,
)
from tree_grpo_jax.models.tiny import grammar, networks, tokenizer
from tree_grpo_jax.models.tiny.weights import KINDS, TRAIN_COMMAND, load_weights, weights_path

_SCHEDULES = {"ddim": DDIMScheduleConfig(prediction_type="epsilon"), "flow": FlowScheduleConfig()}


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class TinyModel(TextToImageModel):
    """A tiny digits model; `prompts` are the prompts it was trained on, one per digit."""

    kind: str  # "ddim" or "flow"
    prompts: tuple[str, ...] = grammar.DIGIT_PROMPTS
    styled_prompts: tuple[str, ...] = grammar.STYLED_PROMPTS


_encode_tokens_jit = jax.jit(networks.encode_tokens)  # shared: models of one dtype compile it once


def _prompt_encoder(text_params):
    def encode_prompts(prompts: Sequence[str]) -> jax.Array:
        ids, mask = tokenizer.tokenize(list(prompts))
        cond = _encode_tokens_jit(text_params, jnp.asarray(ids), jnp.asarray(mask))
        return cond.astype(jnp.float32)

    return encode_prompts


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")


def model_from_weights(
    kind: str, weights: dict, dtype=jnp.float32, name: str | None = None
) -> TinyModel:
    """Wraps `{"unet", "text_encoder"}` weights as a `TinyModel` of the given kind."""
    _check_kind(kind)
    return TinyModel(
        name=name or f"tiny-{kind}",
        sample_shape=networks.SAMPLE_SHAPE,
        params=cast_floats(weights["unet"], dtype),
        denoise=networks.denoise_fn(jnp.dtype(dtype)),
        encode_prompts=_prompt_encoder(cast_floats(weights["text_encoder"], dtype)),
        decode=networks.decode,
        schedule_config=_SCHEDULES[kind],
        kind=kind,
        programs_from_code=True,
    )


def build_tiny(kind: str = "ddim", seed: int = 0, dtype=jnp.float32) -> TinyModel:
    """The tiny model with random weights (for tests of components that need any model)."""
    return model_from_weights(
        kind, networks.random_weights(seed), dtype, name=f"tiny-{kind}-random"
    )


def load_tiny(kind: str = "ddim", dtype=jnp.float32, path=None) -> TinyModel:
    """The trained tiny model: `kind="ddim"` (epsilon, DDIM) or `"flow"` (velocity)."""
    _check_kind(kind)
    path = pathlib.Path(path) if path is not None else weights_path(kind)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; run `{TRAIN_COMMAND} --kind={kind}`.")
    return model_from_weights(kind, load_weights(path, kind), dtype)


def _decode_pixels(params, x):
    del params  # pixel space: nothing to decode with
    return networks.decode(x)


def abstract_tiny(kind: str = "ddim", dtype=jnp.float32) -> AbstractModel:
    """The tiny model as shapes: its networks' initialisation under `jax.eval_shape`."""
    _check_kind(kind)
    weights = jax.eval_shape(networks.init_weights, jax.random.key(0))
    return AbstractModel(
        name=f"tiny-{kind}",
        source="the tiny model's architecture",
        sample_shape=networks.SAMPLE_SHAPE,
        params=jax.eval_shape(lambda w: cast_floats(w, dtype), weights["unet"]),
        denoise=networks.denoise_fn(jnp.dtype(dtype)),
        cond_shape=(tokenizer.MAX_LENGTH, networks.TEXT_CONFIG["hidden_size"]),
        schedule_config=_SCHEDULES[kind],
        decode=_decode_pixels,
        decode_params={},
    )
