"""Stable Diffusion 3 / 3.5: a diffusers-layout folder behind the `TextToImageModel` interface.

mmdit     the MMDiT (`SD3Transformer2DModel`) in Flax with PyTorch's numerics and diffusers'
          parameter names
text      CLIP-L, CLIP-G and T5-XXL, joined as the SD3 pipeline joins them, prompts cached
load      the folder, the flow-matching schedule and `load_sd3` -> `StableDiffusion3Model`
export    what SD3's denoiser is, for `models.export`

Modules are imported by name (`from tree_grpo_jax.models.sd3.load import load_sd3`), so that
importing the package reads nothing heavy.
"""
