"""FLUX.1-dev's and FLUX.1-schnell's JSON configs as data: `model.path=builtin:flux-dev` (or
`builtin:flux-schnell`) plans a run on the public releases (black-forest-labs/FLUX.1-dev,
black-forest-labs/FLUX.1-schnell) without any of their files.

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
_VAE = {
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
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
}
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
_CLIP_L = {
    "architectures": ["CLIPTextModel"],
    "eos_token_id": 2,
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "max_position_embeddings": 77,
    "model_type": "clip_text_model",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "projection_dim": 768,
    "vocab_size": 49408,
}
_T5_XXL = {  # T5 v1.1 XXL's encoder
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
}


def _release(hub_id: str, transformer: dict, scheduler: dict) -> BuiltinRelease:
    return BuiltinRelease(
        hub_id=hub_id,
        configs={
            "transformer/config.json": transformer,
            "vae/config.json": _VAE,
            "scheduler/scheduler_config.json": scheduler,
            "text_encoder/config.json": _CLIP_L,
            "tokenizer/tokenizer_config.json": {"model_max_length": 77},
            "text_encoder_2/config.json": _T5_XXL,
            "tokenizer_2/tokenizer_config.json": {"model_max_length": 512},
        },
    )


FLUX_DEV = _release("black-forest-labs/FLUX.1-dev", _TRANSFORMER, _SCHEDULER)
FLUX_SCHNELL = _release(
    "black-forest-labs/FLUX.1-schnell",
    {**_TRANSFORMER, "guidance_embeds": False},
    {**_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False},
)

RELEASES = {"flux-dev": FLUX_DEV, "flux-schnell": FLUX_SCHNELL}
