"""The FLUX.1 family's record: `model.name = "flux"` loads a diffusers FLUX.1-dev or
-schnell folder."""

from __future__ import annotations

import ml_collections

from tree_grpo_jax.models import registry

TRANSFORMER_CLASS = "FluxTransformer2DModel"


def options() -> ml_collections.ConfigDict:
    """`model.flux`: the family's own settings, with their defaults."""
    c = ml_collections.ConfigDict()
    c.guidance = 3.5  # the distilled guidance scale FLUX.1-dev embeds (schnell has none)
    c.t5_max_length = 0  # T5 tokens per prompt (0: 512 for dev, 256 for schnell)
    c.resolution = 0  # square image side in pixels (0: 1024); latents are 1/8 of it
    c.shift = 0.0  # > 0: a static sigma shift (the GRPO codes' 3) instead of the folder's
    return c


def check_options(o) -> str | None:
    if not o.guidance >= 0:
        return f"model.flux.guidance must be >= 0, got {o.guidance}."
    if not 0 <= o.t5_max_length <= 512:
        return (
            "model.flux.t5_max_length must be in [0, 512] (0: the release's), "
            f"got {o.t5_max_length}."
        )
    if o.resolution < 0:
        return f"model.flux.resolution must be >= 0 (0: 1024 px), got {o.resolution}."
    if not o.shift >= 0:
        return f"model.flux.shift must be >= 0 (0: the folder's schedule), got {o.shift}."
    return None


# A folder whose `transformer/config.json` names FluxTransformer2DModel.
recognizes = registry.component_class_is("transformer", (TRANSFORMER_CLASS,))

FAMILY = registry.register(
    registry.pipeline_family(
        "flux",
        options,
        path_hint="a diffusers-layout FLUX.1-dev or -schnell folder (or a hub id)",
        check_options=check_options,
        # DanceGRPO's FLUX LoRA targets (`to_k`, `to_q`, `to_v`, `to_out.0`), matched as
        # PEFT matches them: q/k/v of every block's attention, the joint blocks' image output.
        lora_targets=("to_q", "to_k", "to_v", "to_out_0"),
        recognizes=recognizes,
        sample_settings=("resolution",),  # what a "does not fit" sentence names beside the tree
    )
)
