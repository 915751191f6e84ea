"""The reward registry: a reward maps decoded images and their prompts to one score each.

    reward = get_reward("digit_alignment")
    scores = reward(images, prompts)          # images [B, H, W, C] float32 in [0, 1] -> [B]

Each reward says whether it runs on the host (numpy, e.g. PIL's JPEG encoder) or is
JAX-native (it can run on the accelerator, inside jit when its inputs allow). Rewards that
read a model (HPS-v2.1, PickScore, ...) are registered with `register_model` and built from
their folder by `load_reward(name, path)`. Several rewards combine into one weighted sum
with `combined_reward`.
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


@dataclasses.dataclass(frozen=True)
class _Entry:
    """How to build a reward: `make(path, **options) -> RewardFn`."""

    make: Callable[..., RewardFn]
    on_host: bool
    weights: str  # what folder the reward reads; "" when it needs none
    default_path: str  # used when no path is given ("" = none)


_REGISTRY: dict[str, _Entry] = {}


def _add(name: str, entry: _Entry, overwrite: bool) -> None:
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"a reward named {name!r} is already registered; pass overwrite=True.")
    _REGISTRY[name] = entry


def register(name: str, fn: RewardFn, on_host: bool, *, overwrite: bool = False) -> Reward:
    """Adds a reward that needs no weights; registering a taken name needs `overwrite=True`."""

    def make(path=None):
        del path  # checked by load_reward
        return fn

    _add(name, _Entry(make, bool(on_host), "", ""), overwrite)
    return Reward(name, fn, bool(on_host))


def register_model(
    name: str,
    make: Callable[..., RewardFn],
    *,
    weights: str,
    default_path: str = "",
    on_host: bool = False,
    overwrite: bool = False,
) -> None:
    """Adds a reward computed by a model read from a folder: `make(path, **options)`.

    `weights` says which folder that is (it ends the sentence when none is configured);
    `default_path` (a local folder or hub id) is used when no path is given.
    """
    if not weights:
        raise ValueError(f"register_model({name!r}) needs `weights`: what folder it reads.")
    _add(name, _Entry(make, bool(on_host), weights, default_path), overwrite)


def available_rewards() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown reward {name!r}; known rewards are: {', '.join(available_rewards())}."
        )
    return _REGISTRY[name]


def needs_weights(name: str) -> bool:
    """True when the reward reads a model folder (a path, or its default, must be given)."""
    return bool(_entry(name).weights)


def missing_weights(name: str, path: str | None) -> str | None:
    """The sentence saying why `name` cannot load without a path, or None if it can."""
    entry = _entry(name)
    if entry.weights and not path and not entry.default_path:
        return (
            f"reward {name!r} needs {entry.weights}: set --config.reward_models.{name}=/path "
            "(see the README, Rewards)."
        )
    return None


def load_reward(name: str, path: str | None = None, **options) -> Reward:
    """The reward `name`, built from its folder `path` when it reads one.

        reward = load_reward("hpsv2", "/models/hpsv2.1")
        scores = reward(images, prompts)   # [B, H, W, 3] in [0, 1], B prompts -> [B] float32

    `options` go to the reward's builder (for the CLIP rewards: dtype, chunk_size, mesh,
    and pickscore's divisor). Raises ValueError (ModelLoadError for a bad folder) with one
    sentence.
    """
    entry = _entry(name)
    if not entry.weights:
        if path or options:
            given = "path" if path else f"options ({', '.join(sorted(options))})"
            raise ValueError(f"reward {name!r} reads no model folder and takes no {given}.")
        return Reward(name, entry.make(), entry.on_host)
    sentence = missing_weights(name, path)
    if sentence:
        raise ValueError(sentence)
    return Reward(name, entry.make(path or entry.default_path, **options), entry.on_host)


def get_reward(name: str) -> Reward:
    """A reward that needs no weights (see `load_reward` for the others)."""
    return load_reward(name)


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


def combined_reward(
    weights: Mapping[str, float], loaded: Mapping[str, Reward] | None = None
) -> CombinedReward:
    """`combined_reward({"digit_alignment": 1.0, "jpeg_compressibility": 0.1})`.

    `loaded` holds rewards already built (e.g. by `load_reward` with a path); the others
    are built by name.
    """
    if not weights:
        raise ValueError("combined_reward needs at least one {name: weight} entry.")
    loaded = loaded or {}
    rewards = {name: loaded.get(name) or load_reward(name) for name in weights}
    return CombinedReward({n: float(w) for n, w in weights.items()}, rewards)
