"""Trained SD3 transformer params -> a diffusers Stable Diffusion 3 folder PyTorch loads:
`<out>/transformer/` (config, Flax msgpack, `diffusion_pytorch_model.safetensors`) beside
the base folder's other components, so `diffusers.StableDiffusion3Pipeline.from_pretrained`
and `SD3Transformer2DModel.from_pretrained(out / "transformer")` load it."""

from __future__ import annotations

from pathlib import Path

from tree_grpo_jax.models import export
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.sd3 import mmdit
from tree_grpo_jax.models.sd3.load import _HUB_PATTERNS, POINT, transformer_shapes
from tree_grpo_jax.weights import files


def transformer_denoiser(config: dict) -> export.Denoiser:
    try:
        module = mmdit.transformer_module(config)
    except ValueError as e:
        raise ModelLoadError(f"the transformer config cannot be exported: {e}") from None
    return export.Denoiser(
        component="transformer",
        pt_class="SD3Transformer2DModel",
        config=config,
        reference=transformer_shapes(module, config),
    )


def base_denoiser(base_model_path: str) -> tuple[Path, export.Denoiser]:
    """The base folder and its transformer, checked (one sentence if unusable)."""
    base = files.resolve_folder(base_model_path, "model path", POINT, _HUB_PATTERNS)
    config_file = base / "transformer" / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"model folder {base} has no transformer/config.json to export against."
        )
    return base, transformer_denoiser(files.read_json(config_file, POINT))


def base_params(base_model_path: str) -> dict:
    """The base folder's transformer weights in float32 (a LoRA export with --merge adds to
    them)."""
    import jax.numpy as jnp

    from tree_grpo_jax.models.sd3.load import load_transformer

    root = files.resolve_folder(base_model_path, "model path", POINT, _HUB_PATTERNS)
    return load_transformer(root / "transformer", jnp.float32)[1]
