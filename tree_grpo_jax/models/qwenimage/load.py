"""Qwen-Image from a diffusers-layout folder, as a `QwenImageModel`.

The folder holds `transformer/` (`QwenImageTransformer2DModel`), `vae/`
(`AutoencoderKLQwenImage`, the causal video VAE used on one frame), `text_encoder/` (a
`Qwen2_5_VLForConditionalGeneration`), `tokenizer/` and `scheduler/`
(`FlowMatchEulerDiscreteScheduler`: dynamic shifting with the pipeline's `calculate_shift`
mu from the image's token count, then the sigmas stretched so that the last one is
`shift_terminal`, 0.02 in the release). Weights are the PyTorch safetensors the folder
carries, converted in numpy (torch is never imported). Only the transformer's weights are
trainable `params`; the text encoder and the VAE decoder are frozen and closed over by
`encode_prompts` and `decode`.

The trainer's denoiser sees latents [B, 16, h, w] (channels first; the pipeline's frame axis
left out), `t` = sigma * 1000 and one conditioning array per prompt ([max_length, hidden + 1]:
the padded prompt states and their mask, see `text`). It packs the latents into 2x2 patches,
feeds the transformer the pipeline's timestep / 1000 and returns its output, the flow
velocity (noise minus data) the pipeline's scheduler steps with. Classifier-free guidance is
not applied: the denoiser is the conditional prediction (the pipeline's `true_cfg_scale` 1;
its guided prediction is rescaled to the conditional one's norm, which is not the package's
guidance). `decode` takes [B, 16, h, w] as one latent frame each and gives images
[B, H, W, 3] in [0, 1], de-normalised with the VAE's latent statistics as the pipeline does.

Measured against diffusers' PyTorch QwenImagePipeline on a tiny random folder
(tests/parity/test_qwenimage_model.py, float32 on CPU, true_cfg_scale 1): the deterministic
sampler (4 steps, the release's dynamic shift and terminal sigma) differs by at most 3.4e-6
from `QwenImagePipeline(latents=..., output_type="latent")` on latents up to 4.9; the prompt
embeddings by 9.6e-7 from `encode_prompt`; the decoded images by 2.5e-6; the schedule's
sigmas by less than 1e-6, dynamic and static.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import causal_vae, components, decoder_prompts, patches
from tree_grpo_jax.models.base import Decoder, ModelLoadError
from tree_grpo_jax.models.qwenimage import family, text, transformer

POINT = text.POINT
HUB_PATTERNS = components.PIPELINE_PATTERNS
DEFAULT_RESOLUTION = 1024  # the pipeline's default height and width
LATENT_CHANNELS = 16


@dataclasses.dataclass(frozen=True)
class QwenImageScheduleConfig(components.ShiftedFlowScheduleConfig):
    """FlowMatchEulerDiscreteScheduler as QwenImagePipeline sets it up: `components`' shifted
    flow schedule (the release: dynamic, mu from 0.5 at 256 tokens to 0.9 at 8192), then,
    with `shift_terminal`, the sigmas before the final 0 stretched so that 1 - sigma scales
    to end at 1 - shift_terminal. A `static_shift` replaces both, as for the other families."""

    shift_terminal: float | None = None

    def sigmas(self, num_steps: int) -> np.ndarray:
        shifted = super().sigmas(num_steps)[:-1]
        if self.shift_terminal and self.static_shift <= 0:
            rest = 1.0 - shifted
            shifted = 1.0 - rest / (rest[-1] / (1.0 - self.shift_terminal))
        return np.append(shifted, 0.0)


# What `load_qwenimage` takes as keywords: `model.qwenimage`'s fields and the shared ones.
load_options = functools.partial(components.LoadOptions.of, dict(family.options().items()))
SCHEDULER_FIXED = {
    k: v for k, v in components.SHIFTED_SCHEDULER_FIXED.items() if k != "shift_terminal"
}


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class QwenImageModel(components.TransformerModel):
    """A loaded Qwen-Image folder; its `text_encoders` are a `text.QwenImageTextEncoder`."""


def schedule_config(
    config: dict, where: Path, image_seq_len: int, static_shift: float = 0.0
) -> QwenImageScheduleConfig:
    """The schedule of a `scheduler/scheduler_config.json`, checked."""
    return components.shifted_flow_schedule(
        QwenImageScheduleConfig,
        config,
        where,
        "Qwen-Image",
        image_seq_len,
        static_shift,
        fixed=SCHEDULER_FIXED,
    )


TRANSFORMER = components.Component(
    folder="transformer",
    pt_class="QwenImageTransformer2DModel",
    build=transformer.transformer_module,
    point=POINT,
    list_names=transformer.MODULE_LISTS,
)


def make_denoise(module, timestep_scale: float = 1000.0):
    """`(params, x [B, C, h, w], t [B] (sigma * timestep_scale), cond [B, L, D + 1]) ->
    velocity [B, C, h, w]`, as QwenImagePipeline calls its transformer (without guidance)."""

    def denoise(params, x, t, cond):
        batch, _, height, width = x.shape
        sigma = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (batch,)) / timestep_scale
        features, mask = decoder_prompts.split_conditioning(cond)
        out = module.apply(
            {"params": params},
            patches.pack_latents(x.astype(module.dtype)),
            features.astype(module.dtype),
            mask,
            sigma,
            jnp.asarray(transformer.image_ids(height, width)),
        )
        return patches.unpack_latents(out, height, width).astype(x.dtype)

    return denoise


def vae_scale_factor(vae_config: dict) -> int:
    """Pixels per latent: 2 ** (downsamples), as QwenImagePipeline computes it (8)."""
    return 2 ** len(vae_config.get("temperal_downsample", (False, True, True)))


def sample_shape(transformer_config: dict, vae_config: dict, resolution: int | None = None):
    """One latent frame, channels first, for square images of `resolution` pixels (default
    1024), which must be a multiple of two latents as the pipeline's packing requires."""
    scale = vae_scale_factor(vae_config)
    pixels = int(resolution or DEFAULT_RESOLUTION)
    if pixels < scale * 2 or pixels % (scale * 2):
        raise ModelLoadError(
            f"model.qwenimage.resolution {pixels} must be a positive multiple of {scale * 2} "
            "pixels (two latents), as QwenImagePipeline packs them."
        )
    side = pixels // scale
    return (transformer_config.get("out_channels") or LATENT_CHANNELS, side, side)


