"""JSON configs that several built-in releases share, as data, with their architecture
fields only: OpenAI's CLIP ViT-L/14 text tower (CLIP-L), T5 v1.1 XXL's encoder, the
`AutoencoderKL` (SD1.5's with 4 latent channels; the flow-matching releases' with 16, which
differ in their latent scaling alone), the causal video VAE of Wan2.1 (which Qwen-Image
ships under its own class name) and the decoder-only text encoders of the 2026 releases
(Qwen2.5-VL-7B's language model, Qwen3-4B and Qwen3-8B, Mistral Small 3.1's language
model)."""

from __future__ import annotations

import copy

_CLIP_L = {
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
CLIP_TOKENIZER = {"model_max_length": 77}
T5_XXL = {
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


def clip_l(architecture: str, **fields) -> dict:
    """CLIP-L's config as a release ships it: its `architectures` (`CLIPTextModel`, or
    `CLIPTextModelWithProjection` where the pooled projection is used) and any fields of its
    own."""
    return {"architectures": [architecture], **_CLIP_L, **fields}


_AUTOENCODER_KL = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}


def autoencoder_kl(latent_channels: int, sample_size: int, **fields) -> dict:
    """The `AutoencoderKL` every built-in release ships (four blocks of 128 to 512 channels)
    with its latent channels, sample size and any fields of its own; keys sorted, as the
    releases write them."""
    config = copy.deepcopy(_AUTOENCODER_KL)  # each release its own lists
    config |= {"latent_channels": latent_channels, "sample_size": sample_size, **fields}
    return dict(sorted(config.items()))


def vae_16_channels(scaling_factor: float, shift_factor: float) -> dict:
    """The 16-latent-channel VAE (no quant convs) with a release's latent scaling."""
    return autoencoder_kl(
        16,
        1024,
        mid_block_add_attention=True,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_post_quant_conv=False,
        use_quant_conv=False,
    )


# Wan2.1's `AutoencoderKLWan` (Qwen-Image's `AutoencoderKLQwenImage` has the same fields and
# values): 16 latent channels, 8x spatial and 4x temporal compression, per-channel latent
# statistics.
CAUSAL_VAE = {
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": [
        -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
    ],
    "latents_std": [
        2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916,
    ],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}  # fmt: skip

# Qwen2.5-VL-7B-Instruct's language model, as Qwen-Image's `text_encoder/config.json` gives it
# (the vision tower's fields left out: prompts are text alone): 28 layers of width 3584, 28
# query heads over 4 key/value heads of 128, SwiGLU 18944, multimodal rotary sections
# 16/24/24 (one position per text token, so the plain rotary).
QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}
# Qwen3-4B (Z-Image's text encoder): 36 layers of width 2560, 32 query heads over 8 key/value
# heads of 128, SwiGLU 9728, RMSNorm on queries and keys, tied embeddings.
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
# Qwen3-8B (FLUX.2 klein 9B's text encoder; klein 4B's is QWEN3_4B): 36 layers of width 4096,
# 32 query heads over 8 key/value heads of 128, SwiGLU 12288, untied embeddings. Values of
# Qwen/Qwen3-8B's config.json as kohya-ss/musubi-tuner's Qwen3 loader writes them out
# (QWEN3_8B_CONFIG_JSON).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
# Mistral Small 3.1 24B (FLUX.2 dev's `text_encoder/`, a `Mistral3ForConditionalGeneration`),
# its language model only (the Pixtral vision tower left out: prompts are text alone): 40
# layers of width 5120, 32 query heads over 8 key/value heads of 128, SwiGLU 32768, rotary
# theta 1e9, no sliding window. Values of kohya-ss/musubi-tuner
# src/musubi_tuner/flux_2/flux2_utils.py (M3_CONFIG_JSON, FLUX.2-dev's text encoder config).
MISTRAL_SMALL_31_24B = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "model_type": "mistral3",
    "text_config": {
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "vocab_size": 131072,
    },
}
