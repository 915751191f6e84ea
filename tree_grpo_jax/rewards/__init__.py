"""Rewards: a registry of functions from decoded images (and prompts) to scores.

Importing this package registers the built-in rewards:
`digit_alignment`, `digit_probability`, `digit_accuracy` (JAX-native, the tiny model's digit
classifier) and `jpeg_compressibility`, `jpeg_incompressibility` (host, PIL).
"""

from tree_grpo_jax.rewards import digits, jpeg
from tree_grpo_jax.rewards.registry import (
    CombinedReward,
    Reward,
    available_rewards,
    combined_reward,
    get_reward,
    register,
)

register("digit_alignment", digits.digit_alignment, on_host=False)
register("digit_probability", digits.digit_probability, on_host=False)
register("digit_accuracy", digits.digit_accuracy, on_host=False)
register("jpeg_compressibility", jpeg.jpeg_compressibility, on_host=True)
register("jpeg_incompressibility", jpeg.jpeg_incompressibility, on_host=True)

__all__ = [
    "CombinedReward",
    "Reward",
    "available_rewards",
    "combined_reward",
    "get_reward",
    "register",
]
