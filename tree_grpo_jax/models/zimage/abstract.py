"""Z-Image as shapes, for planning: from a folder's JSON configs alone, through the loader's
config checks and module builders; or from the release's own (`builtin:z-image-turbo`).

The conditioning is what `decoder_prompts.pack_embeddings` makes of the text encoder's states:
`text_max_length` tokens as wide as the transformer's `cap_feat_dim`, plus the mask feature.
"""

from __future__ import annotations

import jax.numpy as jnp

from tree_grpo_jax.models import autoencoder, components
from tree_grpo_jax.models.abstract import AbstractModel, read_configs
from tree_grpo_jax.models.zimage import load
from tree_grpo_jax.models.zimage.builtin import RELEASES

TEXT = "text_encoder/config.json"
HINT = (
    "point --config.model.path at a diffusers-layout Z-Image folder (its JSON files are enough), "
    f"or use {' or '.join('builtin:' + n for n in RELEASES)}"
)


def abstract_zimage(path: str, dtype=jnp.float32, **options) -> AbstractModel:
    """What `load.load_zimage(path, dtype, **options)` would load, as shapes; reads JSON
    files only."""
    options = load.load_options(**options)
    configs = read_configs(path, components.PIPELINE_CONFIGS, (TEXT,), RELEASES, HINT)
    transformer = load.FOLDER.plan_transformer(configs, dtype, options)
    width = transformer.cap_feat_dim
    configs.check_width(TEXT, "hidden_size", width, "cap_feat_dim", HINT)
    shape, schedule = load.FOLDER.plan_sampling(configs, options)
    vae_config = configs.files[components.VAE_CONFIG]
    vae = autoencoder.vae_module(vae_config, configs.path(components.VAE_CONFIG), dtype)
    return components.abstract_model(
        configs,
        transformer,
        dtype,
        options,
        sample_shape=shape,
        denoise=load.make_denoise(transformer, float(schedule.num_train_timesteps)),
        cond_shape=(options.text_max_length, width + 1),
        schedule_config=schedule,
        decode=autoencoder.decode_fn(vae, vae_config, options.decode_batch_size, dtype),
        decode_params=autoencoder.part_shapes(vae, "decoder", dtype),
    )
