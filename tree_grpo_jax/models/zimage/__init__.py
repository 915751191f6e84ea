"""Z-Image (Tongyi-MAI): a single-stream diffusion transformer over image and caption tokens.

transformer   the denoiser (`ZImageTransformer2DModel`) in Flax with PyTorch's numerics and
              diffusers' parameter names: patching, the padded caption batch, the 3-axis
              RoPE positions, and the state dict conversion both ways

Modules are imported by name (`from tree_grpo_jax.models.zimage import transformer`), so that
importing the package reads nothing heavy.
"""
