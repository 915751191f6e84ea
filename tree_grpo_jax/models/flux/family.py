"""The FLUX.1 family's record: `model.name = "flux"` loads a diffusers FLUX.1-dev, -schnell
or -Kontext-dev folder (Kontext edits with `reference_images = 1`)."""

from __future__ import annotations

from tree_grpo_jax.core.settings import Setting, defaults_of
from tree_grpo_jax.models import registry

TRANSFORMER_CLASS = "FluxTransformer2DModel"


# `model.flux`: the family's own settings.
SETTINGS = {
    "guidance": Setting(
        3.5, "the distilled guidance scale FLUX.1-dev embeds (schnell has none)", low=0
    ),
    "t5_max_length": Setting(
        0,
        "T5 tokens per prompt (0: 512 for dev, 256 for schnell)",
        low=0,
        high=512,
        note="0: the release's",
    ),
    "resolution": registry.square_resolution_setting(),  # rounded down as FluxPipeline does
    "reference_images": Setting(
        0,
        "input images each prompt edits from, as FluxKontextPipeline's image= reference "
        "(FLUX.1-Kontext; 0: text-to-image); every prompt names exactly this many",
        low=0,
        high=1,
        note="0: no input images; the pipeline takes one",
    ),
    "reference_resolution": Setting(
        0,
        "the side in pixels of every input image (square, a multiple of 16)",
        low=0,
        high=2048,
        note="0: the resolution",
    ),
    "shift": registry.static_shift_setting(
        "> 0: a static sigma shift (the GRPO codes' 3) instead of the folder's"
    ),
}
options = defaults_of(SETTINGS)


# A folder whose `transformer/config.json` names FluxTransformer2DModel.
recognizes = registry.component_class_is("transformer", (TRANSFORMER_CLASS,))

FAMILY = registry.register(
    registry.pipeline_family(
        "flux",
        options,
        path_hint="a diffusers-layout FLUX.1-dev, -schnell or -Kontext folder (or a hub id)",
        # DanceGRPO's FLUX LoRA targets (`to_k`, `to_q`, `to_v`, `to_out.0`), matched as
        # PEFT matches them: q/k/v of every block's attention, the joint blocks' image output.
        lora_targets=("to_q", "to_k", "to_v", "to_out_0"),
        recognizes=recognizes,
        sample_settings=("resolution",),  # what a "does not fit" sentence names beside the tree
    )
)
