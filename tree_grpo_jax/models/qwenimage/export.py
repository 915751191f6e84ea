"""Trained Qwen-Image transformer params -> a diffusers Qwen-Image folder PyTorch loads:
`<out>/transformer/` (config, Flax msgpack, `diffusion_pytorch_model.safetensors`) beside
the base folder's other components, so `diffusers.QwenImagePipeline.from_pretrained` and
`QwenImageTransformer2DModel.from_pretrained(out / "transformer")` load it. The writing is
`models.components`'."""

from __future__ import annotations

from tree_grpo_jax.models.qwenimage.load import TRANSFORMER

transformer_denoiser = TRANSFORMER.denoiser
base_denoiser = TRANSFORMER.base_denoiser
base_params = TRANSFORMER.base_params
