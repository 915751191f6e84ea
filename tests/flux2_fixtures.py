"""Tiny random FLUX.2 folders in the real diffusers layout, built with PyTorch: dev
(`Flux2Pipeline`, a transformers `Mistral3ForConditionalGeneration` text encoder, vision tower
included, as black-forest-labs/FLUX.2-dev ships Mistral Small 3.1) and klein
(`Flux2KleinPipeline`, a `Qwen3ForCausalLM`, as FLUX.2-klein ships Qwen3). The transformer
(`Flux2Transformer2DModel`), the VAE (`AutoencoderKLFlux2`, its batch-norm statistics set to
random values) and the flow-matching scheduler are saved with `save_pretrained`
(safetensors), only tiny: the FLUX2 and FLUX2_KLEIN tables of launch/tiny_architectures.py,
the architectures launch/tiny_folders.py writes without torch. The tokenizers are
launch/tiny_folders.py's byte tokenizers (klein's Qwen3-shaped, dev's Mistral-shaped), so
the chat templates' token counts are not the real ones'.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sd_fixtures import perturb

from launch.tiny_architectures import (
    FLUX2,
    FLUX2_KLEIN,
    FLUX2_LATENT_CHANNELS,
    FLUX2_RESOLUTION,
    FLUX2_TEXT_WIDTH,
)
from launch.tiny_folders import byte_tokenizer, mistral_byte_tokenizer

RESOLUTION = FLUX2_RESOLUTION
LATENT_CHANNELS = FLUX2_LATENT_CHANNELS
TEXT_WIDTH = 3 * FLUX2_TEXT_WIDTH  # the transformer's joint_attention_dim
TABLES = {"dev": FLUX2, "klein": FLUX2_KLEIN}


def _lists(config: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def make_tiny_flux2_folder(path, variant: str, seed: int = 0) -> Path:
    """Writes a tiny random FLUX.2 `variant` ("dev" or "klein") pipeline folder at `path`."""
    import transformers
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2Transformer2DModel,
    )

    table = TABLES[variant]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    if variant == "dev":
        mistral_byte_tokenizer().save_pretrained(path / "tokenizer")
        config = transformers.Mistral3Config(
            text_config=dict(table["text_encoder"]),
            vision_config=dict(table["vision"]),
            image_token_index=table["text_encoder"]["vocab_size"] - 1,
        )
        text = transformers.Mistral3ForConditionalGeneration(config)
    else:
        byte_tokenizer().save_pretrained(path / "tokenizer")
        text = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**table["text_encoder"]))
    perturb(text, generator)
    text.eval().save_pretrained(path / "text_encoder", safe_serialization=True)
    model = Flux2Transformer2DModel(**_lists(table["transformer"]))
    perturb(model, generator)
    model.eval().save_pretrained(path / "transformer", safe_serialization=True)
    vae = AutoencoderKLFlux2(**_lists(table["vae"]))
    perturb(vae, generator)
    with torch.no_grad():  # statistics a pipeline's decode visibly applies
        vae.bn.running_mean.normal_(0.0, 0.5, generator=generator)
        vae.bn.running_var.uniform_(0.5, 2.0, generator=generator)
    vae.eval().save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**table["scheduler"]).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(table["model_index"], indent=2))
    return path
