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
        "vae/config.json": {
            "_class_name": "AutoencoderKL",
            "act_fn": "silu",
            "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4,
            "in_channels": 3,
            "latent_channels": 16,
            "layers_per_block": 2,
            "mid_block_add_attention": True,
            "norm_num_groups": 32,
            "out_channels": 3,
            "sample_size": 1024,
            "scaling_factor": 1.5305,
            "shift_factor": 0.0609,
            "up_block_types": ["UpDecoderBlock2D"] * 4,
            "use_post_quant_conv": False,
            "use_quant_conv": False,
        },
        "scheduler/scheduler_config.json": {
            "_class_name": "FlowMatchEulerDiscreteScheduler",
            "num_train_timesteps": 1000,
            "shift": 3.0,
        },
        "text_encoder/config.json": {  # CLIP-L
            "architectures": ["CLIPTextModelWithProjection"],
            "hidden_act": "quick_gelu",
            "hidden_size": 768,
            "intermediate_size": 3072,
            "max_position_embeddings": 77,
            "model_type": "clip_text_model",
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
            "projection_dim": 768,
            "vocab_size": 49408,
        },
        "tokenizer/tokenizer_config.json": {"model_max_length": 77},
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
        "text_encoder_3/config.json": {  # T5-XXL's encoder
            "architectures": ["T5EncoderModel"],
            "d_ff": 10240,
            "d_kv": 64,
            "d_model": 4096,
            "dense_act_fn": "gelu_new",
            "feed_forward_proj": "gated-gelu",
            "is_gated_act": True,
            "layer_norm_epsilon": 1e-06,
            "model_type": "t5",
            "num_heads": 64,
            "num_layers": 24,
            "relative_attention_max_distance": 128,
            "relative_attention_num_buckets": 32,
            "vocab_size": 32128,
        },
    },
)

RELEASES = {"sd35m": SD35_MEDIUM}
