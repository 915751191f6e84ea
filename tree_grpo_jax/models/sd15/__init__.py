"""Stable Diffusion 1.x: a diffusers-layout folder behind the `TextToImageModel` interface.

unet      the UNet in Flax with PyTorch's numerics, diffusers' parameter tree
load      the folder, its components and `load_sd` -> `StableDiffusionModel`
export    trained UNet params -> a diffusers folder PyTorch loads
builtin   SD1.5's JSON configs, for planning without its files
abstract  the model as shapes, for `python -m tree_grpo_jax.plan`
family    the family's record (`model.name="sd"`)

Modules are imported by name (`from tree_grpo_jax.models.sd15.load import load_sd`), so that
importing the package (as finding the families does) reads nothing heavy.
"""
