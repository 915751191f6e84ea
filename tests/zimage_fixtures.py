"""A tiny random Z-Image folder in the real diffusers layout, built with PyTorch.

The transformer (`ZImageTransformer2DModel`), the 16-channel VAE without quant convs (FLUX's
latent statistics, which Z-Image reuses), the text encoder (a transformers `Qwen3Model`, as
Tongyi-MAI/Z-Image-Turbo ships Qwen3-4B) and the flow-matching scheduler (the release's
static shift 3) are saved with `save_pretrained` (safetensors), only tiny: the ZIMAGE table of
launch/tiny_architectures.py, the architecture launch/tiny_folders.py writes without torch.
No Qwen tokenizer is stored offline: `byte_tokenizer` (launch/tiny_folders.py's) builds a
byte-level `Qwen2Tokenizer` (one token a byte, the chat markers as special tokens, a chat
template in the shape of Qwen3's), saved as the folder's `tokenizer/`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sd_fixtures import perturb

from launch.tiny_architectures import ZIMAGE, ZIMAGE_RESOLUTION, ZIMAGE_TEXT_WIDTH
from launch.tiny_folders import byte_tokenizer

RESOLUTION = ZIMAGE_RESOLUTION
TEXT_WIDTH = ZIMAGE_TEXT_WIDTH
TEXT_ENCODER = ZIMAGE["text_encoder"]
TRANSFORMER = ZIMAGE["transformer"]
VAE = ZIMAGE["vae"]
SCHEDULER = ZIMAGE["scheduler"]
MODEL_INDEX = ZIMAGE["model_index"]
__all__ = ["byte_tokenizer", "make_tiny_zimage_folder"]  # byte_tokenizer: the tests import it here


def make_tiny_zimage_folder(path, seed: int = 0) -> Path:
    """Writes a tiny random Z-Image pipeline folder at `path`; returns it."""
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    byte_tokenizer().save_pretrained(path / "tokenizer")
    text = transformers.Qwen3Model(transformers.Qwen3Config(**TEXT_ENCODER))
    perturb(text, generator)
    text.eval().save_pretrained(path / "text_encoder", safe_serialization=True)
    model = ZImageTransformer2DModel(**TRANSFORMER)
    perturb(model, generator)
    model.eval().save_pretrained(path / "transformer", safe_serialization=True)
    vae = AutoencoderKL(**VAE)
    perturb(vae, generator)
    vae.eval().save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return path
