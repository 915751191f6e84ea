"""A toy video family for the tests, registered from outside the package: the tiny digits
model with random weights whose `decode` turns each 8x8 image into FRAMES frames, frame t
the image shifted t pixels to the right (wrapping round). Its samples then move by a known
amount from frame to frame, every image reward scores them frame by frame, and a run,
`evaluate` and `sample` go through the video paths in seconds.

    with toy_video_family():
        ... config.model.name = MODEL ...
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp

from tree_grpo_jax.models import registry as model_registry

FAMILY = "toy_video"
MODEL = "toy_video_digits"
FRAMES = 3


def shifted_frames(images, frames: int = FRAMES):
    """Images [B, H, W, C] -> videos [B, T, H, W, C]: frame t is the image rolled t pixels
    along its width."""
    return jnp.stack([jnp.roll(images, t, axis=2) for t in range(frames)], axis=1)


def load_toy_video(request: model_registry.LoadRequest):
    from tree_grpo_jax.models.tiny.model import build_tiny

    model = build_tiny("ddim", seed=request.seed, dtype=request.dtype)
    decode = model.decode

    def decode_video(x):
        return shifted_frames(decode(x))

    return dataclasses.replace(model, name=MODEL, decode=decode_video, media="video")


@contextlib.contextmanager
def toy_video_family():
    """The family registered for the `with` block (the tiny family's digit prompts and
    rewards, and its classifier's features for the diversity and temporal figures)."""
    model_registry.register(
        model_registry.ModelFamily(
            name=FAMILY,
            model_names=(MODEL,),
            load=load_toy_video,
            lora_targets=("to_q", "to_k", "to_v", "to_out_0"),
            image_features=model_registry.deferred(
                "tree_grpo_jax.models.tiny.classifier:digit_features"
            ),
        )
    )
    try:
        yield
    finally:
        model_registry.unregister(FAMILY)
