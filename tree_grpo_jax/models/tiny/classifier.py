"""The digit classifier that scores the tiny model's images (the digit rewards' network).

A small CNN trained by `python -m tree_grpo_jax.models.tiny.train --kind=classifier` on the
training split of `load_digits`; its weights ship in `tree_grpo_jax/assets/`.
"""

from __future__ import annotations

import functools
import pathlib

import chex
import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.models.tiny.weights import ASSETS_DIR, TRAIN_COMMAND, read_payload

NUM_CLASSES = 10
IMAGE_SIZE = 8
CLASSIFIER_PATH = ASSETS_DIR / "digit_classifier.msgpack"


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


def classifier_features(params, images: jax.Array) -> jax.Array:
    """`[B, H, W, C]` images in [0, 1] -> `[B, hidden]`: the activations before the logits."""
    _, state = DigitClassifier().apply(
        {"params": params},
        to_classifier_input(images),
        capture_intermediates=lambda module, name: module.name == "Dense_0",
    )
    return nn.relu(state["intermediates"]["Dense_0"]["__call__"][0])


def save_classifier(path, params) -> None:
    payload = {"format_version": 1, "params": jax.tree.map(np.asarray, params)}
    pathlib.Path(path).write_bytes(flax.serialization.msgpack_serialize(payload))


def load_classifier(path=None):
    """The classifier's params from `path` (default: the shipped weights)."""
    path = pathlib.Path(path) if path is not None else CLASSIFIER_PATH
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; run `{TRAIN_COMMAND} --kind=classifier`.")
    payload = read_payload(path, "digit classifier", f"{TRAIN_COMMAND} --kind=classifier")
    expected = jax.eval_shape(
        DigitClassifier().init, jax.random.key(0), jnp.zeros((1, IMAGE_SIZE, IMAGE_SIZE, 1))
    )["params"]
    params = payload.get("params")
    shapes = lambda tree: jax.tree.map(lambda a: tuple(getattr(a, "shape", ())), tree)
    if params is None or shapes(params) != shapes(expected):
        raise ModelLoadError(f"{path} does not hold digit classifier weights of this architecture.")
    return jax.device_put(params)  # as they are: `jnp.asarray` compiles a program per shape


@functools.cache
def _shipped_classifier():
    return load_classifier(), jax.jit(classifier_log_probs)


@functools.cache
def _shipped_features():
    return load_classifier(), jax.jit(classifier_features)


def digit_features(images: jax.Array) -> jax.Array:
    """The shipped classifier's hidden features `[B, 128]` (the diversity measure's embedding)."""
    params, features = _shipped_features()
    return features(params, images)


def digit_log_probs(images: jax.Array) -> jax.Array:
    """Log-probabilities `[B, 10]` of the shipped classifier."""
    params, log_probs = _shipped_classifier()
    return log_probs(params, images)
