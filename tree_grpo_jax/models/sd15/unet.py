"""Stable Diffusion 1.x's UNet: the package's `models.unet.UNet2DConditionModel` with its
default numerics, PyTorch's (exact-GELU GEGLU, transformer GroupNorm eps 1e-6), which SD was
trained with. The family's modules and callers reach the UNet through this module."""

from __future__ import annotations

from tree_grpo_jax.models.unet import (
    DOWN_BLOCKS,
    MID_BLOCKS,
    SAVED,
    TRANSFORMER_NORM_EPS,
    UP_BLOCKS,
    CrossAttnDownBlock2D,
    CrossAttnUpBlock2D,
    UNet2DConditionModel,
    UNetMidBlock2DCrossAttn,
    UNetOutput,
    unet_module,
)
from tree_grpo_jax.models.unet_layers import (
    GEGLU,
    BasicTransformerBlock,
    FeedForward,
    Transformer2D,
)

__all__ = [
    "DOWN_BLOCKS",
    "GEGLU",
    "MID_BLOCKS",
    "SAVED",
    "TRANSFORMER_NORM_EPS",
    "UP_BLOCKS",
    "BasicTransformerBlock",
    "CrossAttnDownBlock2D",
    "CrossAttnUpBlock2D",
    "FeedForward",
    "Transformer2D",
    "UNet2DConditionModel",
    "UNetMidBlock2DCrossAttn",
    "UNetOutput",
    "unet_module",
]
