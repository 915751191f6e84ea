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

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.errors import first_line
from tree_grpo_jax.models import decoder_prompts, decoder_text
from tree_grpo_jax.models.base import ModelLoadError, cast_floats
from tree_grpo_jax.models.text_encoders import read_config
from tree_grpo_jax.weights import convert, files

POINT = "point --config.model.path at a local diffusers-layout Z-Image folder"
ENCODER_FOLDER, TOKENIZER_FOLDER = "text_encoder", "tokenizer"


@dataclasses.dataclass(eq=False, kw_only=True)
class ZImageTextEncoder(decoder_prompts.CachedPromptStates):
    """`decoder_prompts.CachedPromptStates` of Z-Image's prompts: `run` gives the
    second-to-last states [B, L, D]; `encode` returns what `ZImagePipeline.encode_prompt`
    returns."""

    def batch_states(self, prompts: list[str]) -> list[np.ndarray]:
        ids, mask = decoder_text.z_image_prompt_inputs(self.tokenizer, prompts, self.max_length)
        hidden = self.run(self.params, jnp.asarray(ids), jnp.asarray(mask))
        return decoder_text.z_image_prompt_embeds(np.float32(hidden), mask)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ModelLoadError(
            f"could not read the tokenizer in {folder} ({first_line(e)}); {POINT}."
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"the tokenizer in {folder} has no chat template; {POINT}.")
    return tokenizer


def load_text_encoder(
    root: Path, dtype=jnp.float32, *, max_length: int, width: int, batch_size: int = 8
) -> ZImageTextEncoder:
    """The text side of a diffusers-layout Z-Image folder at `root`: `dtype` is the encoder's
    param and compute dtype (embeddings are cached in float32); its hidden size must be the
    transformer's `cap_feat_dim` (`width`)."""
    folder = files.component_dir(root, ENCODER_FOLDER, ("config.json",), POINT)
    tokenizer = load_tokenizer(files.component_dir(root, TOKENIZER_FOLDER, (), POINT))
    raw = read_config(folder, "qwen3", "a Qwen3 text encoder", POINT)
    try:
        config = decoder_text.config_from_transformers(raw)
    except ValueError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {first_line(e)}; {POINT}.") from None
    if config.hidden_size != width:
        raise ModelLoadError(
            f"{folder / 'config.json'} has hidden_size {config.hidden_size}, but the "
            f"transformer's cap_feat_dim is {width}; {POINT}."
        )
    if max_length < 1:
        raise ModelLoadError(f"the text max_length must be at least 1, got {max_length}.")
    module = decoder_text.DecoderTextModel(config, dtype=dtype, param_dtype=dtype)
    state = files.read_weights(folder, "model", POINT)
    with convert.weights_of(folder, POINT):
        params = decoder_text.params_from_state_dict(state, module)

    @jax.jit
    def run(params, ids, mask):
        return module.apply({"params": params}, ids, mask, layer=decoder_text.Z_IMAGE_LAYER)

    return ZImageTextEncoder(
        tokenizer=tokenizer,
        run=run,
        params=cast_floats(params, dtype),
        max_length=max_length,
        width=width,
        batch_size=batch_size,
    )
