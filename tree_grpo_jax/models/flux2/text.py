"""FLUX.2's prompts: what `Flux2Pipeline.encode_prompt` (dev, a Mistral 3 text encoder) and
`Flux2KleinPipeline.encode_prompt` (klein, Qwen3) give the transformer, with the package's
decoder text encoder (`models.decoder_text`) in place of transformers' model.

Both pipelines pad every prompt to 512 tokens and take three intermediate hidden states (dev:
10, 20, 30 of Mistral Small 3.1's 40 blocks; klein: 9, 18, 27 of Qwen3's 36), concatenated
per token: embeddings [B, 512, 3 * hidden], padding included (the transformer attends to all
of them). Their text position ids are [B, L, 4], (0, 0, 0, token index).

- dev: each prompt is a conversation of a system turn (`SYSTEM_MESSAGE`, the text the model
  was trained with) and the prompt as the user turn, its contents as typed text parts,
  "[IMG]" removed from the prompt; the tokenizer's (or processor's) chat template renders
  and tokenizes the batch at once, without a generation prompt.
- klein: each prompt is one user message in the tokenizer's chat template with the
  generation prompt and thinking disabled, rendered to text and then tokenized.

Torch is never imported.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_LENGTH = 512  # both pipelines' default max_sequence_length
DEV_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers
KLEIN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers
TEXT_ID_AXES = 4  # (time, row, column, token) of the transformer's 4-axis rotary

# The dev pipeline's system turn: FLUX.2 was trained on prompts in this conversation, so it
# must be these exact characters.
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses "
    "focusing on object relationships, object\nattribution and actions without speculation."
)
_IMAGE_TOKEN = "[IMG]"  # removed from dev prompts, which carry no images here


def _prompt_list(prompts) -> list[str]:
    return [prompts] if isinstance(prompts, str) else list(prompts)


def dev_conversations(prompts: Sequence[str], system_message: str = SYSTEM_MESSAGE) -> list:
    """Each prompt as the dev pipeline's conversation: the system turn, then the prompt
    (without "[IMG]") as the user turn, each content one typed text part."""

    def text(value):
        return [{"type": "text", "text": value}]

    return [
        [
            {"role": "system", "content": text(system_message)},
            {"role": "user", "content": text(p.replace(_IMAGE_TOKEN, ""))},
        ]
        for p in _prompt_list(prompts)
    ]


def dev_prompt_inputs(
    tokenizer, prompts: Sequence[str], max_length: int = MAX_LENGTH
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask) [B, max_length] int32 of dev prompts: the conversations through
    the tokenizer's (or the processor's) chat template at once, padded and truncated to
    `max_length`."""
    tokens = tokenizer.apply_chat_template(
        dev_conversations(prompts),
        add_generation_prompt=False,
        tokenize=True,
        return_dict=True,
        return_tensors="np",
        padding="max_length",
        truncation=True,
        max_length=max_length,
    )
    return np.asarray(tokens["input_ids"], np.int32), np.asarray(tokens["attention_mask"], np.int32)


def klein_prompt_inputs(
    tokenizer, prompts: Sequence[str], max_length: int = MAX_LENGTH
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask) [B, max_length] int32 of klein prompts: each one user message in
    the chat template with the generation prompt, thinking disabled, padded and truncated
    to `max_length`."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        for p in _prompt_list(prompts)
    ]
    tokens = tokenizer(
        texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="np"
    )
    return np.asarray(tokens.input_ids, np.int32), np.asarray(tokens.attention_mask, np.int32)


def stacked_embeds(states: Sequence[jax.Array]) -> jax.Array:
    """The picked hidden states, each [B, L, D], as the transformer's prompt embeddings
    [B, L, len(states) * D]: per token, the states in the order given, side by side."""
    return jnp.concatenate(list(states), axis=-1)


def text_ids(batch: int, length: int) -> np.ndarray:
    """The pipelines' text position ids [B, length, 4] int32: (0, 0, 0, token index)."""
    ids = np.zeros((batch, length, TEXT_ID_AXES), np.int32)
    ids[..., -1] = np.arange(length)
    return ids


def prompt_embeds(encoder, params, ids, mask, layers: Sequence[int]):
    """(embeddings [B, L, len(layers) * hidden], text ids [B, L, 4]) of tokenized prompts:
    `encoder` a `decoder_text.DecoderTextModel`, `layers` DEV_LAYERS or KLEIN_LAYERS (the
    hidden-state indices transformers counts, 0 the embeddings)."""
    states = encoder.apply({"params": params}, ids, mask, layer=tuple(layers))
    return stacked_embeds(states), text_ids(*np.shape(ids))
