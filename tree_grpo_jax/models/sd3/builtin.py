"""Stable Diffusion 3.5 Medium's JSON configs as data: `model.path=builtin:sd35m` plans a run on
the public release (stabilityai/stable-diffusion-3.5-medium) without any of its files.

The values are the release's own `transformer/config.json` (the MMDiT-X: 24 joint blocks of
width 1536, dual attention in the first 13, RMS qk-norm), `vae/config.json` (16 latent
channels, no quant convs), `scheduler/scheduler_config.json` (flow matching, shift 3) and
the text encoders' `config.json`s that size the conditioning: CLIP-L (`text_encoder`),
CLIP-G (`text_encoder_2`) and T5-XXL (`text_encoder_3`), with their architecture fields only.
"""

from __future__ import annotations

from tree_grpo_jax.models.abstract import BuiltinRelease
from tree_grpo_jax.models.builtin_configs import CLIP_TOKENIZER, T5_XXL, clip_l, vae_16_channels

SD35_MEDIUM = BuiltinRelease(
    hub_id="stabilityai/stable-diffusion-3.5-medium",
    configs={
        "transformer/config.json": {
            "_class_name": "SD3Transformer2DModel",
            "attention_head_dim": 64,
            "caption_projection_dim": 1536,
            "dual_attention_layers": list(range(13)),
            "in_channels": 16,
            "joint_attention_dim": 4096,
            "num_attention_heads": 24,
            "num_layers": 24,
            "out_channels": 16,
            "patch_size": 2,
            "pooled_projection_dim": 2048,
            "pos_embed_max_size": 384,
            "qk_norm": "rms_norm",
            "sample_size": 128,
        },
        "vae/config.json": vae_16_channels(scaling_factor=1.5305, shift_factor=0.0609),
        "scheduler/scheduler_config.json": {
            "_class_name": "FlowMatchEulerDiscreteScheduler",
            "num_train_timesteps": 1000,
            "shift": 3.0,
        },
        "text_encoder/config.json": clip_l("CLIPTextModelWithProjection"),
        "tokenizer/tokenizer_config.json": CLIP_TOKENIZER,
        "text_encoder_2/config.json": {  # CLIP-G
            "architectures": ["CLIPTextModelWithProjection"],
            "hidden_act": "gelu",
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "max_position_embeddings": 77,
            "model_type": "clip_text_model",
            "num_attention_heads": 20,
            "num_hidden_layers": 32,
            "projection_dim": 1280,
            "vocab_size": 49408,
        },
        "text_encoder_3/config.json": T5_XXL,
    },
)

RELEASES = {"sd35m": SD35_MEDIUM}
