"""Qwen-Image: Alibaba's text-to-image rectified-flow transformer (Qwen2.5-VL text, a Wan-style
video VAE used on single frames).

transformer   the Qwen-Image transformer (`QwenImageTransformer2DModel`) in Flax with PyTorch's
              numerics and diffusers' parameter names, and the pipeline's latent packing and
              rotary position ids

Modules are imported by name (`from tree_grpo_jax.models.qwenimage import transformer`), so
that importing the package reads nothing heavy.
"""
