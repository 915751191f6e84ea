"""Z-Image (Tongyi-MAI): a single-stream diffusion transformer over image and caption tokens.

transformer   the denoiser (`ZImageTransformer2DModel`) in Flax with PyTorch's numerics and
              diffusers' parameter names: patching, the padded caption batch, the 3-axis
              RoPE positions, and the state dict conversion both ways
text          the Qwen3 text encoder's prompt embeddings as ZImagePipeline encodes them,
              cached per prompt, padded with their mask into one conditioning array
load          the folder, the schedule (static or dynamic shift), the denoiser and
              `load_zimage` -> `ZImageModel`
export        what Z-Image's denoiser is, for `models.export`
abstract      the model as shapes, for `python -m tree_grpo_jax.plan`
family        the family's record (`model.name="zimage"`, options in `model.zimage`)

Modules are imported by name (`from tree_grpo_jax.models.zimage.load import load_zimage`), so that
importing the package reads nothing heavy.
"""
