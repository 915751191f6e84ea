"""Wan2.1 and Wan2.2 text-to-video (diffusers' `WanPipeline` layout: Wan-AI/Wan2.1-T2V-1.3B-
Diffusers, -14B-Diffusers, Wan-AI/Wan2.2-TI2V-5B-Diffusers with Wan2.2's VAE, and
Wan-AI/Wan2.2-T2V-A14B-Diffusers with two experts switching at `boundary_ratio`) in Flax.

transformer   `WanTransformer3DModel` in Flax with diffusers' parameter names: 3D patches,
              rotary embeddings over frames, rows and columns, blocks scanned
transformer_weights  its weights at the diffusers boundary, both ways
text          umT5-XXL's encoder (`UMT5EncoderModel`), as WanPipeline encodes prompts
load          the folder, the schedule (the scheduler's flow_shift, or a static one), the
              denoiser and `load_wan` -> `WanModel` (media "video"); the VAE decoder
              (`AutoencoderKLWan`: latents [B, F, h, w, 16] -> videos
              [B, 1 + 4 (F - 1), 8h, 8w, 3] in [0, 1]) is `models.causal_vae`, shared with
              Qwen-Image
export        what Wan's denoiser is, for `models.export` (full folders and PEFT LoRAs)
builtin       the Wan2.1 and Wan2.2 releases' JSON configs, for planning without their files
abstract      the model as shapes, for `python -m tree_grpo_jax.plan`
family        the family's record (`model.name="wan"`, options in `model.wan`)

Modules are imported by name (`from tree_grpo_jax.models.wan.load import load_wan`), so that
importing the package reads nothing heavy.
"""
