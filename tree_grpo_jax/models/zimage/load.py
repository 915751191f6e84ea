"""Z-Image from a diffusers-layout folder, as a `ZImageModel`.

The folder holds `transformer/` (`ZImageTransformer2DModel`), `vae/` (FLUX's 16-channel
`AutoencoderKL`), `text_encoder/` (a `Qwen3Model`), `tokenizer/` and `scheduler/`
(`FlowMatchEulerDiscreteScheduler`: the release's static shift 3, or dynamic shifting with
the pipeline's `calculate_shift` mu). Weights are the PyTorch safetensors the folder carries,
converted in numpy (torch is never imported). Only the transformer's weights are trainable
`params`; the text encoder and the VAE decoder are frozen and closed over by
`encode_prompts` and `decode`.

The trainer's denoiser sees latents [B, 16, h, w], `t` = sigma * 1000 and one conditioning
array per prompt ([max_length, hidden + 1]: the padded caption states and their mask, see
`text`). It feeds the transformer ZImagePipeline's time input (1 - sigma) and returns the
flow velocity (noise minus data), the negated output, which the pipeline's scheduler steps
with. Classifier-free guidance is not applied: the denoiser is the conditional prediction,
as the distilled Z-Image-Turbo samples (guidance_scale 0).

Measured against diffusers' PyTorch ZImagePipeline on a tiny random folder
(tests/parity/test_zimage_model.py, float32 on CPU): the deterministic sampler (4 steps, the
release's static shift 3, guidance_scale 0) differs by at most 3.3e-6 from
`ZImagePipeline(latents=..., output_type="latent")` on latents up to 4.7; the prompt
embeddings by 1.5e-7 from `encode_prompt`; the schedule's sigmas by less than 1e-6, static
and dynamic.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax.numpy as jnp

from tree_grpo_jax.models import autoencoder, components, decoder_prompts
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.zimage import family, text, transformer

POINT = text.POINT
HUB_PATTERNS = components.PIPELINE_PATTERNS
DEFAULT_RESOLUTION = 1024  # the pipeline's default height and width


@dataclasses.dataclass(frozen=True)
class ZImageScheduleConfig(components.ShiftedFlowScheduleConfig):
    """FlowMatchEulerDiscreteScheduler as ZImagePipeline sets it up (`components`'s shifted
    flow schedule; the release's folder turns dynamic shifting off for a static shift 3)."""


# What `load_zimage` takes as keywords: `model.zimage`'s fields and the shared run-time ones.
load_options = functools.partial(components.LoadOptions.of, dict(family.options().items()))


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ZImageModel(components.TransformerModel):
    """A loaded Z-Image folder; its `text_encoders` are a `text.ZImageTextEncoder`."""


def schedule_config(
    config: dict, where: Path, image_seq_len: int, static_shift: float = 0.0
) -> ZImageScheduleConfig:
    """The schedule of a `scheduler/scheduler_config.json`, checked."""
    return components.shifted_flow_schedule(
        ZImageScheduleConfig, config, where, "Z-Image", image_seq_len, static_shift
    )


TRANSFORMER = components.Component(
    folder="transformer",
    pt_class="ZImageTransformer2DModel",
    build=transformer.transformer_module,
    point=POINT,
    list_names=transformer.MODULE_LISTS,
)


def make_denoise(module, timestep_scale: float = 1000.0):
    """`(params, x [B, C, h, w], t [B] (sigma * timestep_scale), cond [B, L, D + 1]) ->
    velocity [B, C, h, w]`, as ZImagePipeline calls its transformer (without guidance)."""

    def denoise(params, x, t, cond):
        batch = x.shape[0]
        sigma = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (batch,)) / timestep_scale
        features, mask = decoder_prompts.split_conditioning(cond)
        out = module.apply(
            {"params": params},
            x.astype(module.dtype),
            transformer.timestep_from_sigma(sigma),
            features.astype(module.dtype),
            mask,
        )
        return transformer.velocity(out).astype(x.dtype)

    return denoise


def vae_scale_factor(vae_config: dict) -> int:
    """Pixels per latent: 2 ** (levels - 1), as ZImagePipeline computes it (8 released)."""
    return 2 ** (len(vae_config.get("block_out_channels", (0, 0, 0, 0))) - 1)


def sample_shape(transformer_config: dict, vae_config: dict, resolution: int | None = None):
    """One latent, channels first, for square images of `resolution` pixels (default 1024),
    which must be a multiple of two latents as the pipeline requires."""
    scale = vae_scale_factor(vae_config)
    pixels = int(resolution or DEFAULT_RESOLUTION)
    patch = transformer_config.get("all_patch_size", [2])[0]
    if pixels < scale * 2 or pixels % (scale * 2):
        raise ModelLoadError(
            f"model.zimage.resolution {pixels} must be a positive multiple of {scale * 2} "
            "pixels (two latents), as ZImagePipeline requires."
        )
    side = pixels // scale
    if side % patch:
        raise ModelLoadError(
            f"model.zimage.resolution {pixels} gives {side} latents a side, not a multiple of "
            f"the transformer's patch {patch}."
        )
    return (transformer_config.get("in_channels", 16), side, side)


def image_tokens(shape: tuple[int, ...]) -> int:
    """The pipeline's image_seq_len for its shift: (h // 2) * (w // 2)."""
    return (shape[1] // 2) * (shape[2] // 2)


def check_latent_channels(transformer_config: dict, vae_config: dict, where: Path) -> None:
    model, latent = transformer_config.get("in_channels", 16), vae_config.get("latent_channels")
    if latent is not None and model != latent:
        raise ModelLoadError(
            f"{where}'s transformer takes {model} channels, not its VAE's {latent} latent "
            f"channels; {POINT}."
        )


FOLDER = components.ImageFolder(
    TRANSFORMER, check_latent_channels, sample_shape, image_tokens, schedule_config
)


def load_zimage(path: str, dtype=jnp.float32, **options) -> ZImageModel:
    """Loads a Z-Image pipeline folder (or hub id) as a TextToImageModel.

    `dtype` is the dtype of all params and of the computation; `options` are `LoadOptions`
    (`text_max_length`: the pipeline's max_sequence_length, `resolution`, `shift`; `remat`
    is what `model.remat` asks for).
    """
    options = load_options(**options)
    opened = FOLDER.open(path, dtype, options)
    module = opened.module
    decode, _ = autoencoder.load_decode(
        opened.folders["vae"], dtype, POINT, options.decode_batch_size
    )
    encoder = text.load_text_encoder(
        opened.root, dtype, max_length=options.text_max_length, width=module.cap_feat_dim
    )
    return ZImageModel(
        **opened.model_fields(encoder, options),
        denoise=make_denoise(module, float(opened.schedule.num_train_timesteps)),
        decode=decode,
    )
