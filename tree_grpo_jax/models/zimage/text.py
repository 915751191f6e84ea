"""Z-Image's text side: the second-to-last hidden states of its Qwen3 text encoder over the
prompt in the tokenizer's chat template, as ZImagePipeline gives them.

A diffusers-layout Z-Image folder holds `text_encoder/` (a transformers `Qwen3Model`,
Qwen3-4B in the release) and `tokenizer/` (a Qwen2 byte-level BPE with a chat template). The
encoder runs in Flax (`models.decoder_text`); torch is never imported.

`ZImageTextEncoder.encode` returns what `ZImagePipeline.encode_prompt` returns for its
prompts: one array per prompt, its valid tokens' states [tokens_i, hidden]. The trainer needs
one array per batch, so `conditioning` pads them to `max_length` tokens and appends the mask
as one last feature: [P, max_length, hidden + 1] (`decoder_prompts.pack_embeddings`;
`decoder_prompts.split_conditioning` takes it apart for the denoiser, whose transformer
leaves the padding out of attention).

Embeddings are computed once per distinct prompt and kept on the host, so a run can encode
its prompts ahead (`encode_ahead`) and release the encoder's parameters.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import decoder_prompts, decoder_text
from tree_grpo_jax.models.base import ModelLoadError

POINT = "point --config.model.path at a local diffusers-layout Z-Image folder"


@dataclasses.dataclass(eq=False, kw_only=True)
class ZImageTextEncoder(decoder_prompts.CachedPromptStates):
    """`decoder_prompts.CachedPromptStates` of Z-Image's prompts: `run` gives the
    second-to-last states [B, L, D]; `encode` returns what `ZImagePipeline.encode_prompt`
    returns."""

    def batch_states(self, prompts: list[str]) -> list[np.ndarray]:
        ids, mask = decoder_text.z_image_prompt_inputs(self.tokenizer, prompts, self.max_length)
        hidden = self.run(self.params, jnp.asarray(ids), jnp.asarray(mask))
        return decoder_text.z_image_prompt_embeds(np.float32(hidden), mask)


def check_max_length(max_length: int) -> None:
    if max_length < 1:
        raise ModelLoadError(f"the text max_length must be at least 1, got {max_length}.")


def load_text_encoder(
    root: Path, dtype=jnp.float32, *, max_length: int, width: int, batch_size: int = 8
) -> ZImageTextEncoder:
    """The text side of a diffusers-layout Z-Image folder at `root`: `dtype` is the encoder's
    param and compute dtype (embeddings are cached in float32); its hidden size must be the
    transformer's `cap_feat_dim` (`width`)."""
    return decoder_prompts.load_cached_states(
        ZImageTextEncoder,
        root,
        dtype,
        max_length=max_length,
        width=("cap_feat_dim", width),
        batch_size=batch_size,
        check_max_length=check_max_length,
        model_type="qwen3",
        what="a Qwen3 text encoder",
        layer=decoder_text.Z_IMAGE_LAYER,
        point=POINT,
        chat_template=True,
    )
