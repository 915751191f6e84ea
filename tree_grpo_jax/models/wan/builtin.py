"""Wan2.1-T2V-1.3B's and -14B's JSON configs as data: `model.path=builtin:wan-1.3b` (or
`builtin:wan-14b`) plans a run on the public releases (Wan-AI/Wan2.1-T2V-1.3B-Diffusers,
Wan-AI/Wan2.1-T2V-14B-Diffusers) without any of their files.

The values are the releases' `transformer/config.json` (30 blocks of width 1536, 12 heads
of 128, FFN 8960 for 1.3B; 40 blocks of 5120, 40 heads, FFN 13824 for 14B; both take
umT5's 4096-wide states and patches of 1x2x2 latents), `vae/config.json` (the shared
`AutoencoderKLWan`: 16 latent channels, 8x spatial and 4x temporal compression, its
per-channel latents_mean and latents_std), `scheduler/scheduler_config.json` (UniPC with
flow sigmas and flow_shift 3, the 480p value) and the text encoder's `config.json`
(umT5-XXL's encoder: d_model 4096, 24 layers, 64 heads of 64, gated-GELU FFN 10240, a
256,384-token vocabulary, a relative attention bias in every layer), with the fields that
size the model.
"""

from __future__ import annotations

from tree_grpo_jax.models import builtin_configs
from tree_grpo_jax.models.abstract import BuiltinRelease

_TRANSFORMER = {
    "_class_name": "WanTransformer3DModel",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}
_VAE = {"_class_name": "AutoencoderKLWan", **builtin_configs.CAUSAL_VAE}
_SCHEDULER = {
    "_class_name": "UniPCMultistepScheduler",
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "solver_order": 2,
    "use_flow_sigmas": True,
}
# umT5-XXL's encoder: T5 v1.1 XXL's shape, with umT5's vocabulary and an untied head.
UMT5_XXL = {
    **builtin_configs.T5_XXL,
    "architectures": ["UMT5EncoderModel"],
    "model_type": "umt5",
    "tie_word_embeddings": False,
    "vocab_size": 256384,
}


def _release(hub_id: str, **transformer) -> BuiltinRelease:
    return BuiltinRelease(
        hub_id=hub_id,
        configs={
            "transformer/config.json": {**_TRANSFORMER, **transformer},
            "vae/config.json": _VAE,
            "scheduler/scheduler_config.json": _SCHEDULER,
            "text_encoder/config.json": UMT5_XXL,
            "tokenizer/tokenizer_config.json": {"model_max_length": 512},
        },
    )


WAN_1_3B = _release(
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", num_attention_heads=12, ffn_dim=8960, num_layers=30
)
WAN_14B = _release(
    "Wan-AI/Wan2.1-T2V-14B-Diffusers", num_attention_heads=40, ffn_dim=13824, num_layers=40
)

RELEASES = {"wan-1.3b": WAN_1_3B, "wan-14b": WAN_14B}
