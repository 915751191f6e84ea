"""FLUX.1's text side: CLIP-L's pooled output and T5-XXL's hidden states, as FluxPipeline
gives them.

A diffusers-layout FLUX.1 folder holds `text_encoder/` (a transformers `CLIPTextModel`,
CLIP-L, no projection), `text_encoder_2/` (a `T5EncoderModel`, T5-XXL) and the tokenizers
`tokenizer/` and `tokenizer_2/`. The encoders and their loading are shared
(`models/text_encoders.py`); torch is never imported.

`FluxTextEncoders.encode` returns what `FluxPipeline.encode_prompt` returns (one image per
prompt, `prompt_2` the prompt itself): prompt_embeds, T5's last hidden states over
`t5_max_length` padded ids with no attention mask [P, t5_max_length, 4096], and pooled,
CLIP-L's `pooler_output` over its tokenizer's 77 padded ids [P, 768]. The text position ids
are zeros and are made by the denoiser.

Embeddings are computed once per distinct prompt and kept on the host, so a training run can
`precompute` its prompts and `drop_t5` to free the 4.7B T5 parameters.

Measured against `FluxPipeline.encode_prompt` on a tiny random folder
(tests/parity/test_flux_model.py, float32 on CPU): max abs difference 2.5e-7 in
prompt_embeds (outputs up to 0.55) and 1.0e-6 in pooled (up to 2.7).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import text_encoders
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.text_encoders import (
    FrozenEncoder,
    check_t5_max_length,
    load_clip,
    load_t5,
)

POINT = "point --config.model.path at a local diffusers-layout FLUX.1 folder"
CLIP_FOLDERS = ("text_encoder", "tokenizer")
T5_FOLDERS = ("text_encoder_2", "tokenizer_2")


@dataclasses.dataclass(eq=False, kw_only=True)
class FluxTextEncoders(text_encoders.PromptCache):
    """CLIP-L and T5, with a host cache of every prompt encoded so far.

    `encode` runs the encoders only on prompts not yet cached, `batch_size` at a time (the
    last batch padded with empty prompts, so each encoder compiles once). The cache keeps the
    outputs in the encoders' dtype: in bfloat16 a prompt takes 4.2 MB with T5 at 512 tokens.
    `drop_t5` releases T5's parameters; from then on only cached prompts can be encoded.
    """

    clip: FrozenEncoder
    t5: FrozenEncoder | None  # None after drop_t5
    t5_max_length: int
    width: int  # T5's d_model, the transformer's joint_attention_dim
    pooled_dim: int  # CLIP-L's hidden size, the transformer's pooled_projection_dim
    batch_size: int = 8
    cache: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)

    def _compute(self, prompts: list[str]) -> None:
        for chunk, padded in self._batches(prompts):
            _, pooled = self.clip(padded)
            pooled = np.asarray(pooled)
            sequence = np.asarray(self.t5(padded))
            for i, prompt in enumerate(chunk):
                self.cache[prompt] = (sequence[i], pooled[i])

    def encode(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """prompts -> (prompt_embeds [P, t5_max_length, width], pooled [P, pooled_dim]),
        float32 numpy, as `FluxPipeline.encode_prompt` computes them."""
        prompts = self._cached(prompts)
        embeds = np.stack([self.cache[p][0] for p in prompts]).astype(np.float32)
        pooled = np.stack([self.cache[p][1] for p in prompts]).astype(np.float32)
        return embeds, pooled


def load_text_encoders(
    root: Path,
    dtype=jnp.float32,
    *,
    t5_max_length: int = 512,
    joint_attention_dim: int = 4096,
    pooled_projection_dim: int = 768,
    batch_size: int = 8,
) -> FluxTextEncoders:
    """The text side of a diffusers-layout FLUX.1 folder at `root`.

    `dtype` is the encoders' param and compute dtype (outputs are float32). T5's d_model must
    be the transformer's `joint_attention_dim` and CLIP-L's hidden size its
    `pooled_projection_dim`. `t5_max_length` is the pipeline's `max_sequence_length` (at most
    512: FLUX.1-dev's default, 256 for schnell); `batch_size` bounds how many new prompts each
    encoder runs on at once.
    """
    root = Path(root)
    try:
        check_t5_max_length(t5_max_length)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    clip, config = load_clip(root, *CLIP_FOLDERS, dtype, POINT, projection=False)
    if config.hidden_size != pooled_projection_dim:
        raise ModelLoadError(
            f"{clip.folder / 'config.json'} has hidden_size {config.hidden_size}, but the "
            f"transformer's pooled_projection_dim is {pooled_projection_dim}; {POINT}."
        )
    t5 = load_t5(
        root, *T5_FOLDERS, dtype, POINT, max_length=t5_max_length, width=joint_attention_dim
    )
    return FluxTextEncoders(
        clip=clip,
        t5=t5,
        t5_max_length=t5_max_length,
        width=joint_attention_dim,
        pooled_dim=pooled_projection_dim,
        batch_size=batch_size,
    )
