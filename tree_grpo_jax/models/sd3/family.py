"""The SD3 family's record: `model.name = "sd3"` loads a diffusers SD3 / 3.5 folder."""

from __future__ import annotations

import ml_collections

from tree_grpo_jax.models import registry


def options() -> ml_collections.ConfigDict:
    """`model.sd3`: the family's own settings, with their defaults."""
    c = ml_collections.ConfigDict()
    c.use_t5 = True  # False leaves the 4.7B T5 unread (its tokens are zeros)
    c.t5_max_length = 256  # T5 tokens per prompt
    c.sample_size = 0  # latent side (0: the folder's; 64 -> 512 px)
    return c


def check_options(o) -> str | None:
    if not isinstance(o.use_t5, bool):
        return f"model.sd3.use_t5 must be True or False, got {o.use_t5!r}."
    if o.t5_max_length < 1:
        return "model.sd3.t5_max_length must be at least 1."
    if o.sample_size < 0:
        return f"model.sd3.sample_size must be >= 0 (0: the folder's), got {o.sample_size}."
    return None


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
        check_options=check_options,
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
