"""The Qwen-Image family's record: `model.name = "qwenimage"` loads a diffusers Qwen-Image
folder (`QwenImagePipeline`: Qwen/Qwen-Image)."""

from __future__ import annotations

from tree_grpo_jax.core.settings import Setting, defaults_of
from tree_grpo_jax.models import registry

TRANSFORMER_CLASS = "QwenImageTransformer2DModel"
# The transformer's module lists (Flax `transformer_blocks_3` is PyTorch
# `transformer_blocks.3`), here so that finding the family imports no model code;
# `transformer.MODULE_LISTS` is this set.
MODULE_LISTS = frozenset({"transformer_blocks", "img_mod", "txt_mod", "to_out", "net"})
# QwenImagePipeline's max_sequence_length: prompt states kept after the template's 34 dropped
# tokens (its tokenizer keeps up to 1024).
TEXT_MAX_LENGTH = 512
TEXT_MAX_KEPT = 1024


# `model.qwenimage`: the family's own settings.
SETTINGS = {
    "text_max_length": Setting(
        TEXT_MAX_LENGTH,
        "prompt states per prompt after the system template's 34 dropped tokens",
        low=1,
        high=TEXT_MAX_KEPT,
        note="QwenImagePipeline's max_sequence_length 512",
    ),
    "resolution": registry.square_resolution_setting(multiple=16),
    "shift": registry.static_shift_setting(
        "> 0: a static sigma shift instead of the folder's (the release's dynamic shift with "
        "its terminal sigma 0.02)"
    ),
}
options = defaults_of(SETTINGS)


# A folder whose `transformer/config.json` names QwenImageTransformer2DModel.
recognizes = registry.component_class_is("transformer", (TRANSFORMER_CLASS,))

FAMILY = registry.register(
    registry.pipeline_family(
        "qwenimage",
        options,
        path_hint="a diffusers-layout Qwen-Image folder (or a hub id)",
        # The image stream's attention projections as diffusers' PEFT names them
        # (`attn.to_q`, `to_k`, `to_v`, `to_out.0`), matched as path endings.
        lora_targets=("to_q", "to_k", "to_v", "to_out_0"),
        recognizes=recognizes,
        list_names=MODULE_LISTS,
        sample_settings=("resolution",),  # what a "does not fit" sentence names beside the tree
    )
)
