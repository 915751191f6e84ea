"""The Wan family's record: `model.name = "wan"` loads a diffusers Wan2.1 or Wan2.2
text-to-video folder (`WanPipeline`: Wan-AI/Wan2.1-T2V-1.3B-Diffusers, -14B-Diffusers,
Wan-AI/Wan2.2-TI2V-5B-Diffusers, Wan-AI/Wan2.2-T2V-A14B-Diffusers); TI2V-5B also animates
each prompt's input image (`WanImageToVideoPipeline` with `expand_timesteps`)."""

from __future__ import annotations

from tree_grpo_jax.core.settings import Setting, defaults_of
from tree_grpo_jax.models import registry

TRANSFORMER_CLASS = "WanTransformer3DModel"
# WanPipeline's defaults: 480 x 832 px, 81 frames, 512 umT5 tokens.
DEFAULT_RESOLUTION = (480, 832)
DEFAULT_FRAMES = 81
T5_MAX_LENGTH = 512
# Pixels per latent (the VAE's 8) times the transformer's 2x2 patch: a side's granularity.
SIDE_MULTIPLE = 16
FRAME_STRIDE = 4  # the VAE's temporal compression: a video has 4k + 1 frames


def resolution_of(value) -> tuple[int, int] | None:
    """`model.wan.resolution` as (height, width) ints; None when it is not a pair of ints."""
    pair = isinstance(value, (tuple, list)) and len(value) == 2
    if pair and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return (int(value[0]), int(value[1]))
    return None


def _resolution_sentence(value) -> str | None:
    size = resolution_of(value)
    if size is None or min(size) <= 0 or any(s % SIDE_MULTIPLE for s in size):
        return (
            "model.wan.resolution must be (height, width) in pixels, each a positive multiple "
            f"of {SIDE_MULTIPLE} (8 pixels per latent, 2x2 latents per token), got {value!r}."
        )
    return None


def _frames_sentence(frames) -> str | None:
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        return f"model.wan.num_frames must be a positive integer 4k + 1, got {frames!r}."
    if (frames - 1) % FRAME_STRIDE:
        return (
            f"model.wan.num_frames must be 4k + 1 (the VAE compresses 4 frames into one latent "
            f"frame after the first): {frames} is not; try {frames - (frames - 1) % 4} or "
            f"{frames - (frames - 1) % 4 + 4}."
        )
    return None


# `model.wan`: the family's own settings.
SETTINGS = {
    "resolution": Setting(
        DEFAULT_RESOLUTION,
        "(height, width) in pixels, multiples of 16",
        element=int,
        example="'(480,832)'",
        check=_resolution_sentence,
    ),
    "num_frames": Setting(
        DEFAULT_FRAMES,
        "frames per video, 4k + 1 (latent frames: k + 1)",
        check=_frames_sentence,
    ),
    "shift": registry.static_shift_setting(
        "> 0: the sigma shift (the scheduler's flow_shift; Wan uses 3 at 480p, 5 at 720p) in "
        "place of the folder's; 0: the folder's scheduler config",
        note="0: the folder's flow_shift",
    ),
    "t5_max_length": Setting(
        T5_MAX_LENGTH,
        "umT5 tokens per prompt (WanPipeline's 512)",
        low=1,
        high=T5_MAX_LENGTH,
        note="WanPipeline's max_sequence_length",
    ),
    "decode_batch_size": Setting(1, "videos through the VAE decoder at once", low=1),
    "image_to_video": Setting(
        True,
        "with a Wan2.2-TI2V folder (expand_timesteps): each prompt's input image is the "
        "video's first frame (False: text-to-video from the same folder)",
    ),
}
options = defaults_of(SETTINGS)


# A folder whose `transformer/config.json` names WanTransformer3DModel.
recognizes = registry.component_class_is("transformer", (TRANSFORMER_CLASS,))

FAMILY = registry.register(
    registry.pipeline_family(
        "wan",
        options,
        path_hint="a diffusers-layout Wan2.1 or Wan2.2 text-to-video folder (or a hub id)",
        # The projections of every block's self- and cross-attention (`attn1`, `attn2`):
        # `to_q`, `to_k`, `to_v`, `to_out.0` as diffusers' PEFT names them and Flow-Factory's
        # Wan examples list them, matched as path endings as PEFT matches them. Flow-Factory's
        # Wan adapters' own default adds the feed-forward (`ffn.net.0.proj`, `ffn.net.2`):
        # `lora.targets` can name those too ("ffn/net_0/proj", "ffn/net_2").
        lora_targets=("to_q", "to_k", "to_v", "to_out_0"),
        recognizes=recognizes,
        sample_settings=("resolution", "num_frames"),
    )
)
