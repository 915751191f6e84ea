"""The SD1.x family's record: `model.name = "sd"` loads a diffusers Stable Diffusion 1.x
folder."""

from __future__ import annotations

from pathlib import Path

from tree_grpo_jax.models import registry


def _load(request: registry.LoadRequest):
    from tree_grpo_jax.models.sd15.load import load_sd

    return load_sd(request.path, dtype=request.dtype)


def _abstract(request: registry.LoadRequest):
    from tree_grpo_jax.models.sd15.abstract import abstract_sd

    return abstract_sd(request.path, dtype=request.dtype)


def _base_denoiser(path: str):
    from tree_grpo_jax.models.sd15.export import base_denoiser

    return base_denoiser(path)


def _base_params(path: str) -> dict:
    from tree_grpo_jax.models.sd15.export import base_params

    return base_params(path)


def _recognizes(folder: Path) -> bool:
    folder = Path(folder)
    return (folder / "unet").is_dir() and not (folder / "transformer").is_dir()


FAMILY = registry.register(
    registry.ModelFamily(
        name="sd",
        model_names=("sd",),
        load=_load,
        needs_path=True,
        path_hint="a diffusers-layout Stable Diffusion folder (or a hub id)",
        # the q/k/v/out projections of every self- and cross-attention, as diffusers' SD
        # LoRA scripts target (`to_q`, `to_k`, `to_v`, `to_out.0`)
        lora_targets=("to_q", "to_k", "to_v", "to_out_0"),
        recognizes=_recognizes,
        export=registry.FamilyExport("unet", _base_denoiser, _base_params),
        abstract=_abstract,
    )
)
