"""Qwen-Image as shapes, for planning: from a folder's JSON configs alone, through the
loader's config checks and module builders; or from the release's own (`builtin:qwen-image`).

The conditioning is what `decoder_prompts.pack_embeddings` makes of the text encoder's states:
`text_max_length` tokens as wide as the transformer's `joint_attention_dim`, plus the mask
feature.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from tree_grpo_jax.models import causal_vae, components
from tree_grpo_jax.models.abstract import AbstractModel, read_configs
from tree_grpo_jax.models.base import ModelLoadError, cast_floats
from tree_grpo_jax.models.qwenimage import load
from tree_grpo_jax.models.qwenimage.builtin import RELEASES

TEXT = "text_encoder/config.json"
HINT = (
    "point --config.model.path at a diffusers-layout Qwen-Image folder (its JSON files are "
    f"enough), or use {' or '.join('builtin:' + n for n in RELEASES)}"
)


def check_text_width(text_config: dict | None, where: Path, width: int) -> None:
    """The loader's check that the text encoder's hidden size (Qwen2.5-VL's language model's,
    nested in `text_config` or at the top in older files) is the transformer's
    `joint_attention_dim`, when that config is here."""
    if not text_config:
        return
    hidden = (text_config.get("text_config") or {}).get("hidden_size")
    hidden = text_config.get("hidden_size", width) if hidden is None else hidden
    if hidden != width:
        raise ModelLoadError(
            f"{where} has hidden_size {hidden}, but the transformer's joint_attention_dim is "
            f"{width}; {HINT}."
        )


def abstract_qwenimage(path: str, dtype=jnp.float32, **options) -> AbstractModel:
    """What `load.load_qwenimage(path, dtype, **options)` would load, as shapes; reads JSON
    files only."""
    options = load.load_options(**options)
    configs = read_configs(path, components.PIPELINE_CONFIGS, (TEXT,), RELEASES, HINT)
    transformer = load.FOLDER.plan_transformer(configs, dtype, options)
    width = transformer.joint_attention_dim
    check_text_width(configs.files.get(TEXT), configs.path(TEXT), width)
    shape, schedule = load.FOLDER.plan_sampling(configs, options)
    vae_config = configs.files[components.VAE_CONFIG]
    try:
        vae = causal_vae.decoder_module(vae_config, dtype)
    except ValueError as e:
        raise ModelLoadError(
            f"{configs.path(components.VAE_CONFIG)}: {str(e).rstrip('.')}; {HINT}."
        ) from None
    decode_params = jax.eval_shape(lambda p: cast_floats(p, dtype), causal_vae.decoder_shapes(vae))
    return components.abstract_model(
        configs,
        transformer,
        dtype,
        options,
        sample_shape=shape,
        denoise=load.make_denoise(transformer, float(schedule.num_train_timesteps)),
        cond_shape=(options.text_max_length, width + 1),
        schedule_config=schedule,
        decode=load.image_decoder(vae, vae_config, dtype, options.decode_batch_size),
        decode_params=decode_params,
    )
