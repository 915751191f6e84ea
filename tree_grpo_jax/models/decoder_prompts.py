"""What the families whose prompts are a decoder text model's states (Z-Image, Qwen-Image)
share: a host cache of each prompt's states [tokens_i, hidden], and the one conditioning
array per batch the trainer needs.

A pipeline gives a different number of states per prompt; `pack_embeddings` pads them to
`max_length` tokens and appends the mask as one last feature, [P, max_length, hidden + 1],
and `split_conditioning` takes it apart for the denoiser, whose transformer leaves the
padding out of attention. `CachedPromptStates` computes each distinct prompt once, a batch
at a time, with the family's `batch_states`, so that a run can encode its prompts ahead
(`encode_ahead`) and release the encoder's parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.errors import first_line
from tree_grpo_jax.models import decoder_text
from tree_grpo_jax.models.base import ModelLoadError, cast_floats
from tree_grpo_jax.models.text_encoders import read_config
from tree_grpo_jax.weights import convert, files

ENCODER_FOLDER, TOKENIZER_FOLDER = "text_encoder", "tokenizer"


def split_conditioning(cond: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[P, L, hidden + 1] -> (prompt states [P, L, hidden], prompt mask [P, L] bool)."""
    return cond[..., :-1], cond[..., -1] > 0.5


def pack_embeddings(embeds: Sequence[np.ndarray], length: int) -> np.ndarray:
    """Per-prompt states [tokens_i, hidden] -> [P, length, hidden + 1] float32: the states
    at the front, zeros after, the last feature 1 at the tokens and 0 at the padding."""
    width = embeds[0].shape[-1]
    packed = np.zeros((len(embeds), length, width + 1), np.float32)
    for row, states in zip(packed, embeds):
        row[: len(states), :width] = states
        row[: len(states), width] = 1.0
    return packed


@dataclasses.dataclass(eq=False, kw_only=True)
class CachedPromptStates:
    """The tokenizer and the jitted Flax encoder, with a host cache of every prompt encoded
    so far. New prompts are encoded `batch_size` at a time (the last batch padded with empty
    prompts, so the encoder compiles once) by `batch_states`, which a family defines.
    `release` drops the encoder's parameters; from then on only cached prompts can be
    encoded."""

    tokenizer: Any
    run: Callable  # (params, ids [B, L], mask [B, L]) -> the states the family takes
    params: Any  # None once released
    max_length: int  # states per prompt at most: the conditioning's length
    width: int  # the encoder's hidden size, the transformer's text width
    batch_size: int = 8
    cache: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def batch_states(self, prompts: list[str]) -> list[np.ndarray]:
        """`batch_size` prompts -> their states [tokens_i, width] float32 each."""
        raise NotImplementedError

    def precompute(self, prompts: Sequence[str]) -> None:
        """Encodes and caches every prompt not cached yet."""
        if isinstance(prompts, str):
            raise TypeError("precompute takes a list of prompts, not one string.")
        new = [p for p in dict.fromkeys(prompts) if p not in self.cache]
        if new and self.params is None:
            raise ValueError(
                f"the prompt {new[0]!r} is not cached and the text encoder was released, so "
                "it cannot be encoded; precompute every prompt before releasing it."
            )
        for start in range(0, len(new), self.batch_size):
            chunk = new[start : start + self.batch_size]
            states = self.batch_states(chunk + [""] * (self.batch_size - len(chunk)))
            self.cache.update(zip(chunk, states))

    def encode(self, prompts: Sequence[str]) -> list[np.ndarray]:
        """prompts -> [tokens_i, width] float32 each."""
        if isinstance(prompts, str):
            raise TypeError("encode takes a list of prompts, not one string.")
        self.precompute(list(prompts))
        return [self.cache[p] for p in prompts]

    def conditioning(self, prompts: Sequence[str]) -> jax.Array:
        """The prompts' `pack_embeddings` (a model's `encode_prompts`)."""
        return jnp.asarray(pack_embeddings(self.encode(list(prompts)), self.max_length))

    def release(self) -> None:
        self.params = None

    def encode_ahead(self, prompts: Sequence[str], limit: int) -> str:
        """Encodes up to `limit` distinct prompts and releases the encoder (a model's
        `prepare_prompts`); says what it did."""
        unique = list(dict.fromkeys(prompts))
        if len(unique) > limit:
            return (
                f"{len(unique)} prompts are more than the {limit} encoded ahead, so the text "
                "encoder stays loaded and encodes prompts as they come"
            )
        self.precompute(unique)
        self.release()
        return f"{len(unique)} prompts encoded ahead; text encoder released"


def load_tokenizer(folder: Path, point: str, chat_template: bool = False):
    """The transformers tokenizer in `folder` (one sentence naming it when it cannot be
    read, or lacks the chat template a family's prompts go through)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ModelLoadError(
            f"could not read the tokenizer in {folder} ({first_line(e)}); {point}."
        ) from None
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"the tokenizer in {folder} has no chat template; {point}.")
    return tokenizer


def load_encoder(
    folder: Path, dtype, *, model_type: str, what: str, width: tuple, layer: int, point: str
):
    """(run, params) of the decoder text model in a transformers folder: `run(params, ids,
    mask)` gives the hidden states numbered `layer` (`decoder_text.DecoderTextModel`), jitted;
    params in `dtype`. `width`: (the transformer's field, its value) the hidden size must
    equal; `model_type` and `what` name the model the folder must hold."""
    raw = read_config(folder, model_type, what, point)
    try:
        config = decoder_text.config_from_transformers(raw)
    except ValueError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {first_line(e)}; {point}.") from None
    field, size = width
    if config.hidden_size != size:
        raise ModelLoadError(
            f"{folder / 'config.json'} has hidden_size {config.hidden_size}, but the "
            f"transformer's {field} is {size}; {point}."
        )
    module = decoder_text.DecoderTextModel(config, dtype=dtype, param_dtype=dtype)
    state = files.read_weights(folder, "model", point)
    with convert.weights_of(folder, point):
        params = decoder_text.params_from_state_dict(state, module)

    @jax.jit
    def run(params, ids, mask):
        return module.apply({"params": params}, ids, mask, layer=layer)

    return run, cast_floats(params, dtype)


def load_cached_states(
    cls: type[CachedPromptStates],
    root: Path,
    dtype,
    *,
    max_length: int,
    width: tuple[str, int],
    batch_size: int,
    check_max_length: Callable[[int], None],
    model_type: str,
    what: str,
    layer: int,
    point: str,
    chat_template: bool = False,
):
    """`cls`, a family's `CachedPromptStates`, of the `text_encoder/` and `tokenizer/` of a
    pipeline folder `root`: `check_max_length` refuses a `max_length` the family cannot
    give; `model_type`, `what`, `width`, `layer` are `load_encoder`'s, `chat_template`
    `load_tokenizer`'s."""
    folder = files.component_dir(root, ENCODER_FOLDER, ("config.json",), point)
    tokenizer = load_tokenizer(
        files.component_dir(root, TOKENIZER_FOLDER, (), point), point, chat_template
    )
    check_max_length(max_length)
    run, params = load_encoder(
        folder, dtype, model_type=model_type, what=what, width=width, layer=layer, point=point
    )
    return cls(
        tokenizer=tokenizer,
        run=run,
        params=params,
        max_length=max_length,
        width=width[1],
        batch_size=batch_size,
    )
