"""The SD3 family's record: `model.name = "sd3"` loads a diffusers SD3 / 3.5 folder."""

from __future__ import annotations

from tree_grpo_jax.core.settings import Setting, defaults_of
from tree_grpo_jax.models import registry

# `model.sd3`: the family's own settings.
SETTINGS = {
    "use_t5": Setting(True, "False leaves the 4.7B T5 unread (its tokens are zeros)"),
    "t5_max_length": Setting(256, "T5 tokens per prompt", low=1),
    "sample_size": Setting(
        0, "latent side (0: the folder's; 64 -> 512 px)", low=0, note="0: the folder's"
    ),
}
options = defaults_of(SETTINGS)


# A `transformer/` whose config names no class but SD3's (other transformer families share the
# layout); an unreadable config is left to the export's own checks to describe.
recognizes = registry.component_class_is(
    "transformer", (None, "SD3Transformer2DModel"), unreadable=True
)

FAMILY = registry.register(
    registry.pipeline_family(
        "sd3",
        options,
        path_hint="a diffusers-layout Stable Diffusion 3 / 3.5 folder (or a hub id)",
        moved_fields={
            "model.use_t5": "model.sd3.use_t5",
            "model.t5_max_length": "model.sd3.t5_max_length",
            "model.sample_size": "model.sd3.sample_size",
        },
        # Flow-GRPO's targets, matched as path endings (as PEFT matches them): the image and
        # context projections of every joint block's `attn`, not SD3.5's `attn2` layers.
        lora_targets=(
            "attn/to_q",
            "attn/to_k",
            "attn/to_v",
            "attn/to_out_0",
            "attn/add_q_proj",
            "attn/add_k_proj",
            "attn/add_v_proj",
            "attn/to_add_out",
        ),
        recognizes=recognizes,
        sample_settings=("sample_size",),  # what a "does not fit" sentence names beside the tree
    )
)
