"""Stable Diffusion 3's text side: CLIP-L, CLIP-G and T5-XXL, joined as diffusers joins them.

A diffusers-layout SD3 / SD3.5 folder holds `text_encoder/` and `text_encoder_2/` (transformers
`CLIPTextModelWithProjection`, CLIP-L and CLIP-G), `text_encoder_3/` (a `T5EncoderModel`,
T5-XXL) and a tokenizer folder for each. The weights are PyTorch safetensors (sharded or not),
converted in numpy; torch is never imported. The encoders and their loading are shared
(`models/text_encoders.py`: our Flax CLIP text towers from `models/clip.py`, and `T5Encoder`,
our Flax T5 encoder); this module joins them as SD3 does.

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
(tests/parity/test_sd3_text.py, float32 on CPU): max abs difference 2.3e-6 in prompt_embeds (T5's
part, outputs up to 0.75; the CLIP part 6.3e-7) and 1.2e-6 in pooled; without T5, 6.3e-7 and
1.2e-6. T5's part is float32 rounding, about 3e-6 of its magnitude: on the same model,
transformers' Flax T5 (its bucket function repaired) gives `T5Encoder`'s outputs bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import text_encoders
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.text_encoders import (  # noqa: F401 - T5's pieces, re-exported
    FrozenEncoder,
    T5Encoder,
    T5EncoderConfig,
    check_t5_max_length,
    load_clip,
    load_t5,
    relative_position_buckets,
)

POINT = "point --config.model.path at a local diffusers-layout Stable Diffusion 3 folder"
CLIP_FOLDERS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))
T5_FOLDERS = ("text_encoder_3", "tokenizer_3")


def _load_clip(root: Path, encoder_name: str, tokenizer_name: str, dtype, max_length: int | None):
    """A `CLIPTextModelWithProjection` folder as a FrozenEncoder returning (penultimate hidden
    states [B, L, hidden], projected pooled `text_embeds` [B, proj]), and its config."""
    encoder, config = load_clip(
        root, encoder_name, tokenizer_name, dtype, POINT, projection=True, max_length=max_length
    )
    if config.num_hidden_layers < 2:
        raise ModelLoadError(
            f"{encoder.folder / 'config.json'} has {config.num_hidden_layers} layer, but SD3 "
            f"reads the penultimate hidden states; {POINT}."
        )
    return encoder, config


# ---------------------------------------------------------------------------------------------
# The three encoders together.


@dataclasses.dataclass(eq=False, kw_only=True)
class SD3TextEncoders(text_encoders.PromptCache):
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

    @property
    def needs_t5(self) -> bool:
        return self.use_t5

    def _compute(self, prompts: list[str]) -> None:
        for chunk, padded in self._batches(prompts):
            hidden_l, pooled_l = self.clip_l(padded)
            hidden_g, pooled_g = self.clip_g(padded)
            clip = np.concatenate([np.asarray(hidden_l), np.asarray(hidden_g)], axis=-1)
            pooled = np.concatenate([np.asarray(pooled_l), np.asarray(pooled_g)], axis=-1)
            t5 = np.asarray(self.t5(padded)) if self.t5 is not None else None
            for i, prompt in enumerate(chunk):
                self.cache[prompt] = (clip[i], None if t5 is None else t5[i], pooled[i])

    def encode(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """prompts -> (prompt_embeds [B, 77 + t5_max_length, width], pooled [B, pooled_dim]),
        float32 numpy, as `StableDiffusion3Pipeline.encode_prompt` computes them."""
        prompts = self._cached(prompts)
        embeds = np.zeros((len(prompts), self.sequence_length, self.width), np.float32)
        pooled = np.zeros((len(prompts), self.pooled_dim), np.float32)
        clip_length = self.clip_l.max_length
        for i, prompt in enumerate(prompts):
            clip, t5, pooled[i] = self.cache[prompt]
            embeds[i, :clip_length, : clip.shape[-1]] = clip
            if t5 is not None:
                embeds[i, clip_length:] = t5
        return embeds, pooled


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
    t5 = None
    if use_t5:
        t5 = load_t5(
            root,
            *T5_FOLDERS,
            dtype,
            POINT,
            max_length=t5_max_length,
            width=joint_attention_dim,
        )
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
