"""The SD1.x family's record: `model.name = "sd"` loads a diffusers Stable Diffusion 1.x
folder."""

from __future__ import annotations

from pathlib import Path

from tree_grpo_jax.models import registry


def _recognizes(folder: Path) -> bool:
    folder = Path(folder)
    return (folder / "unet").is_dir() and not (folder / "transformer").is_dir()


FAMILY = registry.register(
    registry.ModelFamily(
        name="sd",
        model_names=("sd",),
        load=registry.path_loader("tree_grpo_jax.models.sd15.load:load_sd", remat=True),
        needs_path=True,
        path_hint="a diffusers-layout Stable Diffusion folder (or a hub id)",
        # the q/k/v/out projections of every self- and cross-attention, as diffusers' SD
        # LoRA scripts target (`to_q`, `to_k`, `to_v`, `to_out.0`)
        lora_targets=("to_q", "to_k", "to_v", "to_out_0"),
        recognizes=_recognizes,
        export=registry.deferred_export("unet", "tree_grpo_jax.models.sd15.export"),
        abstract=registry.path_loader("tree_grpo_jax.models.sd15.abstract:abstract_sd", remat=True),
    )
)
