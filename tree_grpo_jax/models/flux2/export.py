"""Trained FLUX.2 transformer params -> a diffusers FLUX.2 folder PyTorch loads:
`<out>/transformer/` (config, Flax msgpack, `diffusion_pytorch_model.safetensors`) beside
the base folder's other components, so `diffusers.Flux2Pipeline` (or `Flux2KleinPipeline`)
`.from_pretrained` and `Flux2Transformer2DModel.from_pretrained(out / "transformer")` load
it. The writing is `models.components`'."""

from __future__ import annotations

from tree_grpo_jax.models.flux2.load import TRANSFORMER

transformer_denoiser = TRANSFORMER.denoiser
base_denoiser = TRANSFORMER.base_denoiser
base_params = TRANSFORMER.base_params
