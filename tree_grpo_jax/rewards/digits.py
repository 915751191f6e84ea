"""Digit rewards for the tiny model: a small CNN classifier scores the prompted digit.

The classifier is trained by `python -m tree_grpo_jax.models.train_tiny --kind=classifier`
on the training split of `load_digits` and ships in `tree_grpo_jax/assets/`. Everything here
is JAX-native: the rewards run on the accelerator next to the rollout.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence

import chex
import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models import tiny

NUM_CLASSES = 10
IMAGE_SIZE = 8
CLASSIFIER_PATH = tiny.ASSETS_DIR / "digit_classifier.msgpack"


class DigitClassifier(nn.Module):
    """Two 3x3 convolutions, a 2x2 average pool and two dense layers: 8x8x1 -> 10 logits."""

    features: tuple[int, ...] = (32, 64)
    hidden: int = 128

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        x = images
        for width in self.features:
            x = nn.relu(nn.Conv(width, (3, 3), padding="SAME")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(NUM_CLASSES)(x)


def to_classifier_input(images: jax.Array) -> jax.Array:
    """Any `[B, H, W, 1 or 3]` image in [0, 1] -> `[B, 8, 8, 1]`: grey, resized, clipped."""
    chex.assert_rank(images, 4)
    images = jnp.clip(images.astype(jnp.float32), 0.0, 1.0)
    channels = images.shape[-1]
    if channels not in (1, 3):
        raise ValueError(f"images need 1 or 3 channels, got {channels}.")
    if channels == 3:
        images = jnp.mean(images, axis=-1, keepdims=True)
    size = (images.shape[0], IMAGE_SIZE, IMAGE_SIZE, 1)
    if images.shape != size:
        images = jax.image.resize(images, size, method="linear", antialias=True)
    return images


def classifier_log_probs(params, images: jax.Array) -> jax.Array:
    """`[B, H, W, C]` images in [0, 1] -> `[B, 10]` log-probabilities."""
    logits = DigitClassifier().apply({"params": params}, to_classifier_input(images))
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def save_classifier(path, params) -> None:
    payload = {"format_version": 1, "params": jax.tree.map(np.asarray, params)}
    pathlib.Path(path).write_bytes(flax.serialization.msgpack_serialize(payload))


def load_classifier(path=None):
    """The classifier's params from `path` (default: the shipped weights)."""
    path = pathlib.Path(path) if path is not None else CLASSIFIER_PATH
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; run `python -m tree_grpo_jax.models.train_tiny --kind=classifier`."
        )
    payload = flax.serialization.msgpack_restore(path.read_bytes())
    expected = jax.eval_shape(
        DigitClassifier().init, jax.random.key(0), jnp.zeros((1, IMAGE_SIZE, IMAGE_SIZE, 1))
    )["params"]
    params = payload.get("params")
    shapes = lambda tree: jax.tree.map(lambda a: tuple(a.shape), tree)
    if params is None or shapes(params) != shapes(expected):
        raise ValueError(f"{path} does not hold digit classifier weights of this architecture.")
    return jax.tree.map(jnp.asarray, params)


@functools.cache
def _shipped_classifier():
    return load_classifier(), jax.jit(classifier_log_probs)


def digit_log_probs(images: jax.Array) -> jax.Array:
    """Log-probabilities `[B, 10]` of the shipped classifier."""
    params, log_probs = _shipped_classifier()
    return log_probs(params, images)


def prompt_labels(prompts: Sequence[str], batch: int) -> jax.Array:
    """The prompted digit of each image; one prompt per image."""
    if len(prompts) != batch:
        raise ValueError(f"got {len(prompts)} prompts for {batch} images; pass one per image.")
    return jnp.asarray([tiny.prompt_digit(p) for p in prompts], jnp.int32)


def _prompted(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]


def digit_alignment(images: jax.Array, prompts: Sequence[str]) -> jax.Array:
    """log p(prompted digit | image) under the classifier, `[B]` (at most 0)."""
    return _prompted(digit_log_probs(images), prompt_labels(prompts, images.shape[0]))


def digit_probability(images: jax.Array, prompts: Sequence[str]) -> jax.Array:
    """p(prompted digit | image) under the classifier, `[B]` in [0, 1]."""
    return jnp.exp(digit_alignment(images, prompts))


def digit_accuracy(images: jax.Array, prompts: Sequence[str]) -> jax.Array:
    """1.0 where the classifier's top class is the prompted digit, else 0.0, `[B]`."""
    predicted = jnp.argmax(digit_log_probs(images), axis=-1)
    return (predicted == prompt_labels(prompts, images.shape[0])).astype(jnp.float32)
