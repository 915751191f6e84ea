"""Stable Diffusion 1.5's JSON configs as data: `model.path=builtin:sd15` plans a run on the
public release (stable-diffusion-v1-5/stable-diffusion-v1-5) without any of its files.

The values are the release's own `unet/config.json`, `vae/config.json`,
`text_encoder/config.json` (OpenAI's CLIP ViT-L/14 text tower), `tokenizer/tokenizer_config.json`
and `scheduler/scheduler_config.json`, with their architecture fields only (no file names,
versions or dtypes).
"""

from __future__ import annotations

from tree_grpo_jax.models.abstract import BuiltinRelease
from tree_grpo_jax.models.builtin_configs import CLIP_TOKENIZER, autoencoder_kl, clip_l

SD15 = BuiltinRelease(
    hub_id="stable-diffusion-v1-5/stable-diffusion-v1-5",
    configs={
        "unet/config.json": {
            "_class_name": "UNet2DConditionModel",
            "act_fn": "silu",
            "attention_head_dim": 8,
            "block_out_channels": [320, 640, 1280, 1280],
            "center_input_sample": False,
            "cross_attention_dim": 768,
            "down_block_types": [
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
                "DownBlock2D",
            ],
            "downsample_padding": 1,
            "flip_sin_to_cos": True,
            "freq_shift": 0,
            "in_channels": 4,
            "layers_per_block": 2,
            "mid_block_scale_factor": 1,
            "norm_eps": 1e-05,
            "norm_num_groups": 32,
            "out_channels": 4,
            "sample_size": 64,
            "up_block_types": [
                "UpBlock2D",
                "CrossAttnUpBlock2D",
                "CrossAttnUpBlock2D",
                "CrossAttnUpBlock2D",
            ],
        },
        "vae/config.json": autoencoder_kl(4, 512),
        "text_encoder/config.json": clip_l("CLIPTextModel", layer_norm_eps=1e-05),
        "tokenizer/tokenizer_config.json": CLIP_TOKENIZER,
        "scheduler/scheduler_config.json": {
            "_class_name": "PNDMScheduler",
            "beta_end": 0.012,
            "beta_schedule": "scaled_linear",
            "beta_start": 0.00085,
            "clip_sample": False,
            "num_train_timesteps": 1000,
            "set_alpha_to_one": False,
            "skip_prk_steps": True,
            "steps_offset": 1,
            "trained_betas": None,
        },
    },
)

RELEASES = {"sd15": SD15}
