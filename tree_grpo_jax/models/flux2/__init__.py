"""FLUX.2 (dev and klein): the rectified-flow transformer of Black Forest Labs' second
generation, its VAE decoder and its prompt encoders.

transformer   `Flux2Transformer2DModel` in Flax with diffusers' parameter names, its 4-axis
              position ids, `transformer/config.json` reading, state-dict conversion both
              ways, and the released transformer configs (FLUX.2-dev, FLUX.2-klein 4B, 9B)
vae           `AutoencoderKLFlux2`'s decoder with the pipeline's batch-norm statistics and
              2x2 patch unpacking
text          the pipelines' prompt preparation: Mistral Small 3.1 (dev) and Qwen3 (klein)
              hidden states of three layers side by side, and their text position ids

Modules are imported by name (`from tree_grpo_jax.models.flux2 import transformer`), so that
importing the package reads nothing heavy.
"""
