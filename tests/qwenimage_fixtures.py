"""A tiny random Qwen-Image folder in the real diffusers layout, built with PyTorch.

The transformer (`QwenImageTransformer2DModel`), the causal VAE (`AutoencoderKLQwenImage`,
16 latent channels with random latent statistics, 8 pixels a latent as released), the text
encoder (a transformers `Qwen2_5_VLForConditionalGeneration`, vision tower included, as
Qwen/Qwen-Image ships Qwen2.5-VL-7B) and the flow-matching scheduler (the release's dynamic
shift with its terminal sigma 0.02) are saved with `save_pretrained` (safetensors), only
tiny: the QWENIMAGE table of launch/tiny_architectures.py, the architecture
launch/tiny_folders.py writes without torch. The tokenizer is launch/tiny_folders.py's
`byte_tokenizer` (one token a byte, so the 34 tokens the pipeline drops are part of the
system turn, not all of it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sd_fixtures import perturb

from launch.tiny_architectures import (
    QWENIMAGE,
    QWENIMAGE_LATENT_CHANNELS,
    QWENIMAGE_RESOLUTION,
    QWENIMAGE_TEXT_WIDTH,
)
from launch.tiny_folders import byte_tokenizer

RESOLUTION = QWENIMAGE_RESOLUTION
LATENT_CHANNELS = QWENIMAGE_LATENT_CHANNELS
TEXT_WIDTH = QWENIMAGE_TEXT_WIDTH
TEXT = QWENIMAGE["text_encoder"]
VISION = QWENIMAGE["vision"]
TRANSFORMER = QWENIMAGE["transformer"]
VAE = QWENIMAGE["vae"]
SCHEDULER = QWENIMAGE["scheduler"]
MODEL_INDEX = QWENIMAGE["model_index"]


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
    byte_tokenizer().save_pretrained(path / "tokenizer")
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION)
    text = transformers.Qwen2_5_VLForConditionalGeneration(config)
    perturb(text, generator)
    text.eval().save_pretrained(path / "text_encoder", safe_serialization=True)
    model = QwenImageTransformer2DModel(**TRANSFORMER)
    perturb(model, generator)
    model.eval().save_pretrained(path / "transformer", safe_serialization=True)
    # diffusers' VAE adds lists to its sequences: the table's tuples as lists
    vae = AutoencoderKLQwenImage(
        **{k: list(v) if isinstance(v, tuple) else v for k, v in VAE.items()}
    )
    perturb(vae, generator)
    vae.eval().save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return path
