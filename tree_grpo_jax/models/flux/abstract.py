"""FLUX.1 as shapes, for planning: from a folder's JSON configs alone, or from the releases'
own (`builtin:flux-dev`, `builtin:flux-schnell`), through the loader's config checks and
module builders.

The conditioning is what `text_encoders.pack_conditioning` makes of the text encoders' outputs:
`t5_max_length` T5 tokens, then CLIP-L's pooled vector as one more token, every token as
wide as the transformer's `joint_attention_dim`; an editing model's (`reference_images` > 0)
has a row per reference token after them (`edit`).
"""

from __future__ import annotations

import jax.numpy as jnp

from tree_grpo_jax.models import autoencoder, components
from tree_grpo_jax.models.abstract import AbstractModel, read_configs
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.flux import edit, load
from tree_grpo_jax.models.flux.builtin import RELEASES

TRANSFORMER, VAE, SCHEDULER = components.PIPELINE_CONFIGS
CLIP, T5 = "text_encoder/config.json", "text_encoder_2/config.json"
HINT = (
    "point --config.model.path at a diffusers-layout FLUX.1 folder (its JSON files are "
    f"enough), or use {' or '.join('builtin:' + n for n in RELEASES)}"
)


def check_text_widths(configs, transformer) -> None:
    """The loader's checks of the text encoders against the transformer, on their configs."""
    pooled, width = transformer.pooled_projection_dim, transformer.joint_attention_dim
    configs.check_width(CLIP, "hidden_size", pooled, "pooled_projection_dim", HINT)
    configs.check_width(T5, "d_model", width, "joint_attention_dim", HINT)


def abstract_flux(path: str, dtype=jnp.float32, **options) -> AbstractModel:
    """What `load.load_flux(path, dtype, **options)` would load, as shapes; reads JSON files
    only."""
    options = load.load_options(**options)
    configs = read_configs(path, components.PIPELINE_CONFIGS, (CLIP, T5), RELEASES, HINT)
    transformer = load.FOLDER.plan_transformer(configs, dtype, options)
    check_text_widths(configs, transformer)
    length = options.t5_max_length or load.default_t5_max_length(configs.files[TRANSFORMER])
    if not 1 <= length <= 512:
        raise ModelLoadError(f"t5_max_length must be in [1, 512], got {length}.")
    shape, schedule = load.FOLDER.plan_sampling(configs, options)
    vae_config = configs.files[VAE]
    vae = autoencoder.vae_module(vae_config, configs.path(VAE), dtype)
    width = max(transformer.joint_attention_dim, transformer.pooled_projection_dim)
    references = edit.reference_tokens(options, load.vae_scale_factor(vae_config))
    if references:
        width = edit.conditioning_width(transformer)
    return components.abstract_model(
        configs,
        transformer,
        dtype,
        options,
        sample_shape=shape,
        denoise=load.make_denoise(
            transformer,
            float(options.guidance) if transformer.guidance_embeds else None,
            text_rows=length + 1 if references else None,
        ),
        cond_shape=(length + 1 + references, width),
        schedule_config=schedule,
        decode=autoencoder.decode_fn(vae, vae_config, options.decode_batch_size, dtype),
        decode_params=autoencoder.part_shapes(vae, "decoder", dtype),
    )
