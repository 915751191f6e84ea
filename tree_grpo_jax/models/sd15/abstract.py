"""Stable Diffusion 1.x as shapes, for planning: from a folder's JSON configs alone, or from
SD1.5's own (`builtin:sd15`), through the loader's config checks and module builders."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from tree_grpo_jax.models.abstract import AbstractModel, clip_prompt_shape, read_configs
from tree_grpo_jax.models.base import cast_floats, remat_mode
from tree_grpo_jax.models.sd15 import load
from tree_grpo_jax.models.sd15.builtin import RELEASES

UNET, VAE, TEXT, SCHEDULER = (
    "unet/config.json",
    "vae/config.json",
    "text_encoder/config.json",
    "scheduler/scheduler_config.json",
)
TOKENIZER = "tokenizer/tokenizer_config.json"
HINT = (
    "point --config.model.path at a diffusers-layout Stable Diffusion folder (its JSON files "
    f"are enough), or use {' or '.join('builtin:' + n for n in RELEASES)}"
)


def _abstract(init, dtype):
    """The params `init()` would make, as ShapeDtypeStructs in `dtype`."""
    return jax.eval_shape(lambda: cast_floats(init(), dtype))


def abstract_sd(
    path: str,
    dtype=jnp.float32,
    *,
    decode_batch_size: int = 8,
    remat: str = "none",
    scan_layers: bool = True,
    attention: str = "xla",
) -> AbstractModel:
    """What `load.load_sd(path, dtype, ...)` would load, as shapes; reads JSON files only."""
    load.check_runtime_options(attention)
    configs = read_configs(path, (UNET, VAE, TEXT, SCHEDULER), (TOKENIZER,), RELEASES, HINT)
    found = configs.files
    key = jax.random.PRNGKey(0)
    schedule = load.schedule_config(found[SCHEDULER], configs.path(SCHEDULER))
    unet = load.unet_from_config(found[UNET], configs.path(UNET), dtype, remat=remat)
    vae = load.vae_module(found[VAE], configs.path(VAE), dtype)
    return AbstractModel(
        name=Path(configs.where).name,
        source=configs.source,
        sample_shape=load.sample_shape(found[UNET]),
        params=_abstract(lambda: unet.init_weights(key), dtype),
        denoise=load.make_denoise(unet),
        cond_shape=clip_prompt_shape(found[TEXT], found.get(TOKENIZER)),
        schedule_config=schedule,
        decode=load.decode_fn(vae, found[VAE], decode_batch_size, dtype),
        decode_params=_abstract(lambda: load.decoder_params(vae.init_weights(key)), dtype),
        remat=remat_mode(remat),
    )
