"""Digit rewards for the tiny model: its digit classifier scores the prompted digit.

The family's record (`family.py`) brings them to the reward registry under their names.
Everything here is JAX-native: the rewards run on the accelerator next to the rollout.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tree_grpo_jax.models.tiny.classifier import digit_log_probs
from tree_grpo_jax.models.tiny.grammar import prompt_digit


def prompt_labels(prompts: Sequence[str], batch: int) -> np.ndarray:
    """The prompted digit of each image; one prompt per image."""
    if len(prompts) != batch:
        raise ValueError(f"got {len(prompts)} prompts for {batch} images; pass one per image.")
    return np.asarray([prompt_digit(p) for p in prompts], np.int32)


# Jitted, each one program (run op by op, a handful per batch size, compiled on a first run).
@jax.jit
def _prompted(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]


@jax.jit
def _top_is(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
    return (jnp.argmax(log_probs, axis=-1) == labels).astype(jnp.float32)


def digit_alignment(images: jax.Array, prompts: Sequence[str]) -> jax.Array:
    """log p(prompted digit | image) under the classifier, `[B]` (at most 0)."""
    return _prompted(digit_log_probs(images), prompt_labels(prompts, images.shape[0]))


def digit_probability(images: jax.Array, prompts: Sequence[str]) -> jax.Array:
    """p(prompted digit | image) under the classifier, `[B]` in [0, 1]."""
    return jnp.exp(digit_alignment(images, prompts))


def digit_log_odds(images: jax.Array, prompts: Sequence[str]) -> jax.Array:
    """log(p / (1 - p)) of the prompted digit under the classifier, `[B]`, unbounded both ways.

    The twin's digits start near `digit_alignment`'s ceiling (about -0.02, log-odds about 4);
    the log-odds keeps rising as the classifier grows surer, as a preference model's score
    does, so a run has room to climb (and to over-optimise it, as runs do on PickScore).
    """
    log_probs = digit_log_probs(images)
    labels = prompt_labels(prompts, images.shape[0])
    others = jnp.where(jax.nn.one_hot(labels, log_probs.shape[-1], dtype=bool), -jnp.inf, log_probs)
    return _prompted(log_probs, labels) - jax.nn.logsumexp(others, axis=-1)


def digit_accuracy(images: jax.Array, prompts: Sequence[str]) -> jax.Array:
    """1.0 where the classifier's top class is the prompted digit, else 0.0, `[B]`."""
    return _top_is(digit_log_probs(images), prompt_labels(prompts, images.shape[0]))


# The family's rewards for the reward registry: name -> (reward, on_host); JAX-native, so
# none runs on the host.
REWARDS = {
    "digit_alignment": (digit_alignment, False),
    "digit_probability": (digit_probability, False),
    "digit_log_odds": (digit_log_odds, False),
    "digit_accuracy": (digit_accuracy, False),
}
