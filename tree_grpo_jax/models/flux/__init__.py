"""FLUX.1 (dev and schnell): the rectified-flow transformer of Black Forest Labs.

transformer   the FLUX transformer (`FluxTransformer2DModel`) in Flax with PyTorch's numerics
              and diffusers' parameter names, and the pipeline's latent packing and position ids

Modules are imported by name (`from tree_grpo_jax.models.flux import transformer`), so that
importing the package reads nothing heavy.
"""
