"""Qwen-Image's JSON configs as data: `model.path=builtin:qwen-image` plans a run on the public
release (Qwen/Qwen-Image) without any of its files.

The values are the release's `transformer/config.json` (60 dual-stream blocks of width 3072:
24 heads of 128, rotary axes 16/56/56; latents packed 2x2 into 64 channels; prompt states
3584 wide), `vae/config.json` (`AutoencoderKLQwenImage`: Wan2.1's causal VAE fields and
latent statistics), `scheduler/scheduler_config.json` (FlowMatchEulerDiscreteScheduler with
the exponential dynamic shift, mu from 0.5 at 256 tokens to 0.9 at 8192, and the terminal
sigma 0.02) and the text encoder's `config.json` (Qwen2.5-VL-7B's language model).
"""

from __future__ import annotations

from tree_grpo_jax.models import builtin_configs
from tree_grpo_jax.models.abstract import BuiltinRelease

_TRANSFORMER = {
    "_class_name": "QwenImageTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 768,
}
_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

QWEN_IMAGE = BuiltinRelease(
    hub_id="Qwen/Qwen-Image",
    configs={
        "transformer/config.json": _TRANSFORMER,
        "vae/config.json": {"_class_name": "AutoencoderKLQwenImage", **builtin_configs.CAUSAL_VAE},
        "scheduler/scheduler_config.json": _SCHEDULER,
        "text_encoder/config.json": builtin_configs.QWEN25_VL_7B,
    },
)

RELEASES = {"qwen-image": QWEN_IMAGE}
