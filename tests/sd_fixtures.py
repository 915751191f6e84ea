"""A tiny random Stable Diffusion folder in the real diffusers layout, built with PyTorch.

The components are diffusers' and transformers' PyTorch classes saved with `save_pretrained`
(safetensors), exactly as a Stable Diffusion 1.5 folder holds them, only a few thousand
times smaller. Tests that need torch import this module; the library never does.
"""

from __future__ import annotations

import json
from pathlib import Path

# Letters and a few whole words, enough for prompts like "a photo of a cat".
WORDS = ("a", "photo", "of", "cat", "dog", "digit")
MERGES = ("c a", "ca t</w>", "d o", "do g</w>", "p h", "ph o", "pho t", "phot o</w>", "o f</w>")

UNET_CONFIG = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    cross_attention_dim=32,
    attention_head_dim=4,  # SD1.x semantics: the number of heads (see notes/sd15.md)
    norm_num_groups=32,
)
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=16,
)
TEXT_CONFIG = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
    hidden_act="quick_gelu",
    projection_dim=32,
)
# Stable Diffusion 1.5's training schedule.
SCHEDULER_CONFIG = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
    prediction_type="epsilon",
)
MODEL_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "feature_extractor": [None, None],
    "requires_safety_checker": False,
    "safety_checker": [None, None],
    "scheduler": ["diffusers", "DDIMScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def make_vocab() -> dict[str, int]:
    tokens = ["<|startoftext|>", "<|endoftext|>"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens += letters + [c + "</w>" for c in letters]
    tokens += [m.replace(" ", "") for m in MERGES]
    tokens += [w + "</w>" for w in WORDS if w + "</w>" not in tokens]
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}


def perturb(module, generator) -> None:
    """Adds noise to every weight so that ones/zeros (norm scales, biases) are not special."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def make_tiny_sd_folder(path, seed: int = 0) -> Path:
    """Writes a tiny random SD pipeline folder at `path` and returns it as a Path."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)

    tok_dir = path / "tokenizer_src"
    tok_dir.mkdir(exist_ok=True)
    vocab = make_vocab()
    (tok_dir / "vocab.json").write_text(json.dumps(vocab))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    tokenizer = CLIPTokenizer(
        str(tok_dir / "vocab.json"),
        str(tok_dir / "merges.txt"),
        model_max_length=TEXT_CONFIG["max_position_embeddings"],
    )
    tokenizer.save_pretrained(path / "tokenizer")
    for f in tok_dir.iterdir():
        f.unlink()
    tok_dir.rmdir()

    text_config = CLIPTextConfig(
        vocab_size=len(vocab),
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        **TEXT_CONFIG,
    )
    models = {
        "unet": UNet2DConditionModel(**UNET_CONFIG),
        "vae": AutoencoderKL(**VAE_CONFIG),
        "text_encoder": CLIPTextModel(text_config),
    }
    for name, model in models.items():
        perturb(model, generator)
        model.eval().save_pretrained(path / name, safe_serialization=True)
    DDIMScheduler(**SCHEDULER_CONFIG).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return path
