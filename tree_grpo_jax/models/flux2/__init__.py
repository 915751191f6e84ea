"""FLUX.2 (dev and klein): the rectified-flow transformer of Black Forest Labs' second
generation, its VAE decoder and its prompt encoders.

transformer   `Flux2Transformer2DModel` in Flax with diffusers' parameter names, its 4-axis
              position ids, `transformer/config.json` reading, state-dict conversion both
              ways, and the released transformer configs (FLUX.2-dev, FLUX.2-klein 4B, 9B)
vae           `AutoencoderKLFlux2`'s decoder with the pipeline's batch-norm statistics and
              2x2 patch unpacking, and its encoder for reference images
text          the pipelines' prompt preparation: Mistral Small 3.1 (dev) and Qwen3 (klein)
              hidden states of three layers side by side, and their text position ids
load          the folder (dev or klein, told apart by the text encoder), the schedule with
              the pipelines' empirical mu, the denoiser on [B, 128, h, w] patch latents,
              the cached prompt states, the VAE decode, reference images (editing) and
              `load_flux2` -> `Flux2Model`
export        what FLUX.2's denoiser is, for `models.export`
abstract      the model as shapes, for `python -m tree_grpo_jax.plan`
builtin       the releases' JSON configs (`builtin:flux2-dev`, `-klein-4b`, `-klein-9b`)
family        the family's record (`model.name="flux2"`, options in `model.flux2`)

Modules are imported by name (`from tree_grpo_jax.models.flux2 import transformer`), so that
importing the package reads nothing heavy.
"""
