"""FLUX.1 (dev, schnell and Kontext): the rectified-flow transformer of Black Forest Labs.

transformer   the FLUX transformer (`FluxTransformer2DModel`) in Flax with PyTorch's numerics
              and diffusers' parameter names, and the pipeline's latent packing and position ids
text          CLIP-L's pooled output and T5-XXL's hidden states, as FluxPipeline encodes
              prompts, cached per prompt
load          the folder, the schedule (dynamic or static shift), the denoiser and
              `load_flux` -> `FluxModel`
edit          FLUX.1-Kontext's input image as the pipeline's reference tokens and ids
export        what FLUX's denoiser is, for `models.export`
builtin       FLUX.1-dev's and -schnell's JSON configs, for planning without their files
abstract      the model as shapes, for `python -m tree_grpo_jax.plan`
family        the family's record (`model.name="flux"`, options in `model.flux`)

Modules are imported by name (`from tree_grpo_jax.models.flux.load import load_flux`), so that
importing the package reads nothing heavy.
"""
