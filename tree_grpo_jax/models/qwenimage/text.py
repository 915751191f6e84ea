"""Qwen-Image's text side: the last hidden states (through the final norm) of its Qwen2.5-VL
text model over the prompt in the pipeline's system template, the template's first 34 tokens
dropped, as QwenImagePipeline gives them.

A diffusers-layout Qwen-Image folder holds `text_encoder/` (a transformers
`Qwen2_5_VLForConditionalGeneration`, Qwen2.5-VL-7B in the release; only its language model
is read, the vision tower and the LM head are skipped) and `tokenizer/` (a Qwen2 byte-level
BPE). The encoder runs in Flax (`models.decoder_text`); torch is never imported.

`QwenImageTextEncoder.encode` returns what `QwenImagePipeline.encode_prompt` returns for its
prompts with `max_sequence_length = max_length`, each row cut at its mask: one array per
prompt, [tokens_i, hidden]. The pipeline truncates the states after the encoder ran; the
encoder is causal, so tokenizing only the first `max_length + 34` tokens gives the same
states. The trainer needs one array per batch, so `conditioning` pads them to `max_length`
tokens and appends the mask as one last feature: [P, max_length, hidden + 1]
(`decoder_prompts.pack_embeddings`; `decoder_prompts.split_conditioning` takes it apart for
the denoiser, whose transformer masks the padding out of attention).

Embeddings are computed once per distinct prompt and kept on the host, so a run can encode
its prompts ahead (`encode_ahead`) and release the encoder's parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import decoder_prompts, decoder_text
from tree_grpo_jax.models.base import ModelLoadError

POINT = "point --config.model.path at a local diffusers-layout Qwen-Image folder"
DROP = decoder_text.QWEN_IMAGE_DROP


def padded_inputs(tokenizer, prompts: Sequence[str], max_length: int):
    """(ids, mask) [B, max_length + DROP] int32: the pipeline's tokens of each templated
    prompt, cut at `max_length` kept tokens, right-padded to that length so that every batch
    has one shape (the encoder is causal: padding behind changes no state in front)."""
    ids, mask = decoder_text.qwen_image_prompt_inputs(tokenizer, prompts, max_length, DROP)
    width = max_length + DROP
    pad = ((0, 0), (0, width - ids.shape[1]))
    return np.pad(ids, pad), np.pad(mask, pad)


@dataclasses.dataclass(eq=False, kw_only=True)
class QwenImageTextEncoder(decoder_prompts.CachedPromptStates):
    """`decoder_prompts.CachedPromptStates` of Qwen-Image's prompts: `run` gives the normed
    last states [B, L, D]; `encode` returns the rows of `QwenImagePipeline.encode_prompt` at
    their mask."""

    def batch_states(self, prompts: list[str]) -> list[np.ndarray]:
        ids, mask = padded_inputs(self.tokenizer, prompts, self.max_length)
        hidden = self.run(self.params, jnp.asarray(ids), jnp.asarray(mask))
        states, kept = decoder_text.qwen_image_prompt_embeds(hidden, jnp.asarray(mask), DROP)
        states, counts = np.float32(states), np.asarray(kept).sum(axis=1)
        return [row[:n] for row, n in zip(states, counts)]


def check_max_length(max_length: int) -> None:
    kept = decoder_text.QWEN_IMAGE_MAX_LENGTH
    if not 1 <= max_length <= kept:
        raise ModelLoadError(
            f"the text max_length must be in [1, {kept}] (the tokens QwenImagePipeline's "
            f"tokenizer keeps), got {max_length}."
        )


def load_text_encoder(
    root: Path, dtype=jnp.float32, *, max_length: int, width: int, batch_size: int = 8
) -> QwenImageTextEncoder:
    """The text side of a diffusers-layout Qwen-Image folder at `root`: `dtype` is the
    encoder's param and compute dtype (embeddings are cached in float32); its hidden size
    must be the transformer's `joint_attention_dim` (`width`)."""
    return decoder_prompts.load_cached_states(
        QwenImageTextEncoder,
        root,
        dtype,
        max_length=max_length,
        width=("joint_attention_dim", width),
        batch_size=batch_size,
        check_max_length=check_max_length,
        model_type="qwen2_5_vl",
        what="a Qwen2.5-VL text encoder",
        layer=decoder_text.QWEN_IMAGE_LAYER,
        point=POINT,
    )
