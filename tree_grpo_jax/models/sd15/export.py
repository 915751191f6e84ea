"""Trained UNet params -> a diffusers Stable Diffusion 1.x folder PyTorch loads.

`export_unet` writes `<out>/unet/` (config, Flax msgpack, PyTorch safetensors);
`export_pipeline` copies the base folder's other components beside it, so that
`diffusers.StableDiffusionPipeline.from_pretrained(out)` and
`UNet2DConditionModel.from_pretrained(out / "unet")` load it. The writing is
`models.export`'s; this module says what SD1.x's denoiser is.
"""

from __future__ import annotations

from pathlib import Path

from tree_grpo_jax.models import export
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.sd15.load import (
    check_unet_config,
    read_json,
    resolve_model_path,
    unet_reference_shapes,
)
from tree_grpo_jax.models.sd15.unet import unet_module


def unet_denoiser(unet_config: dict) -> export.Denoiser:
    return export.Denoiser(
        component="unet",
        pt_class="UNet2DConditionModel",
        config=unet_config,
        reference=unet_reference_shapes(unet_module(unet_config)),
    )


def base_denoiser(base_model_path: str) -> tuple[Path, export.Denoiser]:
    """The base folder and its UNet, checked (one sentence if unusable)."""
    base = resolve_model_path(base_model_path)
    unet_config_file = base / "unet" / "config.json"
    if not unet_config_file.is_file():
        raise ModelLoadError(f"model folder {base} has no unet/config.json to export against.")
    unet_config = read_json(unet_config_file)
    check_unet_config(unet_config, unet_config_file)
    return base, unet_denoiser(unet_config)


def export_unet(params, unet_config: dict, out_dir, dtype: str = "float32") -> Path:
    """Writes `out_dir/unet/`; params not matching `unet_config` raise ValueError first."""
    return export.export_denoiser(params, unet_denoiser(unet_config), out_dir, dtype)


def export_pipeline(
    params, base_model_path: str, out_dir, dtype="float32", overwrite=False, sources=()
) -> Path:
    """A whole SD1.x pipeline folder with the UNet replaced (see `models.export`)."""
    base, denoiser = base_denoiser(base_model_path)
    return export.export_pipeline(params, base, denoiser, out_dir, dtype, overwrite, sources)


def base_params(base_model_path: str) -> dict:
    """The base folder's UNet weights in float32 (a LoRA export with --merge adds to them)."""
    import jax.numpy as jnp

    from tree_grpo_jax.models.sd15.load import load_unet

    return load_unet(resolve_model_path(base_model_path) / "unet", jnp.float32)[1]
