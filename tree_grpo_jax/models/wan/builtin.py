"""Wan2.1-T2V-1.3B's and -14B's and Wan2.2's JSON configs as data: `model.path=builtin:wan-1.3b`
(or `builtin:wan-14b`, `builtin:wan2.2-ti2v-5b`, `builtin:wan2.2-t2v-a14b`) plans a run on
the public releases (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan-AI/Wan2.1-T2V-14B-Diffusers,
Wan-AI/Wan2.2-TI2V-5B-Diffusers, Wan-AI/Wan2.2-T2V-A14B-Diffusers) without any of their
files.

Wan2.2-TI2V-5B: 30 blocks of width 3072 (24 heads of 128), FFN 14336, 48 latent channels in
and out (DiffSynth-Studio's model config for the release's DiT, hash 1f5ab770...); its VAE
is Wan2.2's (base_dim 160, decoder_base_dim 256, z_dim 48, residual, 2x2 pixel patches, so
16x spatial and 4x temporal compression, and its 48 latents_mean / latents_std: diffusers'
scripts/convert_wan_to_diffusers.py, `vae22_diffusers_config`); UniPC at flow_shift 5 and a
WanPipeline with `expand_timesteps` (the same script). Wan2.2-T2V-A14B: two experts each of
Wan2.1-T2V-14B's shape (`transformer/` high noise, `transformer_2/` low noise), Wan2.1's
VAE, flow_shift 3 and `boundary_ratio` 0.875 (the same script's T2V branch).

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

# Wan2.2's VAE (the TI2V-5B release's `vae/config.json`).
_VAE_22 = {
    "_class_name": "AutoencoderKLWan",
    "attn_scales": [],
    "base_dim": 160,
    "decoder_base_dim": 256,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "in_channels": 12,
    "is_residual": True,
    "latents_mean": [
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
        -0.1382, 0.0542, 0.2813, 0.0891, 0.157, -0.0098, 0.0375, -0.1825,
        -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
        -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123,
        -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052, 0.3748,
        0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    "latents_std": [
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013,
        0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
        0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
        0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
        0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
        0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
    "num_res_blocks": 2,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True],
    "z_dim": 48,
}  # fmt: skip
_INDEX = {
    "_class_name": "WanPipeline",
    "boundary_ratio": None,
    "expand_timesteps": False,
    "transformer_2": [None, None],
}

WAN22_TI2V_5B = BuiltinRelease(
    hub_id="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    configs={
        **WAN_1_3B.configs,
        "transformer/config.json": {
            **_TRANSFORMER,
            "in_channels": 48,
            "out_channels": 48,
            "num_attention_heads": 24,
            "ffn_dim": 14336,
            "num_layers": 30,
        },
        "vae/config.json": _VAE_22,
        "scheduler/scheduler_config.json": {**_SCHEDULER, "flow_shift": 5.0},
        "model_index.json": {**_INDEX, "expand_timesteps": True},
    },
)
WAN22_T2V_A14B = BuiltinRelease(
    hub_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    configs={
        **WAN_14B.configs,
        "transformer_2/config.json": WAN_14B.configs["transformer/config.json"],
        "model_index.json": {
            **_INDEX,
            "boundary_ratio": 0.875,
            "transformer_2": ["diffusers", "WanTransformer3DModel"],
        },
    },
)

RELEASES = {
    "wan-1.3b": WAN_1_3B,
    "wan-14b": WAN_14B,
    "wan2.2-ti2v-5b": WAN22_TI2V_5B,
    "wan2.2-t2v-a14b": WAN22_T2V_A14B,
}
