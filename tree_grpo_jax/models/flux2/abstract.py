"""FLUX.2 as shapes, for planning: from a folder's JSON configs alone, through the loader's
config checks and module builders; or from the releases' own (`builtin:flux2-dev`,
`builtin:flux2-klein-4b`, `builtin:flux2-klein-9b`).

The conditioning is what the text encoder's cache gives the denoiser: `text_max_length`
tokens of three stacked hidden states, as wide as the transformer's `joint_attention_dim`;
an editing model's (`reference_images` > 0) has a row per reference token after them.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from tree_grpo_jax.models import components
from tree_grpo_jax.models.abstract import AbstractModel, read_configs
from tree_grpo_jax.models.flux2 import load
from tree_grpo_jax.models.flux2.builtin import RELEASES

TEXT = "text_encoder/config.json"
HINT = (
    "point --config.model.path at a diffusers-layout FLUX.2 folder (its JSON files are "
    f"enough), or use {' or '.join('builtin:' + n for n in RELEASES)}"
)


def text_variant(text_config: dict | None) -> str | None:
    """DEV or KLEIN by the text encoder's model_type; None when there is no config to say."""
    found = (text_config or {}).get("model_type")
    for variant, path in load.TEXT_PATHS.items():
        if found == path["model_type"]:
            return variant
    return None


def abstract_flux2(path: str, dtype=jnp.float32, **options) -> AbstractModel:
    """What `load.load_flux2(path, dtype, **options)` would load, as shapes; reads JSON
    files only."""
    options = load.load_options(**options)
    configs = read_configs(path, components.PIPELINE_CONFIGS, (TEXT,), RELEASES, HINT)
    transformer = load.FOLDER.plan_transformer(configs, dtype, options)
    width = transformer.joint_attention_dim
    text_config = configs.files.get(TEXT)
    variant = text_variant(text_config)
    if variant is not None:
        load.check_text_config(text_config, Path(configs.path(TEXT)), variant, width)
    shape, schedule = load.FOLDER.plan_sampling(configs, options)
    vae_config = configs.files[components.VAE_CONFIG]
    vae = load.vae_module(vae_config, configs.path(components.VAE_CONFIG), dtype)
    references = 0  # editing: rows of reference tokens after the text (load.EditConditioning)
    if options.reference_images:
        side = load.reference_side(options, vae_config)
        per_image = (side // (load.vae_scale_factor(vae_config) * load.PATCH)) ** 2
        references = options.reference_images * per_image
    return components.abstract_model(
        configs,
        transformer,
        dtype,
        options,
        sample_shape=shape,
        denoise=load.make_denoise(
            transformer,
            load.guidance_of(transformer, options),
            float(schedule.num_train_timesteps),
            text_tokens=options.text_max_length if references else None,
        ),
        cond_shape=(options.text_max_length + references, width),
        schedule_config=schedule,
        decode=load.image_decoder(vae, options.decode_batch_size),
        decode_params=load.decoder_shapes(vae, dtype),
    )
