"""Rewards: a registry of functions from decoded images (and prompts) to scores.

Importing this package registers the built-in rewards:
`digit_alignment`, `digit_probability`, `digit_accuracy` (JAX-native, the tiny model's digit
classifier), `jpeg_compressibility`, `jpeg_incompressibility` (host, PIL) and the
preference models `hpsv2`, `pickscore`, `aesthetic`, `clip_score` (JAX-native, each read from
its folder: `load_reward("hpsv2", "/models/hpsv2.1")`).

clip        a frozen CLIP embedding images and prompts (transformers' Flax towers)
preprocess  the official scorers' image preprocessing, bit-exact, in JAX
preference  the four preference rewards
convert     the pickled HPS-v2.1 and aesthetic releases -> folders these load
"""

from tree_grpo_jax.rewards import digits, jpeg, preference
from tree_grpo_jax.rewards.registry import (
    CombinedReward,
    Reward,
    available_rewards,
    combined_reward,
    get_reward,
    load_reward,
    missing_weights,
    needs_weights,
    register,
    register_model,
)

register("digit_alignment", digits.digit_alignment, on_host=False)
register("digit_probability", digits.digit_probability, on_host=False)
register("digit_accuracy", digits.digit_accuracy, on_host=False)
register("jpeg_compressibility", jpeg.jpeg_compressibility, on_host=True)
register("jpeg_incompressibility", jpeg.jpeg_incompressibility, on_host=True)
for _name, (_make, _weights, _default) in preference.BUILDERS.items():
    register_model(_name, _make, weights=_weights, default_path=_default)

__all__ = [
    "CombinedReward",
    "Reward",
    "available_rewards",
    "combined_reward",
    "get_reward",
    "load_reward",
    "missing_weights",
    "needs_weights",
    "register",
    "register_model",
]
