"""`input_similarity`: how close an output stays to the image its prompt started from (an
edit that should change little, a video's frames against its first image).

The score of an output is minus the mean squared difference of its pixels (in [0, 1]) and
its prompt's input image brought to the output's size: each channel resized with a box
filter in float32 (an average over the input pixels each output pixel covers, so no
rounding to uint8 on the way). A prompt with several input images scores the mean over
them. 0 is an identical image; -1 the furthest (black against white). A gray output
(C = 1) is compared with the input's mean over its channels. It runs on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image


def resized(image_u8: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] uint8 -> [height, width, C] float32 in [0, 1], box-filtered per channel."""
    channels = [
        np.asarray(
            Image.fromarray(image_u8[..., c].astype(np.float32), mode="F").resize(
                (width, height), Image.Resampling.BOX
            )
        )
        for c in range(image_u8.shape[-1])
    ]
    return np.stack(channels, axis=-1) / np.float32(255.0)


def input_similarity(images, prompts: Sequence[str], input_images) -> np.ndarray:
    """Minus the mean squared difference of each output [B, H, W, C] (floats in [0, 1]) and
    its prompt's input images (`input_images`: one list of [h, w, 3] uint8 per output), [B]."""
    del prompts  # the images alone are compared
    images = np.asarray(images, np.float32)
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"images must be [B, H, W, 1 or 3], got shape {images.shape}.")
    count, height, width, channels = images.shape
    scores = np.zeros(count, np.float32)
    for i in range(count):
        if not input_images[i]:
            raise ValueError(
                "reward 'input_similarity' compares each output with its prompt's input image, "
                "but a prompt names none; give every row of the prompt file an image."
            )
        errors = []
        for image in input_images[i]:
            target = resized(np.asarray(image, np.uint8), height, width)
            if channels == 1:
                target = target.mean(axis=-1, keepdims=True)
            errors.append(np.mean((images[i] - target) ** 2))
        scores[i] = -np.mean(errors)
    return scores
