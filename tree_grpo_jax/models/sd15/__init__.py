"""Stable Diffusion 1.x: a diffusers-layout folder behind the `TextToImageModel` interface.

unet      the UNet in Flax with PyTorch's numerics, diffusers' parameter tree
load      the folder, its components and `load_sd` -> `StableDiffusionModel`
export    trained UNet params -> a diffusers folder PyTorch loads
"""

from tree_grpo_jax.models.sd15.load import StableDiffusionModel, load_sd, resolve_model_path
from tree_grpo_jax.models.sd15.unet import UNet2DConditionModel, unet_module

__all__ = [
    "StableDiffusionModel",
    "UNet2DConditionModel",
    "load_sd",
    "resolve_model_path",
    "unet_module",
]
