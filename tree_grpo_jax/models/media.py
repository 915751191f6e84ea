"""What a model's `decode` gives: images or videos, and how to tell them apart.

A model says its media in its `media` field; every other part of the library (the rewards,
the build's checks, the pictures a run writes) reads the rank of decoded arrays from it:

    "image"    decode -> [B, H, W, C] in [0, 1]
    "video"    decode -> [B, T, H, W, C] in [0, 1] (T frames)
    "latents"  decode returns no pixels (the accelerator benchmark's stand-ins, which time
               the denoiser alone): nothing is scored or pictured

C is 1 (grey) or 3 (RGB). This module imports nothing, so rewards and the run read it.
"""

from __future__ import annotations

IMAGE = "image"
VIDEO = "video"
LATENTS = "latents"
RANKS = {IMAGE: 4, VIDEO: 5}  # the rank of a decoded batch of each media
LAYOUTS = {IMAGE: "[B, H, W, C]", VIDEO: "[B, T, H, W, C]"}
MEDIA = (*RANKS, LATENTS)
CHANNELS = (1, 3)


def check_media(media: str, who: str) -> None:
    """ValueError with one sentence when `media` is not one the library knows."""
    if media not in MEDIA:
        raise ValueError(f"{who} has media {media!r}; it must be one of {', '.join(MEDIA)}.")


def of_rank(ndim: int) -> str | None:
    """The media of a decoded batch of that rank (4: image, 5: video), None for another."""
    return next((m for m, r in RANKS.items() if r == ndim), None)


def shape_problem(media: str, shape: tuple[int, ...]) -> str | None:
    """What is wrong with a decoded batch of `shape` for `media`, as the end of a sentence
    ("gives ..."), or None when it fits."""
    if media == LATENTS:
        return None
    shape = tuple(shape)
    if len(shape) != RANKS[media] or shape[-1] not in CHANNELS:
        return f"gives {media}s of shape {shape}; {media}s are {LAYOUTS[media]} with C = 1 or 3"
    return None
