"""DDPO's JPEG rewards: the size of the image saved as a quality-95 JPEG, in kB.

Compressibility rewards small files (flat, smooth images), incompressibility large ones
(busy, detailed images). They run on the host: PIL does the encoding.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from PIL import Image

QUALITY = 95


def to_uint8(images) -> np.ndarray:
    """`[B, H, W, 1 or 3]` floats in [0, 1] -> uint8, rounded as DDPO does."""
    images = np.asarray(images, np.float32)
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"images must be [B, H, W, 1 or 3], got shape {images.shape}.")
    return np.clip(np.round(images * 255.0), 0, 255).astype(np.uint8)


def jpeg_size_kb(images, quality: int = QUALITY) -> np.ndarray:
    """The JPEG file size of each image in kB (1000 bytes), `[B]` float32."""
    sizes = []
    for image in to_uint8(images):
        pil = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
        buffer = io.BytesIO()
        pil.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return np.asarray(sizes, np.float32)


def jpeg_compressibility(images, prompts: Sequence[str]) -> np.ndarray:
    del prompts  # the reward ignores the prompt
    return -jpeg_size_kb(images)


def jpeg_incompressibility(images, prompts: Sequence[str]) -> np.ndarray:
    del prompts
    return jpeg_size_kb(images)
