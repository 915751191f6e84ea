"""JSON configs that several built-in releases share, as data, with their architecture
fields only: OpenAI's CLIP ViT-L/14 text tower (CLIP-L), T5 v1.1 XXL's encoder and the
`AutoencoderKL` (SD1.5's with 4 latent channels; the flow-matching releases' with 16, which
differ in their latent scaling alone)."""

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
