"""The FLUX.2 family's record: `model.name = "flux2"` loads a diffusers FLUX.2 folder, dev
(`Flux2Pipeline`: black-forest-labs/FLUX.2-dev, a Mistral 3 text encoder) or klein
(`Flux2KleinPipeline`: black-forest-labs/FLUX.2-klein-4B and -9B, Qwen3)."""

from __future__ import annotations

from tree_grpo_jax.core.settings import Setting, defaults_of
from tree_grpo_jax.models import registry

TRANSFORMER_CLASS = "Flux2Transformer2DModel"
# The transformer's module lists (Flax `transformer_blocks_3` is PyTorch
# `transformer_blocks.3`), here so that finding the family imports no model code;
# `transformer.MODULE_LISTS` is this set.
MODULE_LISTS = frozenset({"transformer_blocks", "single_transformer_blocks", "to_out"})
TEXT_MAX_LENGTH = 512  # both pipelines' max_sequence_length
DEV_GUIDANCE = 4.0  # Flux2Pipeline's default guidance_scale, which dev embeds


# `model.flux2`: the family's own settings.
SETTINGS = {
    "text_max_length": Setting(
        TEXT_MAX_LENGTH,
        "text tokens per prompt, chat template included; every one is attended to, padding "
        "included, as both pipelines do",
        low=1,
        note="Flux2Pipeline's and Flux2KleinPipeline's max_sequence_length",
    ),
    "guidance": Setting(
        DEV_GUIDANCE,
        "the distilled guidance scale FLUX.2-dev embeds (klein has no guidance embedding)",
        low=0,
        note="Flux2Pipeline's default guidance_scale",
    ),
    "resolution": registry.square_resolution_setting(multiple=16),
    "reference_images": Setting(
        0,
        "input images each prompt edits from, as the pipelines' image= references (0: "
        "text-to-image); every prompt names exactly this many",
        low=0,
        note="0: no input images",
    ),
    "reference_resolution": Setting(
        0,
        "the side in pixels of every input image (square, a multiple of 16, at most 1024)",
        low=0,
        high=1024,
        note="0: the resolution",
    ),
    "shift": registry.static_shift_setting(
        "> 0: a static sigma shift instead of the pipelines' empirical mu (from the image's "
        "tokens and the step count)"
    ),
}
options = defaults_of(SETTINGS)


# A folder whose `transformer/config.json` names Flux2Transformer2DModel.
recognizes = registry.component_class_is("transformer", (TRANSFORMER_CLASS,))

FAMILY = registry.register(
    registry.pipeline_family(
        "flux2",
        options,
        path_hint="a diffusers-layout FLUX.2-dev or FLUX.2-klein folder (or a hub id)",
        # The attention projections as diffusers' PEFT names them, matched as path endings:
        # the double-stream blocks' `attn.to_q`, `to_k`, `to_v`, `to_out.0` (and the text
        # stream's `add_*` are left out), the single-stream blocks' fused
        # `attn.to_qkv_mlp_proj` and their output `attn.to_out`.
        lora_targets=("to_q", "to_k", "to_v", "to_out_0", "to_qkv_mlp_proj", "attn/to_out"),
        recognizes=recognizes,
        list_names=MODULE_LISTS,
        sample_settings=("resolution",),  # what a "does not fit" sentence names beside the tree
    )
)
