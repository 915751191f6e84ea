"""The reward registry: a reward maps decoded images and their prompts to one score each.

    reward = get_reward("digit_alignment")
    scores = reward(images, prompts)          # images [B, H, W, C] float32 in [0, 1] -> [B]

Each reward says whether it runs on the host (numpy, e.g. PIL's JPEG encoder) or is
JAX-native (it can run on the accelerator, inside jit when its inputs allow). Several rewards
combine into one weighted sum with `combined_reward`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import chex
import jax.numpy as jnp
import numpy as np

# (images [B, H, W, C] in [0, 1], prompts: one per image) -> scores [B]
RewardFn = Callable[[object, Sequence[str]], object]


@dataclasses.dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    on_host: bool  # True: numpy on the host; False: JAX-native

    def __call__(self, images, prompts: Sequence[str]):
        chex.assert_rank(images, 4)
        scores = self.fn(images, prompts)
        chex.assert_shape(scores, (images.shape[0],))
        return scores


_REGISTRY: dict[str, Reward] = {}


def register(name: str, fn: RewardFn, on_host: bool, *, overwrite: bool = False) -> Reward:
    """Adds a reward under `name`; registering a taken name needs `overwrite=True`."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"a reward named {name!r} is already registered; pass overwrite=True.")
    reward = Reward(name, fn, bool(on_host))
    _REGISTRY[name] = reward
    return reward


def available_rewards() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_reward(name: str) -> Reward:
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown reward {name!r}; known rewards are: {', '.join(available_rewards())}."
        )
    return _REGISTRY[name]


@dataclasses.dataclass(frozen=True)
class CombinedReward:
    """The weighted sum of registered rewards; on the host if any component is."""

    weights: Mapping[str, float]
    rewards: Mapping[str, Reward]

    @property
    def name(self) -> str:
        return "+".join(f"{w:g}*{n}" for n, w in self.weights.items())

    @property
    def on_host(self) -> bool:
        return any(r.on_host for r in self.rewards.values())

    def __call__(self, images, prompts: Sequence[str], return_components: bool = False):
        """The weighted sum `[B]`; with `return_components`, also `{name: scores [B]}`."""
        xp = np if self.on_host else jnp
        components = {n: xp.asarray(r(images, prompts)) for n, r in self.rewards.items()}
        total = sum(w * components[n] for n, w in self.weights.items())
        return (total, components) if return_components else total


def combined_reward(weights: Mapping[str, float]) -> CombinedReward:
    """`combined_reward({"digit_alignment": 1.0, "jpeg_compressibility": 0.1})`."""
    if not weights:
        raise ValueError("combined_reward needs at least one {name: weight} entry.")
    rewards = {name: get_reward(name) for name in weights}
    return CombinedReward({n: float(w) for n, w in weights.items()}, rewards)
