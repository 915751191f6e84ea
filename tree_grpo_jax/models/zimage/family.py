"""The Z-Image family's record: `model.name = "zimage"` loads a diffusers Z-Image folder
(`ZImagePipeline`: Tongyi-MAI/Z-Image-Turbo)."""

from __future__ import annotations

from tree_grpo_jax.core.settings import Setting, defaults_of
from tree_grpo_jax.models import registry

TRANSFORMER_CLASS = "ZImageTransformer2DModel"
# The transformer's module lists (Flax `layers_3` is PyTorch `layers.3`), here so that
# finding the family imports no model code; `transformer.MODULE_LISTS` is this set.
MODULE_LISTS = frozenset(
    {
        "noise_refiner",
        "context_refiner",
        "layers",
        "to_out",
        "adaLN_modulation",
        "mlp",
        "cap_embedder",
    }
)
TEXT_MAX_LENGTH = 512  # ZImagePipeline's max_sequence_length


# `model.zimage`: the family's own settings.
SETTINGS = {
    "text_max_length": Setting(
        TEXT_MAX_LENGTH,
        "text tokens per prompt, chat template included (ZImagePipeline's 512)",
        low=1,
        note="ZImagePipeline's max_sequence_length",
    ),
    "resolution": registry.square_resolution_setting(multiple=16),
    "shift": registry.static_shift_setting(
        "> 0: a static sigma shift instead of the folder's (the release's static 3)"
    ),
}
options = defaults_of(SETTINGS)


# A folder whose `transformer/config.json` names ZImageTransformer2DModel.
recognizes = registry.component_class_is("transformer", (TRANSFORMER_CLASS,))

FAMILY = registry.register(
    registry.pipeline_family(
        "zimage",
        options,
        path_hint="a diffusers-layout Z-Image folder (or a hub id)",
        # The projections of every block's attention as diffusers' PEFT names them
        # (`attention.to_q`, `to_k`, `to_v`, `to_out.0`), matched as path endings.
        lora_targets=("to_q", "to_k", "to_v", "to_out_0"),
        recognizes=recognizes,
        list_names=MODULE_LISTS,
        sample_settings=("resolution",),  # what a "does not fit" sentence names beside the tree
    )
)
