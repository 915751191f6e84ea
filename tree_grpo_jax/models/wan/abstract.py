"""Wan2.1 and Wan2.2 as shapes, for planning: from a folder's JSON configs alone, or from the
releases' own (`builtin:wan-1.3b`, `builtin:wan-14b`, `builtin:wan2.2-ti2v-5b`,
`builtin:wan2.2-t2v-a14b`), through the loader's config checks and module builders. A
two-expert folder's params are both experts', as the loader's.

The conditioning is umT5's states: `t5_max_length` tokens as wide as the transformer's
`text_dim`, followed, for a TI2V folder taking images, by the first frame's rows
(`load.pack_first_frames`). A sample is one video's latents [F, h, w, C], channels last;
the decoder planned is the Wan VAE's, giving [B, T, H, W, 3].
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp

from tree_grpo_jax.models import components, media
from tree_grpo_jax.models.abstract import AbstractModel, read_configs
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.wan import load
from tree_grpo_jax.models.wan.builtin import RELEASES

TRANSFORMER, VAE, SCHEDULER = components.PIPELINE_CONFIGS
TEXT = "text_encoder/config.json"
INDEX = "model_index.json"
LOW_NOISE = "transformer_2/config.json"
HINT = (
    "point --config.model.path at a diffusers-layout Wan text-to-video folder (its JSON "
    f"files are enough), or use {' or '.join('builtin:' + n for n in RELEASES)}"
)


def check_text_width(configs, transformer) -> None:
    """The loader's check of umT5's width against the transformer's, on their configs."""
    configs.check_width(TEXT, "d_model", transformer.text_dim, "text_dim", HINT)


def abstract_wan(path: str, dtype=jnp.float32, **options) -> AbstractModel:
    """What `load.load_wan(path, dtype, **options)` would load, as shapes; reads JSON files
    only."""
    options = load.load_options(**options)
    configs = read_configs(
        path, components.PIPELINE_CONFIGS, (TEXT, INDEX, LOW_NOISE), RELEASES, HINT
    )
    found = configs.files
    config, vae_config = found[TRANSFORMER], found[VAE]
    load.check_channels(config, vae_config, Path(configs.where))
    transformer = load.TRANSFORMER.from_configs(configs, dtype, options)
    check_text_width(configs, transformer)
    if not 1 <= options.t5_max_length <= 512:
        raise ModelLoadError(f"t5_max_length must be in [1, 512], got {options.t5_max_length}.")
    shape = load.sample_shape(config, vae_config, options.resolution, options.num_frames)
    schedule = load.schedule_config(found[SCHEDULER], configs.path(SCHEDULER), options.shift)
    decode, decode_params = load.abstract_decoder(
        vae_config, configs.path(VAE), dtype, options.decode_batch_size
    )
    boundary = load.boundary_of(found.get(INDEX), configs.path(INDEX))
    denoise = load.make_denoise(transformer)
    cond_rows = options.t5_max_length
    if load.is_ti2v(found.get(INDEX)) and options.image_to_video:
        denoise = load.make_first_frame_denoise(
            transformer, options.t5_max_length, float(schedule.num_train_timesteps)
        )
        cond_rows += load.first_frame_rows(shape[1:], transformer.text_dim)
    if boundary is not None:
        if LOW_NOISE not in found:
            raise ModelLoadError(
                f"model folder {configs.where} sets boundary_ratio but has no {LOW_NOISE}; {HINT}."
            )
        load.check_experts(config, found[LOW_NOISE], Path(configs.where))
        denoise = load.make_expert_denoise(transformer, boundary * schedule.num_train_timesteps)
    planned = components.abstract_model(
        configs,
        transformer,
        dtype,
        options,
        sample_shape=shape,
        denoise=denoise,
        cond_shape=(cond_rows, transformer.text_dim),
        schedule_config=schedule,
        decode=decode,
        decode_params=decode_params,
        media=media.VIDEO,
    )
    if boundary is None:
        return planned
    # Two experts of one shape: the params hold both, as the loaded model's do.
    both = {name: planned.params for name in load.EXPERTS}
    return dataclasses.replace(planned, params=both)