def image_tokens(shape: tuple[int, ...]) -> int:
    """The pipeline's image_seq_len for its shift: (h // 2) * (w // 2) packed tokens."""
    return (shape[1] // 2) * (shape[2] // 2)


def check_latent_channels(transformer_config: dict, vae_config: dict, where: Path) -> None:
    """The transformer's packed input must be 2x2 patches of the VAE's latent channels."""
    packed = transformer_config.get("in_channels", 64)
    out = transformer_config.get("out_channels") or LATENT_CHANNELS
    latent = vae_config.get("z_dim", LATENT_CHANNELS)
    if packed != 4 * latent or out != latent:
        raise ModelLoadError(
            f"{where}'s transformer takes {packed} packed channels and gives {out}, not 2x2 "
            f"patches of its VAE's {latent} latent channels; {POINT}."
        )


def image_decoder(module, vae_config: dict, dtype, batch_size: int):
    """`(params, latents [B, C, h, w]) -> images [B, H, W, 3]`: each latent as one frame
    through the causal VAE (`causal_vae.decode_fn`), its one video frame kept."""
    decode_video = causal_vae.decode_fn(module, vae_config, dtype, batch_size)

    def decode(params, latents):
        frames = jnp.transpose(latents, (0, 2, 3, 1))[:, None]  # [B, 1, h, w, C]
        return decode_video(params, frames)[:, 0]

    return decode


FOLDER = components.ImageFolder(
    TRANSFORMER, check_latent_channels, sample_shape, image_tokens, schedule_config
)


def load_qwenimage(path: str, dtype=jnp.float32, **options) -> QwenImageModel:
    """Loads a Qwen-Image pipeline folder (or hub id) as a TextToImageModel.

    `dtype` is the dtype of all params and of the computation; `options` are `LoadOptions`
    (`text_max_length`: the pipeline's max_sequence_length, `resolution`, `shift`; `remat`
    is what `model.remat` asks for).
    """
    options = load_options(**options)
    opened = FOLDER.open(path, dtype, options)
    module = opened.module
    decoder, decoder_params, _ = causal_vae.load_decoder(opened.folders["vae"], dtype, POINT)
    decode = image_decoder(decoder, opened.vae_config, dtype, options.decode_batch_size)
    encoder = text.load_text_encoder(
        opened.root, dtype, max_length=options.text_max_length, width=module.joint_attention_dim
    )
    return QwenImageModel(
        **opened.model_fields(encoder, options),
        denoise=make_denoise(module, float(opened.schedule.num_train_timesteps)),
        decode=Decoder(decode, decoder_params),
    )
