"""FLUX.1-dev's and FLUX.1-schnell's JSON configs as data: `model.path=builtin:flux-dev` (or
`builtin:flux-schnell`, `builtin:flux-kontext-dev`) plans a run on the public releases
(black-forest-labs/FLUX.1-dev, black-forest-labs/FLUX.1-schnell, the editing
black-forest-labs/FLUX.1-Kontext-dev) without any of their files.

The values are the releases' own `transformer/config.json` (19 double-stream and 38
single-stream blocks of width 3072, 24 heads of 128; dev embeds the distilled guidance
scale, schnell does not), `vae/config.json` (16 latent channels, no quant convs, scaling
0.3611 and shift 0.1159), `scheduler/scheduler_config.json` (dev shifts its sigmas with the
image's token count, schnell by a static 1.0) and the text encoders' `config.json`s that
size the conditioning: CLIP-L (`text_encoder`, a `CLIPTextModel`) and T5-XXL
(`text_encoder_2`), with their architecture fields only.
"""

from __future__ import annotations

from tree_grpo_jax.models.abstract import BuiltinRelease
from tree_grpo_jax.models.builtin_configs import CLIP_TOKENIZER, T5_XXL, clip_l, vae_16_channels

_TRANSFORMER = {
    "_class_name": "FluxTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
_VAE = vae_16_channels(scaling_factor=0.3611, shift_factor=0.1159)
_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def _release(hub_id: str, transformer: dict, scheduler: dict) -> BuiltinRelease:
    return BuiltinRelease(
        hub_id=hub_id,
        configs={
            "transformer/config.json": transformer,
            "vae/config.json": _VAE,
            "scheduler/scheduler_config.json": scheduler,
            "text_encoder/config.json": clip_l("CLIPTextModel", eos_token_id=2),
            "tokenizer/tokenizer_config.json": CLIP_TOKENIZER,
            "text_encoder_2/config.json": T5_XXL,
            "tokenizer_2/tokenizer_config.json": {"model_max_length": 512},
        },
    )


FLUX_DEV = _release("black-forest-labs/FLUX.1-dev", _TRANSFORMER, _SCHEDULER)
FLUX_SCHNELL = _release(
    "black-forest-labs/FLUX.1-schnell",
    {**_TRANSFORMER, "guidance_embeds": False},
    {**_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False},
)

# FLUX.1-Kontext-dev is FLUX.1-dev's architecture (its transformer loads into the same class
# with the same config; its VAE and text encoders are dev's): the editing is in the tokens.
FLUX_KONTEXT_DEV = _release("black-forest-labs/FLUX.1-Kontext-dev", _TRANSFORMER, _SCHEDULER)

RELEASES = {
    "flux-dev": FLUX_DEV,
    "flux-schnell": FLUX_SCHNELL,
    "flux-kontext-dev": FLUX_KONTEXT_DEV,
}
