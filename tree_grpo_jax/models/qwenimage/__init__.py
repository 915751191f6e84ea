"""Qwen-Image: Alibaba's text-to-image rectified-flow transformer (Qwen2.5-VL text, a Wan-style
video VAE used on single frames).

transformer   the Qwen-Image transformer (`QwenImageTransformer2DModel`) in Flax with PyTorch's
              numerics and diffusers' parameter names, and the pipeline's latent packing and
              rotary position ids
text          the Qwen2.5-VL prompt states as QwenImagePipeline encodes them, cached per
              prompt, padded with their mask into one conditioning array
load          the folder, the schedule (dynamic shift, terminal sigma), the denoiser, the
              one-frame VAE decode and `load_qwenimage` -> `QwenImageModel`
export        what Qwen-Image's denoiser is, for `models.export`
abstract      the model as shapes, for `python -m tree_grpo_jax.plan`
family        the family's record (`model.name="qwenimage"`, options in `model.qwenimage`)

Modules are imported by name (`from tree_grpo_jax.models.qwenimage.load import
load_qwenimage`), so that importing the package reads nothing heavy.
"""
