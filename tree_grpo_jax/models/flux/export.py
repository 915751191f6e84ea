"""Trained FLUX transformer params -> a diffusers FLUX.1 folder PyTorch loads:
`<out>/transformer/` (config, Flax msgpack, `diffusion_pytorch_model.safetensors`) beside
the base folder's other components, so `diffusers.FluxPipeline.from_pretrained` and
`FluxTransformer2DModel.from_pretrained(out / "transformer")` load it."""

from __future__ import annotations

from pathlib import Path

from tree_grpo_jax.models import export
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.flux import transformer
from tree_grpo_jax.models.flux.load import HUB_PATTERNS, POINT, abstract_params
from tree_grpo_jax.weights import convert, files


def transformer_denoiser(config: dict) -> export.Denoiser:
    try:
        module = transformer.transformer_module(config)
    except ValueError as e:
        raise ModelLoadError(f"the transformer config cannot be exported: {e}") from None
    return export.Denoiser(
        component="transformer",
        pt_class="FluxTransformer2DModel",
        config=config,
        reference=convert.shapes_of(abstract_params(module)),
        list_names=transformer.MODULE_LISTS,
    )


def base_denoiser(base_model_path: str) -> tuple[Path, export.Denoiser]:
    """The base folder and its transformer, checked (one sentence if unusable)."""
    base = files.resolve_folder(base_model_path, "model path", POINT, HUB_PATTERNS)
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

    from tree_grpo_jax.models.flux.load import load_transformer

    root = files.resolve_folder(base_model_path, "model path", POINT, HUB_PATTERNS)
    return load_transformer(root / "transformer", jnp.float32)[1]
