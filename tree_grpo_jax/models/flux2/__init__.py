"""FLUX.2 (dev and klein): the rectified-flow transformer of Black Forest Labs' second
generation.

transformer   the FLUX.2 transformer (`Flux2Transformer2DModel`) in Flax with PyTorch's
              numerics and diffusers' parameter names, its 4-axis position ids, its
              `transformer/config.json` reading and state-dict conversion both ways, and the
              released transformer configs (FLUX.2-dev, FLUX.2-klein 4B and 9B)

Modules are imported by name (`from tree_grpo_jax.models.flux2 import transformer`), so that
importing the package reads nothing heavy.
"""
