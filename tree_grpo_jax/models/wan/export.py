"""Trained Wan2.1 transformer params -> a diffusers Wan2.1 folder PyTorch loads:
`<out>/transformer/` (config, Flax msgpack, `diffusion_pytorch_model.safetensors` in
diffusers' names, the scanned blocks written one by one) beside copies of the base folder's
`vae/`, `text_encoder/`, `tokenizer/`, `scheduler/` and `model_index.json`, so
`diffusers.WanPipeline.from_pretrained(out)` and
`WanTransformer3DModel.from_pretrained(out / "transformer")` load it. A LoRA is written as
the PEFT keys (`transformer.blocks.0.attn1.to_q.lora_A.weight`, ...) that
`WanPipeline.load_lora_weights` reads, by `lora.export_lora`. The writing is
`models.components`' and `models.export`'s."""

from __future__ import annotations

from tree_grpo_jax.models.wan.load import TRANSFORMER

transformer_denoiser = TRANSFORMER.denoiser
base_denoiser = TRANSFORMER.base_denoiser
base_params = TRANSFORMER.base_params
