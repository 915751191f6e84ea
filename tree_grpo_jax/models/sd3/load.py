"""Stable Diffusion 3 / 3.5 from a diffusers-layout folder, as a `StableDiffusion3Model`.

The folder holds `transformer/`, `vae/`, `text_encoder/` (CLIP-L), `text_encoder_2/`
(CLIP-G), `text_encoder_3/` (T5-XXL, optional: `use_t5=False` runs without it, as the SD3
pipeline allows), their tokenizers and `scheduler/`. Weights are the PyTorch safetensors the
folder carries (sharded or not), converted in numpy (torch is never imported). Only the
transformer's weights are trainable `params`; the text encoders and the VAE decoder are
frozen and closed over by `encode_prompts` and `decode`.

SD3's conditioning is a token sequence [T, 4096] plus a pooled vector [2048]. The trainer
carries one array per prompt, so `encode_prompts` packs the pooled vector as one extra token
(zero-padded to 4096) after the sequence, and `denoise` unpacks it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import autoencoder, components, text_encoders
from tree_grpo_jax.models.base import (
    FlowSigmasScheduleConfig,
    ModelLoadError,
)
from tree_grpo_jax.models.sd3 import family, mmdit, text

# Up to this many distinct prompts are encoded ahead so that T5 can be released (about
# 2.4 MB of host memory each in bfloat16 with 256 T5 tokens: 2.5 GB at the limit).
MAX_PREPARED_PROMPTS = 1024
POINT = "point --config.model.path at a local diffusers-layout Stable Diffusion 3 folder"
_HUB_PATTERNS = components.PIPELINE_PATTERNS
_SCHEDULER_FIXED = {"use_dynamic_shifting": False, **components.FLOW_SCHEDULER_FIXED}


@dataclasses.dataclass(frozen=True)
class FlowMatchScheduleConfig(FlowSigmasScheduleConfig):
    """diffusers' FlowMatchEulerDiscreteScheduler as the SD3 pipeline sets it up: `N` sigmas
    evenly spaced from 1 down to the scheduler's shifted minimum, shifted again, then 0.
    The shift is the folder's (3.0 for SD3.5); the sampling options give the SDE's noise."""

    shift: float = 3.0
    num_train_timesteps: int = 1000

    def sigmas(self, num_steps: int) -> np.ndarray:
        def shifted(s):
            return self.shift * s / (1.0 + (self.shift - 1.0) * s)

        # The scheduler's own table ends at the shifted 1/T; inference spaces N sigmas from 1
        # down to that value and shifts them once more (diffusers does exactly this).
        sigma_min = shifted(1.0 / self.num_train_timesteps)
        return np.append(shifted(np.linspace(1.0, sigma_min, num_steps)), 0.0)


# What `load_sd3` and `abstract.abstract_sd3` take as keywords: `model.sd3`'s fields
# (its record's defaults) and the shared run-time ones.
load_options = functools.partial(components.LoadOptions.of, dict(family.options().items()))


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class StableDiffusion3Model(components.TransformerModel):
    """A loaded SD3-family folder; its `text_encoders` are a `text.SD3TextEncoders`."""


TRANSFORMER = components.Component(
    folder="transformer",
    pt_class="SD3Transformer2DModel",
    build=mmdit.transformer_module,
    point=POINT,
    article="an",
    buffers=mmdit.BUFFERS,
)
abstract_params = components.abstract_params
load_transformer = TRANSFORMER.load


def schedule_config(config: dict, where: Path) -> FlowMatchScheduleConfig:
    components.check_flow_scheduler(config, where, "SD3", _SCHEDULER_FIXED)
    return FlowMatchScheduleConfig(
        shift=float(config.get("shift", 1.0)),
        num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
    )


def make_denoise(module, context_dim: int, pooled_dim: int):
    def denoise(params, x, t, cond):
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (x.shape[0],))
        sequence, pooled = text_encoders.unpack_conditioning(cond, context_dim, pooled_dim)
        return module.apply({"params": params}, x, sequence, pooled, t)

    return denoise


def sample_shape(transformer_config: dict, sample_size: int | None = None) -> tuple[int, ...]:
    """One latent, channels first: `sample_size` on a side (default: the config's), which
    must fit the transformer's position-embedding grid."""
    size = sample_size or transformer_config.get("sample_size", 128)
    patch = transformer_config.get("patch_size", 2)
    grid = transformer_config.get("pos_embed_max_size") or size // patch
    if size % patch or size // patch > grid:
        raise ModelLoadError(
            f"model.sample_size {size} must be a multiple of the patch size {patch} and at most "
            f"{grid * patch} (the transformer's position grid)."
        )
    return (transformer_config.get("in_channels", 16), size, size)


def load_sd3(path: str, dtype=jnp.float32, **options) -> StableDiffusion3Model:
    """Loads an SD3-family pipeline folder (or hub id) as a TextToImageModel.

    `dtype` is the dtype of all params and of the computation; `options` are `LoadOptions`
    (`sample_size` must fit the transformer's position-embedding grid; `remat` is
    what `model.remat` asks for).
    """
    options = load_options(**options)
    root, folders = TRANSFORMER.pipeline(path)
    schedule = schedule_config(*TRANSFORMER.scheduler(folders))
    loaded = TRANSFORMER.load_from(folders, dtype, options)
    transformer, _, transformer_config = loaded
    decode, vae_config = autoencoder.load_decode(
        folders["vae"], dtype, POINT, options.decode_batch_size
    )
    encoders = text.load_text_encoders(
        root,
        dtype,
        use_t5=options.use_t5,
        t5_max_length=options.t5_max_length,
        joint_attention_dim=transformer_config.get("joint_attention_dim", 4096),
    )
    pooled_dim = transformer_config.get("pooled_projection_dim", 2048)

    def prepare_prompts(prompts: Sequence[str]) -> str:
        if encoders.t5 is None:
            return "T5 is not loaded; prompts are encoded as they come"
        return encoders.encode_ahead(prompts, MAX_PREPARED_PROMPTS)

    return StableDiffusion3Model(
        **components.model_fields(root, loaded, vae_config, encoders, options),
        sample_shape=sample_shape(transformer_config, options.sample_size),
        denoise=make_denoise(
            transformer, transformer_config.get("joint_attention_dim", 4096), pooled_dim
        ),
        decode=decode,
        schedule_config=schedule,
        prepare_prompts=prepare_prompts,
    )
