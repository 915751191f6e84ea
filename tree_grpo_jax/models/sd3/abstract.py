"""Stable Diffusion 3 / 3.5 as shapes, for planning: from a folder's JSON configs alone, or
from SD3.5 Medium's own (`builtin:sd35m`), through the loader's config checks and module
builders.

The conditioning is what `text_encoders.pack_conditioning` makes of the text encoders'
outputs: CLIP's padded prompt tokens, then `t5_max_length` T5 tokens (zeros without T5),
then the pooled vector as one more token, every token as wide as the transformer's
`joint_attention_dim`.
"""

from __future__ import annotations

import jax.numpy as jnp

from tree_grpo_jax.models import autoencoder, components
from tree_grpo_jax.models.abstract import AbstractModel, clip_prompt_shape, read_configs
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.sd3 import load, text
from tree_grpo_jax.models.sd3.builtin import RELEASES

TRANSFORMER, VAE, SCHEDULER, CLIP_L = (
    "transformer/config.json",
    "vae/config.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
)
TOKENIZER = "tokenizer/tokenizer_config.json"
CLIP_G, T5 = "text_encoder_2/config.json", "text_encoder_3/config.json"
HINT = (
    "point --config.model.path at a diffusers-layout Stable Diffusion 3 folder (its JSON files "
    f"are enough), or use {' or '.join('builtin:' + n for n in RELEASES)}"
)


def conditioning_shape(transformer_config: dict, clip_tokens: int, t5_max_length: int):
    """[L, D] of one prompt's packed conditioning."""
    try:
        text.check_t5_max_length(t5_max_length)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    width = transformer_config.get("joint_attention_dim", 4096)
    pooled = transformer_config.get("pooled_projection_dim", 2048)
    return clip_tokens + t5_max_length + 1, max(width, pooled)


def check_text_widths(configs, width: int, use_t5: bool) -> None:
    """The loader's checks of the text encoders against the transformer, on their configs:
    both CLIP towers' features fit in a token, and T5's width (when it is used) is the
    token's."""
    found = configs.files
    if CLIP_G in found:
        clip_width = sum(clip_prompt_shape(found[f], None)[1] for f in (CLIP_L, CLIP_G))
        if clip_width > width:
            raise ModelLoadError(
                f"the CLIP encoders in {configs.where} have {clip_width} features together, "
                f"more than the transformer's joint_attention_dim {width}; {HINT}."
            )
    if use_t5:
        configs.check_width(T5, "d_model", width, "joint_attention_dim", HINT)


def abstract_sd3(path: str, dtype=jnp.float32, **options) -> AbstractModel:
    """What `load.load_sd3(path, dtype, **options)` would load, as shapes; reads JSON files
    only."""
    options = load.load_options(**options)
    needed = (TRANSFORMER, VAE, SCHEDULER, CLIP_L)
    configs = read_configs(path, needed, (TOKENIZER, CLIP_G, T5), RELEASES, HINT)
    found = configs.files
    config = found[TRANSFORMER]
    check_text_widths(configs, config.get("joint_attention_dim", 4096), options.use_t5)
    schedule = load.schedule_config(found[SCHEDULER], configs.path(SCHEDULER))
    transformer = load.TRANSFORMER.from_configs(configs, dtype, options)
    vae = autoencoder.vae_module(found[VAE], configs.path(VAE), dtype)
    clip_tokens, _ = clip_prompt_shape(found[CLIP_L], found.get(TOKENIZER))
    return components.abstract_model(
        configs,
        transformer,
        dtype,
        options,
        sample_shape=load.sample_shape(config, options.sample_size),
        denoise=load.make_denoise(
            transformer,
            config.get("joint_attention_dim", 4096),
            config.get("pooled_projection_dim", 2048),
        ),
        cond_shape=conditioning_shape(config, clip_tokens, options.t5_max_length),
        schedule_config=schedule,
        decode=autoencoder.decode_fn(vae, found[VAE], options.decode_batch_size, dtype),
        decode_params=autoencoder.part_shapes(vae, "decoder", dtype),
    )
