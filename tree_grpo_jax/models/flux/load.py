"""FLUX.1 (dev, schnell or Kontext) from a diffusers-layout folder, as a `FluxModel`.

The folder holds `transformer/` (`FluxTransformer2DModel`, its safetensors sharded or not),
`vae/` (the 16-channel `AutoencoderKL`), `text_encoder/` (CLIP-L), `text_encoder_2/`
(T5-XXL), `tokenizer/`, `tokenizer_2/` and `scheduler/`. Weights are the PyTorch safetensors
the folder carries, bfloat16 as the releases ship them or float32, converted in numpy (torch
is never imported). Only the transformer's weights are trainable `params`; the text encoders
and the VAE decoder are frozen and closed over by `encode_prompts` and `decode`.

The trainer's denoiser sees unpacked latents [B, 16, h, w] and one conditioning array per
prompt: `encode_prompts` packs CLIP-L's pooled vector [768] as one extra token (zero-padded
to 4096) after T5's tokens, and `denoise` unpacks it, packs the latents into 2x2-patch
tokens, builds the position ids, passes the distilled guidance scale (FLUX.1-dev; schnell
has no guidance embedding) and unpacks the velocity.

Editing (FLUX.1-Kontext, `reference_images` = 1): each prompt's input image is
FluxKontextPipeline's `image=` reference, encoded by the VAE (`edit`) and carried as rows
after the pooled row of the prompt's conditioning (`references.EditConditioning`); `denoise`
gives them to the transformer after the noisy tokens and keeps the noisy tokens' output.
Against `FluxKontextPipeline(image=..., _auto_resize=False, output_type="latent")` on the
tiny folder (tests/parity/test_flux_kontext.py) the sampler differs by 1.9e-6 on latents
up to 4.4.

Measured against diffusers' PyTorch FluxPipeline on a tiny random FLUX.1-dev style folder
(tests/parity/test_flux_model.py, float32 on CPU, its transformer stored in bfloat16 and sharded):
the deterministic sampler (4 steps, dynamic shifting) differs by at most 1.1e-6 from
`FluxPipeline(latents=..., output_type="latent")` on latents up to 5.3; the VAE decode by
9.5e-7; the schedule's sigmas by less than 1e-6, dynamic and static.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax.numpy as jnp

from tree_grpo_jax.models import autoencoder, components, patches, references, text_encoders
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.flux import edit, family, text, transformer

POINT = text.POINT
HUB_PATTERNS = components.PIPELINE_PATTERNS
DEFAULT_LATENT_SIZE = 128  # the pipeline's default_sample_size: 1024 px with an 8x VAE


@dataclasses.dataclass(frozen=True)
class FluxScheduleConfig(components.ShiftedFlowScheduleConfig):
    """FlowMatchEulerDiscreteScheduler as FluxPipeline sets it up (`components`'s shifted
    flow schedule, FLUX.1-dev's dynamic shifting by default)."""


# What `load_flux` and `abstract.abstract_flux` take as keywords: `model.flux`'s fields
# (its record's defaults) and the shared run-time ones.
load_options = functools.partial(components.LoadOptions.of, dict(family.options().items()))


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class FluxModel(components.TransformerModel):
    """A loaded FLUX.1 folder; its `text_encoders` are a `text.FluxTextEncoders`."""

    guidance: float | None  # the distilled guidance scale `denoise` passes (None: schnell)
    # Editing (model.flux.reference_images > 0): each prompt's input image conditions it.
    takes_input_images: bool = False
    input_image_size: tuple[int, int] | None = None
    # Editing: the guidance's empty prompt is the text rows only (T5's and the pooled one), so
    # the unconditional pass keeps each prompt's reference rows, as the pipeline's true CFG
    # feeds both passes the image latents.
    unconditional_rows: int | None = None


def schedule_config(
    config: dict, where: Path, image_seq_len: int, static_shift: float = 0.0
) -> FluxScheduleConfig:
    """The schedule of a `scheduler/scheduler_config.json`, checked."""
    return components.shifted_flow_schedule(
        FluxScheduleConfig, config, where, "FLUX.1", image_seq_len, static_shift
    )


TRANSFORMER = components.Component(
    folder="transformer",
    pt_class="FluxTransformer2DModel",
    build=transformer.transformer_module,
    point=POINT,
    list_names=transformer.MODULE_LISTS,
)
abstract_params = components.abstract_params
load_transformer = TRANSFORMER.load


def make_denoise(
    module, guidance: float | None, timestep_scale: float = 1000.0, text_rows: int | None = None
):
    """`(params, x [B, C, h, w], t [B] (sigma * timestep_scale), cond [B, T + 1, D]) ->
    velocity [B, C, h, w]`, as FluxPipeline calls its transformer. With `text_rows` (T + 1),
    a longer `cond` carries reference tokens after its text (`edit`): they follow the noisy
    tokens as FluxKontextPipeline's image latents do, and their outputs are dropped."""
    context_dim, pooled_dim = module.joint_attention_dim, module.pooled_projection_dim

    def denoise(params, x, t, cond):
        batch, _, height, width = x.shape
        sigma = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (batch,)) / timestep_scale
        tokens = patches.pack_latents(x.astype(module.dtype))
        ids = jnp.asarray(transformer.image_ids(height, width))
        if text_rows is not None and cond.shape[1] > text_rows:
            cond, (extra, extra_ids) = references.split_references(
                cond, text_rows, module.in_channels, transformer.ID_AXES
            )
            tokens = jnp.concatenate([tokens, extra.astype(module.dtype)], axis=1)
            # Every prompt's references share one grid, so one set of ids serves the batch;
            # the largest is taken so that a prompt without images (zero rows) changes none.
            ids = jnp.concatenate([ids, jnp.max(extra_ids, axis=0)], axis=0)
        sequence, pooled = text_encoders.unpack_conditioning(cond, context_dim, pooled_dim)
        out = module.apply(
            {"params": params},
            tokens,
            sequence.astype(module.dtype),
            pooled.astype(module.dtype),
            sigma,
            ids,
            jnp.asarray(transformer.text_ids(sequence.shape[1])),
            None if guidance is None else jnp.full((batch,), guidance, jnp.float32),
        )
        latent_tokens = (height // patches.LATENT_PATCH) * (width // patches.LATENT_PATCH)
        return patches.unpack_latents(out[:, :latent_tokens], height, width).astype(x.dtype)

    return denoise


def vae_scale_factor(vae_config: dict) -> int:
    """Pixels per latent: 2 ** (levels - 1), as FluxPipeline computes it (8 for FLUX.1)."""
    return 2 ** (len(vae_config.get("block_out_channels", (0, 0, 0, 0))) - 1)


def sample_shape(transformer_config: dict, vae_config: dict, resolution: int | None = None):
    """One latent, channels first, for square images of `resolution` pixels (default: the
    pipeline's 128 latents a side), rounded down as FluxPipeline rounds: to an even number
    of latents."""
    scale = vae_scale_factor(vae_config)
    pixels = resolution or DEFAULT_LATENT_SIZE * scale
    side = 2 * (int(pixels) // (scale * 2))
    if side < 2:
        raise ModelLoadError(
            f"model.flux.resolution {pixels} is below the {2 * scale} pixels of one latent token."
        )
    channels = transformer_config.get("in_channels", 64) // patches.LATENT_PATCH**2
    return (channels, side, side)


def image_tokens(shape: tuple[int, ...]) -> int:
    return (shape[1] // patches.LATENT_PATCH) * (shape[2] // patches.LATENT_PATCH)


def check_latent_channels(transformer_config: dict, vae_config: dict, where: Path) -> None:
    packed = transformer_config.get("in_channels", 64)
    latent = vae_config.get("latent_channels", 16)
    if packed != latent * patches.LATENT_PATCH**2:
        raise ModelLoadError(
            f"{where}'s transformer takes {packed} channels, not its VAE's {latent} latent "
            f"channels packed in 2x2 patches ({latent * 4}); {POINT}."
        )


def default_t5_max_length(transformer_config: dict) -> int:
    """512 tokens for a guidance-distilled model (FLUX.1-dev), 256 without (schnell)."""
    return 512 if transformer_config.get("guidance_embeds", False) else 256


FOLDER = components.ImageFolder(
    TRANSFORMER, check_latent_channels, sample_shape, image_tokens, schedule_config
)


def load_flux(path: str, dtype=jnp.float32, **options) -> FluxModel:
    """Loads a FLUX.1 pipeline folder (or hub id) as a TextToImageModel.

    `dtype` is the dtype of all params and of the computation; `options` are `LoadOptions`
    (`guidance` is ignored by schnell, which has no guidance embedding; `remat` is
    what `model.remat` asks for).
    """
    options = load_options(**options)
    opened = FOLDER.open(path, dtype, options)
    module, _, transformer_config = opened.loaded
    decode, _ = autoencoder.load_decode(
        opened.folders["vae"], dtype, POINT, options.decode_batch_size
    )
    encoders = text.load_text_encoders(
        opened.root,
        dtype,
        t5_max_length=options.t5_max_length or default_t5_max_length(transformer_config),
        joint_attention_dim=module.joint_attention_dim,
        pooled_projection_dim=module.pooled_projection_dim,
    )
    guidance = float(options.guidance) if module.guidance_embeds else None
    fields = opened.model_fields(encoders, options)
    editing, text_rows = {}, None
    if options.reference_images:
        scale = vae_scale_factor(opened.vae_config)
        side = edit.reference_side(options, scale)
        fields["encode_prompts"] = references.EditConditioning(
            encoders,
            edit.load_references(opened.folders["vae"], dtype, POINT, scale),
            count=options.reference_images,
            side=side,
            width=edit.conditioning_width(module),
            settings="model.flux",
        )
        text_rows = encoders.t5_max_length + 1
        editing = dict(
            takes_input_images=True, input_image_size=(side, side), unconditional_rows=text_rows
        )
    return FluxModel(
        **fields,
        denoise=make_denoise(
            module, guidance, float(opened.schedule.num_train_timesteps), text_rows
        ),
        decode=decode,
        guidance=guidance,
        **editing,
    )
