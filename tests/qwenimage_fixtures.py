"""A tiny random Qwen-Image folder in the real diffusers layout, built with PyTorch.

The transformer (`QwenImageTransformer2DModel`), the causal VAE (`AutoencoderKLQwenImage`,
16 latent channels with random latent statistics, 8 pixels a latent as released), the text
encoder (a transformers `Qwen2_5_VLForConditionalGeneration`, vision tower included, as
Qwen/Qwen-Image ships Qwen2.5-VL-7B) and the flow-matching scheduler (the release's dynamic
shift with its terminal sigma 0.02) are saved with `save_pretrained` (safetensors), only
tiny. The tokenizer is `zimage_fixtures.byte_tokenizer` (one token a byte, so the 34 tokens
the pipeline drops are part of the system turn, not all of it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from sd_fixtures import perturb
from zimage_fixtures import byte_tokenizer

RESOLUTION = 64  # pixels: 8 a latent, so 8x8 latents, 16 packed tokens
LATENT_CHANNELS = 16
TEXT_WIDTH = 32  # the Qwen2.5-VL hidden size, the transformer's joint_attention_dim (3584)
TEXT = dict(
    vocab_size=260,  # the 256 byte tokens, <|endoftext|> and the chat markers
    hidden_size=TEXT_WIDTH,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 700.0, "mrope_section": [1, 1, 2]},
)
VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=TEXT_WIDTH,
    patch_size=2,
    temporal_patch_size=1,
    spatial_merge_size=1,
    window_size=4,
    fullatt_block_indexes=[0],
)
TRANSFORMER = dict(
    patch_size=2,
    in_channels=4 * LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=TEXT_WIDTH,
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),
)
VAE = dict(
    base_dim=8,
    z_dim=LATENT_CHANNELS,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)
# Qwen/Qwen-Image's scheduler_config.json.
SCHEDULER = dict(
    num_train_timesteps=1000,
    use_dynamic_shifting=True,
    shift=1.0,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    base_shift=0.5,
    max_shift=0.9,
    shift_terminal=0.02,
    time_shift_type="exponential",
)
MODEL_INDEX = {
    "_class_name": "QwenImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}


def make_tiny_qwenimage_folder(path, seed: int = 0) -> Path:
    """Writes a tiny random Qwen-Image pipeline folder at `path`; returns it."""
    import transformers
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    byte_tokenizer().save_pretrained(path / "tokenizer")
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION)
    text = transformers.Qwen2_5_VLForConditionalGeneration(config)
    perturb(text, generator)
    text.eval().save_pretrained(path / "text_encoder", safe_serialization=True)
    model = QwenImageTransformer2DModel(**TRANSFORMER)
    perturb(model, generator)
    model.eval().save_pretrained(path / "transformer", safe_serialization=True)
    vae = AutoencoderKLQwenImage(
        **VAE,
        latents_mean=rng.normal(0.0, 0.5, LATENT_CHANNELS).round(4).tolist(),
        latents_std=rng.uniform(0.5, 2.5, LATENT_CHANNELS).round(4).tolist(),
    )
    perturb(vae, generator)
    vae.eval().save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return path
