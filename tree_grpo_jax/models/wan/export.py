"""Trained Wan transformer params -> a diffusers Wan folder PyTorch loads:
`<out>/transformer/` (config, Flax msgpack, `diffusion_pytorch_model.safetensors` in
diffusers' names, the scanned blocks written one by one) beside copies of the base folder's
`vae/`, `text_encoder/`, `tokenizer/`, `scheduler/` and `model_index.json`, so
`diffusers.WanPipeline.from_pretrained(out)` and
`WanTransformer3DModel.from_pretrained(out / "transformer")` load it. A two-expert folder
(Wan2.2-T2V-A14B: `boundary_ratio` in its model index) gets both, `transformer/` and
`transformer_2/`, from params `{"transformer": ..., "transformer_2": ...}`. A LoRA is written
as the PEFT keys (`transformer.blocks.0.attn1.to_q.lora_A.weight`, ...) that
`WanPipeline.load_lora_weights` reads, by `lora.export_lora` (one expert's only). The writing
is `models.components`' and `models.export`'s."""

from __future__ import annotations

import dataclasses

from tree_grpo_jax.models.wan.load import EXPERTS, POINT, TRANSFORMER, boundary_of
from tree_grpo_jax.weights import files

transformer_denoiser = TRANSFORMER.denoiser
LOW_NOISE = dataclasses.replace(TRANSFORMER, folder=EXPERTS[1])


def _experts(base) -> bool:
    index = base / "model_index.json"
    return (
        boundary_of(files.read_json(index, POINT) if index.is_file() else None, index) is not None
    )


def base_denoiser(base_model_path: str):
    """The base folder and what its trained params are written as: the transformer's
    `Denoiser`, or the two experts' for a folder with a `boundary_ratio`."""
    base, high = TRANSFORMER.base_denoiser(base_model_path)
    if not _experts(base):
        return base, high
    _, low = LOW_NOISE.base_denoiser(base_model_path)
    return base, (high, low)


def base_params(base_model_path: str) -> dict:
    """The base folder's transformer weights in float32 (both experts' where it has two)."""
    base = TRANSFORMER.resolve(base_model_path)
    if not _experts(base):
        return TRANSFORMER.base_params(base_model_path)
    return {
        EXPERTS[0]: TRANSFORMER.base_params(base_model_path),
        EXPERTS[1]: LOW_NOISE.base_params(base_model_path),
    }
